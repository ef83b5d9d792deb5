"""The exact greedy choice of a float32 LM head, reading about a quarter of its bytes (an int8 screen).

A plain step of the 1.5B target streams ~6.1 GB of weights, 0.93 GB of them the LM head
[151,936 x 1,536] in float32, and greedy decoding (plain or speculative) only needs the argmax of
its logits. An int8 copy of the head (one scale per row) gives approximate logits ``A_v`` for a
quarter of the bytes, and each comes with a bound ``B_v >= |l_v - A_v|`` on its distance from the
logit ``l_v`` the float32 head computes. With ``LB = max_u (A_u - B_u)`` (some token's logit is at
least that), every token with ``A_v + B_v < LB`` is provably below the argmax, not even tied with
it. The few that remain ("survivors": 1-2 a row on code, measured below) get their logits from the
same float32 kernel over the same packed panels, so bit for bit the full head's values. The result
is a ``[n, vocab]`` tensor holding those exact logits and -inf elsewhere: its argmax (the lowest
index among ties, as ``torch.argmax``) is the full head's argmax, so greedy output is unchanged.

The 8-bit activations of the VNNI kernel share one step per row, ``max|h| / 127``, and the target's
top-layer features carry a few huge channels (``max|h|`` ~50 where a typical entry is ~3), so that
step is coarse. The ``OUTLIER_CHANNELS`` largest entries of each row therefore stay out of the 8-bit
product: their channels are multiplied in float32 with the head's float32 columns for them (a small
product over at most ``MAX_CACHED_CHANNELS`` cached columns), and the rest of the row gets a fine step. Writing ``D`` for those
channels, ``h'`` for ``h`` with them zeroed, ``h'q`` for ``h'`` in 8 bits, the bound (Cauchy-Schwarz on
each term, ``gamma_K = K u / (1 - K u)``, ``u = 2^-24``) is

    l_v - A_v =  sum_{i not in D} h_i (w_vi - s_v q_vi)   <= ||h|| ||w_v - s_v q_v||       (weight rounding)
              +  s_v sum_i (h'_i - h'q_i) q_vi          <= s_v ||h' - h'q|| ||q_v||      (8-bit activations, VNNI)
              +  float32 rounding of l_v                 <= gamma_K ||h|| ||w_v||
              +  float32 rounding of A_v                 <= gamma_K ||h|| (||w_v|| + s_v ||q_v||) + 1e-6 |A_v|

(``h'q`` is computed exactly as the kernel rounds, :func:`_activation_error`). A pass whose survivors
span many panels (unsure steps) is computed in full instead: then the values are the full head's
everywhere. On Spec-Bench chat answers (one-off script, 6 questions x 48 tokens) the split took the
survivors of a row from median 14 / 90th percentile 1,059 (7% of rows falling back) to 2 / 14 (none)
with the 8 largest entries of each row split off.

Measured (2026-12-01, 2-core Xeon, 2 threads, the 1.5B target's head on its own features while
answering a coding request; one-off script): 1 row 32 ms in full against 8 ms screened, 8 rows 40
against 15 ms, 17 rows 55 against 28 ms (the 8-bit product over more than 8 rows runs in two chunks).
In the engine: README, Performance.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from verispec.models.panel_linear import PanelLinear, int8_uses_vnni, pack_panels, pack_vnni_panels, panel_library

# Above this share of the head's panels holding survivors, the full head is cheaper: the int8 pass
# already read a quarter of its bytes, and the survivors' panels are float32.
MAX_SURVIVOR_PANEL_SHARE = 0.1
# Largest entries per row whose channels leave the 8-bit activations (VNNI), and at most how many
# channels do (their float32 head columns are kept at hand: MAX x vocab floats).
OUTLIER_CHANNELS = 8
MAX_CACHED_CHANNELS = 32
_UNIT_ROUNDOFF = 2.0**-24
_BUILD_ROWS = 8192


class ScreenedArgmaxHead:
    """Greedy logits of a float32 :class:`PanelLinear` LM head: exact where they can be the argmax, -inf elsewhere."""

    def __init__(self, head: PanelLinear) -> None:
        if not isinstance(head, PanelLinear) or head.is_int8 or head.is_bf16:
            raise ValueError(f"ScreenedArgmaxHead takes a float32 PanelLinear LM head, got {type(head).__name__}")
        self.head = head
        weight = head.weight.detach()  # [vocab, K] float32, what the packed panels hold
        self.vocab_size, self.in_features = weight.shape
        gamma = self.in_features * _UNIT_ROUNDOFF / (1 - self.in_features * _UNIT_ROUNDOFF)
        rows = torch.empty(weight.shape, dtype=torch.int8)
        self.scale = torch.empty(self.vocab_size)  # [vocab] float32
        self.per_feature_norm = torch.empty(self.vocab_size, dtype=torch.float64)  # [vocab]: times ||h||
        self.per_activation_error = torch.empty(self.vocab_size, dtype=torch.float64)  # [vocab]: times ||h - hq|| (VNNI)
        for first in range(0, self.vocab_size, _BUILD_ROWS):  # in slices: float64 copies of the whole head would be 1.9 GB
            part = slice(first, first + _BUILD_ROWS)
            block = weight[part]
            amax = block.abs().amax(dim=1)
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            rows[part] = torch.round(block / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            self.scale[part] = scale
            block64, rows64, scale64 = block.double(), rows[part].double(), scale.double()
            residual = (block64 - rows64 * scale64[:, None]).norm(dim=1)  # ||w_v - s_v q_v||
            rows_norm = rows64.norm(dim=1) * scale64  # s_v ||q_v||
            self.per_feature_norm[part] = _round_up(residual + gamma * (2 * block64.norm(dim=1) + rows_norm))
            self.per_activation_error[part] = _round_up(rows_norm)
        self.vnni = int8_uses_vnni()
        if self.vnni:
            self.int8_panels, self.colsum = pack_vnni_panels(rows)
        else:
            self.int8_panels, self.colsum = pack_panels(rows), None
        self.bias = head.kernel_bias
        self.num_panels, _, self.panel_width = head.packed.shape
        self.widest = (float(self.per_feature_norm.max()), float(self.per_activation_error.max()))  # the per-row factors' maxima
        self._channel_slot: dict[int, int] = {}  # outlier channel -> its row in _channel_columns
        self._channel_columns = torch.empty(MAX_CACHED_CHANNELS, self.vocab_size)  # [slots, vocab] float32 head columns

    @classmethod
    def for_head(cls, head: nn.Module) -> "ScreenedArgmaxHead | None":
        """One screen per LM-head module (the int8 copy is built once), or None if ``head`` is not a
        float32 :class:`PanelLinear` (then callers compute the full head)."""
        if not isinstance(head, PanelLinear) or head.is_int8 or head.is_bf16:
            return None
        screen = _SHARED.get(head)
        if screen is None:
            screen = _SHARED[head] = cls(head)
        return screen

    @property
    def float32_channels(self) -> list[int]:
        """The feature channels kept out of the 8-bit activations so far (see ``OUTLIER_CHANNELS``)."""
        return list(self._channel_slot)

    def covers(self, num_rows: int) -> bool:
        """Whether a product over this many rows runs the panel kernel (else the head falls back to PyTorch)."""
        return 0 < num_rows <= self.head.max_kernel_rows

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor) -> torch.Tensor:  # features: [n, K] -> [n, vocab]
        num_rows = features.shape[0]
        if not self.covers(num_rows) or features.dtype != torch.float32 or not bool(torch.isfinite(features).all()):
            return self.head(features)
        features = features.contiguous()
        approx, bound_coeffs = self.approximate(features)
        feature_norm, activation_error = bound_coeffs
        # LB from each row's top approximate logit; then a cheap cut with the row's largest bound
        # (a superset of the survivors), and the exact bounds on what passes it.
        top, top_index = approx.max(dim=1, keepdim=True)  # [n, 1]
        lower = top.double() - self._bound(top, top_index, *bound_coeffs)  # [n, 1]: some token's logit reaches it
        widest = _bound(approx.abs().amax(dim=1, keepdim=True), *bound_coeffs, *self.widest)  # [n, 1] >= every B_v of the row
        # float32 threshold rounded down: the [n, vocab] comparison stays float32 and keeps a superset
        threshold = torch.nextafter((lower - _round_up(widest)).float(), torch.tensor(float("-inf")))
        row_ids, token_ids = torch.nonzero(approx >= threshold, as_tuple=True)
        candidates = approx[row_ids, token_ids][:, None]
        bound = self._bound(candidates, token_ids[:, None], *(c[row_ids] for c in bound_coeffs))[:, 0]
        # The best lower bound among the candidates tightens LB.
        lower = lower[:, 0].scatter_reduce(0, row_ids, candidates[:, 0].double() - bound, reduce="amax")
        keep = candidates[:, 0].double() + bound >= lower[row_ids]
        token_ids = token_ids[keep]
        width = self.panel_width
        panels = torch.unique(torch.div(token_ids, width, rounding_mode="floor"))
        if len(panels) > MAX_SURVIVOR_PANEL_SHARE * self.num_panels:
            return self.head(features)
        exact = torch.empty(num_rows, len(panels) * width)
        panels = panels.contiguous()
        panel_library().verispec_panel_linear_f32_panels(
            features.data_ptr(), num_rows, self.in_features, self.head.packed.data_ptr(), panels.data_ptr(), len(panels), exact.data_ptr(), torch.get_num_threads()
        )
        columns = (panels[:, None] * width + torch.arange(width)).reshape(-1)  # [len(panels)·width] token ids, padding past vocab
        in_vocab = columns < self.vocab_size
        columns, exact = columns[in_vocab], exact[:, in_vocab]
        if self.bias is not None:
            exact = exact + self.bias[columns]  # as the kernel adds it: one float32 addition
        logits = torch.full((num_rows, self.vocab_size), float("-inf"))
        logits[:, columns] = exact
        return logits

    @torch.inference_mode()
    def logit_bounds(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # features: [n, K]
        """The screen's approximate logits ``A`` # [n, vocab] float32 and their bounds ``B`` # [n, vocab]
        float64, with ``|l - A| <= B`` for the logits ``l`` the float32 head computes (for inspection and tests)."""
        features = features.float().contiguous()
        approx, bound_coeffs = self.approximate(features)
        return approx, self._bound(approx, torch.arange(self.vocab_size).expand_as(approx), *bound_coeffs)

    def approximate(self, features: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The int8 logits A # [n, vocab] of features # [n, K] (contiguous float32) and the rows' bound
        coefficients: the first, costly part of a screened pass (``--target-kernels auto`` times it)."""
        num_rows = features.shape[0]
        feature_norm = _round_up(features.double().norm(dim=1, keepdim=True))  # [n, 1] ||h||
        main, outliers = features, None
        if self.vnni:  # the channels of the largest entries in float32, the rest in 8 bits with a fine step
            channels = self._outlier_channels(features)
            outliers = features[:, channels]  # [n, |D|]
            main = features.clone()
            main[:, channels] = 0.0
        approx = torch.empty(num_rows, self.vocab_size)
        panel_library().verispec_panel_linear_i8(
            main.data_ptr(), num_rows, self.in_features, self.int8_panels.data_ptr(), self.vocab_size, self.scale.data_ptr(),
            None if self.colsum is None else self.colsum.data_ptr(), None if self.bias is None else self.bias.data_ptr(), approx.data_ptr(),
            torch.get_num_threads(),
        )
        if outliers is None:
            return approx, (feature_norm, torch.zeros_like(feature_norm))
        approx.addmm_(outliers, self._channel_columns[: len(channels)])
        return approx, (feature_norm, _activation_error(main))  # >= ||h' - h'q||

    def _outlier_channels(self, features: torch.Tensor) -> list[int]:
        """The channels kept out of the 8-bit activations: every channel that has held one of a row's
        ``OUTLIER_CHANNELS`` largest entries so far, up to ``MAX_CACHED_CHANNELS`` (a model's huge
        channels are the same few from token to token, so the set settles). Each one's float32 head
        column is gathered once (a strided read of the head) into a contiguous block."""
        largest = features.abs().topk(min(OUTLIER_CHANNELS, self.in_features), dim=1).indices
        for channel in torch.unique(largest).tolist():
            if channel not in self._channel_slot and len(self._channel_slot) < MAX_CACHED_CHANNELS:
                self._channel_columns[len(self._channel_slot)] = self.head.weight.detach()[:, channel]
                self._channel_slot[channel] = len(self._channel_slot)
        return list(self._channel_slot)  # in slot order

    def _bound(
        self,
        approx: torch.Tensor,  # [r, c] A_v
        token_ids: torch.Tensor,  # [r, c] v
        feature_norm: torch.Tensor,  # [r, 1] ||h|| (float64)
        activation_error: torch.Tensor,  # [r, 1] bound on ||h' - h'q|| (float64)
    ) -> torch.Tensor:  # [r, c] float64 B_v
        return _bound(approx, feature_norm, activation_error, self.per_feature_norm[token_ids], self.per_activation_error[token_ids])


