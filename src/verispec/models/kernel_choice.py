"""Which kernels run the target's products on this machine: timed on its own weights, not assumed.

The fastest few-row float32 kernel depends on the CPU, and the gap decides both the plain step and
what a verification pass costs (`verispec costs --threads 2`, Qwen2.5-Coder-1.5B, 300-token cache):
on a 2-core AMD EPYC (AVX2, 2026-11-30) our panel kernels took 176 ms for 1 token and 289 ms for 7
against 226 / 467 ms oneDNN-packed; on a 2-core Xeon with AVX-512 (2026-11-30, a later session)
oneDNN-packed took 265 / 331 ms against 318 / 563 ms. So ``--target-kernels auto`` (the default)
times both once, when the target is prepared, and keeps the faster.

What is timed: a sweep over several of the model's largest body weights (more bytes than a
last-level cache holds, so the weights stream from memory as in a real pass), for 1 row (a decoding
step) and ``gamma+1``-like rows (a verification pass), plus a slice of the LM head holding the
head's share of a pass (the 1.5B target's head is 0.93 GB against 5.2 GB of body); medians of a few
sweeps, the kernels interleaved so machine noise hits both alike. A second copy of the swept
weights exists only while timing (~0.9 GB for the 1.5B target; about two seconds in all).

Greedy passes on the panel kernels read the head through its exact int8 screen
(:mod:`verispec.models.screened_head`, about a quarter of the bytes), which oneDNN-packed weights
cannot use. With ``screened_head=True`` the panel side's head slice is timed as the screen runs
(its int8 product and the float32 outlier columns; the few exact survivors are left out), so a
greedy run is not handed packed kernels that are faster on the body but slower on the whole pass.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from verispec.models.packed_linear import PackedLinear, float32_linear_sites, onednn_packing_available
from verispec.models.panel_linear import PanelLinear, panel_kernels_unavailable_reason
from verispec.models.screened_head import ScreenedArgmaxHead

TIMED_ROWS = (1, 8)  # a decoding step; a verification pass of gamma+1 = 8 tokens (gamma 6-8 is typical)
LONG_PASS_ROWS = 256  # a prompt's prefill: more rows than one panel kernel call takes
LONG_PASS_WEIGHTS = 3  # compute-bound: a few weights tell, they need not stream from memory
# Larger than the last-level caches seen here (32 MiB on the EPYC, 260 MiB on the Xeon).
SWEEP_BYTES = 768 << 20


@dataclass
class KernelChoice:
    """The chosen kernel family and what was measured (seconds per sweep by row count; empty if
    only one family could run here, so nothing was timed)."""

    name: str  # "panel" or "packed"
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    num_weights: int = 0  # body weights swept (the head slice not counted)
    head_rows: int = 0  # rows of the LM head's slice in the sweep (0: none)
    screened_head: bool = False  # the panel side's head slice timed as the greedy screen runs
    # Products over more rows than one panel call takes (prefill): seconds over LONG_PASS_ROWS rows
    # for "panel" (in chunks) and "dense" (torch's product); empty: not timed.
    long_pass_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def long_passes(self) -> str:
        """How products over more rows than one panel call takes run: the faster timed, else "dense"."""
        return min(self.long_pass_seconds, key=self.long_pass_seconds.get) if self.long_pass_seconds else "dense"

    def row_cost(self, name: str, rows: int = TIMED_ROWS[-1]) -> float | None:
        """What ``rows`` rows of ``name``'s sweep cost against one row (None if not timed)."""
        seconds = self.seconds.get(name, {})
        return seconds[rows] / seconds[1] if rows in seconds and seconds.get(1) else None

    def summary(self) -> str:
        if not self.seconds:
            return f"{self.name} (the only kernels that run here)"
        rows = " / ".join(str(count) for count in TIMED_ROWS)
        timings = ", ".join(f"{name} " + " / ".join(f"{1e3 * self.seconds[name][count]:.1f}" for count in TIMED_ROWS) for name in self.seconds)
        head = ""
        if self.head_rows:
            head = f" and {self.head_rows} LM-head rows" + (" (screened on panel)" if self.screened_head else "")
        long = ""
        if self.long_pass_seconds:
            times = ", ".join(f"{name} {1e3 * seconds:.0f}" for name, seconds in self.long_pass_seconds.items())
            long = f"; prefill products {'in panel chunks' if self.long_passes == 'panel' else 'dense'} (ms for {LONG_PASS_ROWS} rows: {times})"
        return f"{self.name} (timed here over {self.num_weights} of the model's weights{head}, ms for {rows} rows: {timings}{long})"


def sweep_weights(model: nn.Module, min_bytes: int = SWEEP_BYTES) -> list[nn.Linear]:
    """The model's largest float32 body linears (never its output layer), largest first, until
    together they hold ``min_bytes`` (or all of them, for a small model)."""
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = sorted((child for _, _, child in float32_linear_sites(model) if child is not output_layer), key=lambda layer: -layer.weight.numel())
    chosen, total = [], 0
    for layer in linears:
        if total >= min_bytes:
            break
        chosen.append(layer)
        total += layer.weight.numel() * 4
    return chosen


