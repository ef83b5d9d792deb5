"""A greedy draft's LM head at half the bytes: 4-bit logits, the top candidates recomputed in int8.

A draft step of the int8 0.5B draft streams 494 MB of weights, 136 MB of them the LM head
[151,936 x 896]. A greedy draft needs from the head only its top token and that token's probability
(the path stop), and which token the draft proposes never touches exactness (verification decides
what is emitted). So :class:`Int4ScreenedHead` computes every logit from a 4-bit copy of the int8
head (one scale per row: ``w4 = round(7 w8 / max|w8|)``, half the bytes), then recomputes the panels
of 8 logits holding each row's ``candidates`` largest with the int8 head's own kernel, bit for bit
the values the int8 head gives. Its argmax is the int8 head's wherever that token is among the
4-bit top ``candidates``, and the top token's softmax probability moves only by the 4-bit error of
the rest of the vocabulary (``panel_kernels.cpp``, ``screened_head_i8``, says what was measured).

Unlike :class:`~verispec.models.screened_head.ScreenedArgmaxHead` (the target's head, which must be
exact and therefore carries a proof), this screen has no bound: a Cauchy-Schwarz bound on the 4-bit
error left a median of 30,000 of the 151,936 tokens in doubt, while the actual error was ~2% of it.
Sampling drafts need the whole distribution and keep the int8 head.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.models.panel_linear import PanelLinear, panel_library

# Logits per row recomputed in int8 (with the rest of their panels of 8). The draft's int8 argmax was
# among the 4-bit top 64 at every one of 516 positions of its HumanEval answers; 64 panels are 57 KB
# of the int8 head's 136 MB.
DEFAULT_CANDIDATES = 64
# Rows the screen takes per call; more (greedy requests drafting together in a server batch) go
# through the int8 head. The 4-bit kernel's unpacking and the per-row selection grow with the rows:
# the 0.5B draft's head, 2 threads, 1 / 2 / 3 / 4 / 6 rows took 0.56-0.65x / 0.67-0.69x / 0.85-0.91x /
# 0.90-1.00x / 1.4x the int8 head's time (one-off script, medians of 31).
MAX_SCREEN_ROWS = 2
_BUILD_ROWS = 8192


def pack_int4_panels(weight: torch.Tensor) -> torch.Tensor:
    """4-bit ``weight`` # [out, in] (int8 values in -8..7) as the screen's panels # [ceil(out/8),
    ceil(ceil(in/4)/2), 8, 4] uint8: byte i of column n of panel p in pair j holds
    ``weight[8p + n, 8j + i] + 8`` in its low nibble and ``weight[8p + n, 8j + 4 + i] + 8`` in its
    high one (padding: weight 0, stored 8)."""
    if weight.dim() != 2 or weight.dtype != torch.int8 or bool((weight < -8).any()) or bool((weight > 7).any()):
        raise ValueError(f"weight must be a 2-D int8 tensor of 4-bit values (-8..7), got {weight.dtype} of shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    num_panels, num_pairs = -(-out_features // 8), -(-(-(-in_features // 4)) // 2)
    stored = torch.full((num_panels * 8, num_pairs * 8), 8, dtype=torch.uint8)
    stored[:out_features, :in_features] = (weight.to(torch.int16) + 8).to(torch.uint8)
    halves = stored.view(num_panels, 8, num_pairs, 2, 4)  # [panel, column, pair, low/high quad, i]
    packed = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)  # [panel, column, pair, i]
    return packed.transpose(1, 2).contiguous()


def int4_rows(rows: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 head's rows # [out, in] int8 with per-row scales # [out] as 4-bit rows # [out, in]
    (int8 values in -7..7) and their scales # [out] float32: ``w4 = round(7 w8 / max|w8|)``,
    ``s4 = s8 max|w8| / 7`` (a zero row stays zero)."""
    peak = rows.to(torch.int16).abs().amax(dim=1).float().clamp(min=1)  # [out] (int16: |-128| overflows int8)
    quantised = torch.round(rows.float() * (7.0 / peak[:, None])).to(torch.int8)
    return quantised, scales.float() * peak / 7.0


def screenable(head: nn.Module) -> bool:
    """Whether ``head`` is what :class:`Int4ScreenedHead` reads: an int8 :class:`PanelLinear` in the
    VNNI layout (the kernels built here have 8-bit dot products)."""
    return isinstance(head, PanelLinear) and head.is_int8 and head.colsum is not None


class Int4ScreenedHead(nn.Module):
    """The logits of an int8 VNNI :class:`PanelLinear` head, 4-bit everywhere except the panels of
    each row's ``candidates`` largest, which hold the int8 head's exact values. For greedy drafting."""

    def __init__(self, head: PanelLinear, candidates: int = DEFAULT_CANDIDATES) -> None:
        super().__init__()
        if not screenable(head):
            raise ValueError("Int4ScreenedHead needs an int8 PanelLinear head in the VNNI layout (8-bit dot products)")
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")
        self.head, self.candidates = head, candidates
        self.in_features, self.out_features = head.in_features, head.out_features
        # The int8 rows back from the head's VNNI panels [ceil(out/8), ceil(in/4), 8, 4] (dequantising
        # the source layer's weight took seconds), the scales as the int8 kernel applies them.
        panels = head.packed
        rows = panels.transpose(1, 2).reshape(panels.shape[0] * 8, -1)[: self.out_features, : self.in_features]
        scales = head.scale
        packed, scale4 = [], []
        for first in range(0, self.out_features, _BUILD_ROWS):  # bounded temporaries: the head is 151,936 rows
            quantised, scale = int4_rows(rows[first : first + _BUILD_ROWS], scales[first : first + _BUILD_ROWS])
            packed.append(pack_int4_panels(quantised))
            scale4.append(scale)
        self.packed, self.scale = torch.cat(packed), torch.cat(scale4).contiguous()  # _BUILD_ROWS is a multiple of 8

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32 -> [..., out_features]
        rows = x.numel() // self.in_features
        if rows > MAX_SCREEN_ROWS or rows == 0:
            return self.head(x)
        flat = x.reshape(rows, self.in_features).float().contiguous()
        out = torch.empty(rows, self.out_features)
        head = self.head
        ran = panel_library().verispec_screened_head_i8(
            flat.data_ptr(), rows, self.in_features, self.packed.data_ptr(), self.scale.data_ptr(), head.packed.data_ptr(), self.out_features,
            head.scale.data_ptr(), head.colsum.data_ptr(), None if head.kernel_bias is None else head.kernel_bias.data_ptr(),
            min(self.candidates, self.out_features), out.data_ptr(), torch.get_num_threads(),
        )
        if not ran:  # the library lacks 8-bit dot products, which a VNNI head (checked at construction) implies
            raise RuntimeError("the panel kernels were built without 8-bit dot products; the 4-bit screen cannot run")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, candidates={self.candidates}"