def _bound(
    approx: torch.Tensor,  # [r, c] A_v (or an upper bound on |A_v|)
    feature_norm: torch.Tensor,  # [r, 1] ||h|| (float64)
    activation_error: torch.Tensor,  # [r, 1] bound on ||h' - h'q|| (float64)
    per_feature_norm: torch.Tensor | float,  # [r, c] or a scalar: row v's factor of ||h||
    per_activation_error: torch.Tensor | float,  # [r, c] or a scalar: row v's factor of ||h' - h'q||
) -> torch.Tensor:  # [r, c] float64 B_v: the bound of the module docstring, plus slack for float32 rounding of A_v
    return feature_norm * per_feature_norm + activation_error * per_activation_error + 1e-6 * approx.double().abs() + 1e-4


def _activation_error(features: torch.Tensor) -> torch.Tensor:  # features: [n, K] float32 -> [n, 1] float64
    """An upper bound on ||h - hq|| per row, hq the 8-bit activations the VNNI kernel multiplies by.

    ``quantize_rows`` in panel_kernels.cpp computes ``t = max|h| / 127``, ``u = round(h * (1 / t))``
    (float32, half to even), ``hq = t u``; the same IEEE operations here give the same ``u``. An
    element within 1e-3 of a rounding tie could still round the other way, moving its error by ``t``:
    ``sqrt(#such) · t`` more covers that."""
    amax = features.abs().amax(dim=1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # float32, as the kernel
    scaled = features * (1 / step)
    levels = torch.round(scaled)
    error = (features.double() - levels.double() * step.double()).norm(dim=1, keepdim=True)
    near_ties = ((scaled - torch.floor(scaled) - 0.5).abs() < 1e-3).sum(dim=1, keepdim=True)
    return _round_up(error + near_ties.double().sqrt() * step.double())


def _round_up(values: torch.Tensor) -> torch.Tensor:
    """Float64 values nudged up past any rounding of the float64 arithmetic that produced them."""
    return values.double() * (1 + 1e-9) + 1e-12


_SHARED: "weakref.WeakKeyDictionary[nn.Module, ScreenedArgmaxHead]" = weakref.WeakKeyDictionary()

