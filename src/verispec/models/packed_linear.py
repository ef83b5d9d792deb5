"""Faster decoding and verification passes on CPU: oneDNN-packed weights for few-row matrix products.

Which kernel is fastest for a few rows depends on the CPU. On a 2-core Xeon (2026-11-29) PyTorch's
default MKL path multiplied a weight by 1-3 rows at memory speed but by 4-12 rows at about half
that speed, so a verification pass over gamma+1 = 5 tokens cost twice a plain step; oneDNN with
weights reordered once into its blocked layout kept 4-16 rows close to one row. On a 2-core AMD
EPYC (2026-11-30; MKL is known not to take its fast paths on AMD) MKL is slow from one row on:
the Qwen2.5-1.5B MLP weight [8960, 1536] took 2.5 / 5.6 / 7.3 ms for 1 / 2 / 3 rows against 1.7 /
1.7 / 2.0 ms packed (one-off timing), and a whole 1-token step of that model 337 ms dense against
273 ms packed (`verispec costs --threads 2`). So the row count from which the packed copy is used
is measured once per model (:func:`fastest_min_packed_rows`) instead of fixed. The price is a
second copy of each weight. A module swap on the model instance, like torch's own quantisation
does: no transformers class is modified.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# From this row count on the packed kernel won on both CPUs; below it, it is measured.
_ALWAYS_PACKED_FROM = 4
# oneDNN's batch-size hint for the packed layout (any row count runs with any layout). Whole 1.5B
# steps on the AMD machine (one-off timing, two runs), hint 1 / 4 / 8: 1 row 286-295 / 249-259 /
# 226-253 ms, 7 rows 564-566 / 393-458 / 382-388 ms. 8 ~ gamma+1 of a typical verification pass.
_LAYOUT_ROWS = 8


class PackedLinear(nn.Module):
    """``nn.Linear`` with a dense weight for few rows and a oneDNN-packed copy for more."""

    def __init__(self, linear: nn.Linear, min_packed_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_packed_rows = min_packed_rows
        self.weight = linear.weight  # [out, in], shared, still what state_dict() and the dense path see
        self.bias = linear.bias
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _LAYOUT_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if x.numel() // self.in_features < self.min_packed_rows or x.requires_grad or x.dtype != torch.float32:
            return self.dense(x)
        return self.packed(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return nn.functional.linear(x, self.weight, self.bias)

    def packed(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for >= {self.min_packed_rows} rows"


def choose_min_packed_rows(dense_s: dict[int, float], packed_s: dict[int, float]) -> int:
    """The smallest row count r such that the packed kernel was no slower than the dense one for
    every measured row count >= r, never above ``_ALWAYS_PACKED_FROM`` (the value if packed lost at
    the largest measured count).

    ``dense_s`` / ``packed_s``: seconds per product by row count (the same row counts in both).
    """
    if sorted(dense_s) != sorted(packed_s) or not dense_s:
        raise ValueError("dense_s and packed_s must time the same, non-empty set of row counts")
    chosen = _ALWAYS_PACKED_FROM
    for rows in sorted(dense_s, reverse=True):
        if packed_s[rows] > dense_s[rows]:
            break
        chosen = rows
    return min(chosen, _ALWAYS_PACKED_FROM)


def fastest_min_packed_rows(layer: PackedLinear, repeats: int = 5) -> int:
    """Time ``layer`` dense and packed for 1.._ALWAYS_PACKED_FROM-1 rows on this machine (medians of
    ``repeats``, the two kernels interleaved so machine noise hits both) and choose the threshold.

    Pass the model's largest body weight: one that does not fit in the CPU's caches, as in a real pass.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    kernels = {"dense": layer.dense, "packed": layer.packed}
    times: dict[str, dict[int, list[float]]] = {name: {} for name in kernels}
    with torch.inference_mode():
        for rows in range(1, _ALWAYS_PACKED_FROM):
            x = torch.randn(rows, layer.in_features)
            for kernel in kernels.values():
                kernel(x)  # warm-up: first-call allocations and kernel selection
            for _ in range(repeats):
                for name, kernel in kernels.items():
                    started = time.perf_counter()
                    kernel(x)
                    times[name].setdefault(rows, []).append(time.perf_counter() - started)
    dense_s, packed_s = ({rows: statistics.median(ts) for rows, ts in times[name].items()} for name in kernels)
    return choose_min_packed_rows(dense_s, packed_s)


def float32_linear_sites(model: nn.Module, types: tuple[type, ...] = (nn.Linear,)) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, layer) for every float32 layer of exactly one of ``types`` in
    ``model``: where a module swap puts its replacement. Listed before any swap happens."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in types and child.weight.dtype == torch.float32
    ]


def pack_linears(model: nn.Module, min_packed_rows: int | None = None) -> nn.Module:
    """Replace every float32 ``nn.Linear`` in ``model`` by :class:`PackedLinear` (in place).

    ``min_packed_rows``: from how many rows on the packed copy is used; None (default) measures it
    on this machine with the model's largest linear other than its output layer.
    """
    if min_packed_rows is not None and min_packed_rows < 1:
        raise ValueError(f"min_packed_rows must be >= 1, got {min_packed_rows}")
    if not onednn_packing_available():
        raise RuntimeError("this PyTorch build has no oneDNN (mkldnn) linear kernels")
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = float32_linear_sites(model)
    layers, body = [], []
    for parent, name, child in swaps:
        layer = PackedLinear(child, min_packed_rows or _ALWAYS_PACKED_FROM)
        setattr(parent, name, layer)
        layers.append(layer)
        if child is not output_layer:
            body.append(layer)
    if min_packed_rows is None and layers:
        measured = fastest_min_packed_rows(max(body or layers, key=lambda layer: layer.weight.numel()))
        for layer in layers:
            layer.min_packed_rows = measured
    return model