def head_slice(model: nn.Module, swept: list[nn.Linear]) -> nn.Linear | None:
    """The first rows of ``model``'s float32 output layer, as many as give it the same share of the
    sweep as of a pass: ``vocab x swept body bytes / all body bytes`` (the whole head when the
    sweep holds the whole body). A view of the weights, no copy. None if the output layer is not a
    float32 ``nn.Linear`` or nothing was swept."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32 or not swept:
        return None
    body_bytes = sum(child.weight.numel() for _, _, child in float32_linear_sites(model) if child is not head)
    swept_bytes = sum(layer.weight.numel() for layer in swept)
    rows = max(1, min(head.out_features, round(head.out_features * swept_bytes / body_bytes)))
    part = nn.Linear(head.in_features, rows, bias=head.bias is not None)
    part.weight = nn.Parameter(head.weight.detach()[:rows], requires_grad=False)
    if head.bias is not None:
        part.bias = nn.Parameter(head.bias.detach()[:rows], requires_grad=False)
    return part


def screened_pass(head: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a greedy pass through the screen costs over ``head``'s rows, bar the exact survivors
    (a few panels on real text): the screen's own approximation (int8 product, float32 outlier
    channels, bound coefficients) over a throwaway screen of these rows."""
    screen = ScreenedArgmaxHead(PanelLinear(head))
    return lambda features: screen.approximate(features)[0]  # features: [n, K] -> [n, rows] approximate logits


def time_sweeps(
    kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]], in_features: list[int], repeats: int = 3, row_counts: tuple[int, ...] = TIMED_ROWS
) -> dict[str, dict[int, float]]:
    """Median seconds of one sweep (every callable of a kernel family once, in order) per row count
    in ``row_counts``; ``in_features[i]`` is the input width of the i-th callable."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in row_counts} for name in kernels}
    with torch.inference_mode():
        for rows in row_counts:
            inputs = [torch.randn(rows, width) for width in in_features]
            for attempt in range(repeats + 1):  # the first sweep warms up (allocations, kernel selection)
                for name, layers in kernels.items():
                    started = time.perf_counter()
                    for layer, x in zip(layers, inputs):
                        layer(x)
                    if attempt:
                        times[name][rows].append(time.perf_counter() - started)
    return {name: {rows: statistics.median(ts) for rows, ts in by_rows.items()} for name, by_rows in times.items()}


def fastest_target_kernels(model: nn.Module, min_bytes: int = SWEEP_BYTES, repeats: int = 3, screened_head: bool = False) -> KernelChoice:
    """Time the panel kernels against oneDNN-packed weights on ``model``'s own weights (and its head's
    share) and choose the one with the smaller total over ``TIMED_ROWS`` (a step and a verification
    pass weigh alike). ``screened_head``: the run decodes greedily with the int8-screened head, so
    time the panel side's head slice as the screen. Only one family available here: that one,
    untimed. Neither: RuntimeError."""
    candidates = []
    if panel_kernels_unavailable_reason() is None:
        candidates.append("panel")
    if onednn_packing_available():
        candidates.append("packed")
    if not candidates:
        raise RuntimeError(f"neither panel kernels ({panel_kernels_unavailable_reason()}) nor oneDNN packing run here")
    weights = sweep_weights(model, min_bytes)
    if len(candidates) == 1 or not weights:
        return KernelChoice(candidates[0])
    head = head_slice(model, weights)
    timed = weights + ([head] if head is not None else [])
    screened = screened_head and head is not None
    with torch.no_grad():
        kernels = {
            "panel": [PanelLinear(linear) for linear in weights] + ([screened_pass(head) if screened else PanelLinear(head)] if head is not None else []),
            "packed": [PackedLinear(linear, min_packed_rows=1) for linear in timed],
        }
    seconds = time_sweeps(kernels, [linear.in_features for linear in timed], repeats)
    del kernels  # the second copies go before the model's real conversion makes its own
    name = min(seconds, key=lambda kernel: sum(seconds[kernel].values()))
    choice = KernelChoice(name, seconds, len(weights), head.out_features if head is not None else 0, screened)
    if name == "panel":
        choice.long_pass_seconds = time_long_passes(weights[:LONG_PASS_WEIGHTS], repeats)
    return choice


def time_long_passes(weights: list[nn.Linear], repeats: int = 3) -> dict[str, float]:
    """Median seconds of products over ``LONG_PASS_ROWS`` rows through ``weights``: the panel kernels
    in chunks of the rows one call takes (``PanelLinear(chunk_long_passes=True)``) against torch's
    dense product (where a PanelLinear sends them otherwise)."""
    with torch.no_grad():
        kernels = {
            "panel": [PanelLinear(linear, chunk_long_passes=True) for linear in weights],
            "dense": [functools.partial(nn.functional.linear, weight=linear.weight, bias=linear.bias) for linear in weights],
        }
    seconds = time_sweeps(kernels, [linear.in_features for linear in weights], repeats, row_counts=(LONG_PASS_ROWS,))
    return {name: by_rows[LONG_PASS_ROWS] for name, by_rows in seconds.items()}
