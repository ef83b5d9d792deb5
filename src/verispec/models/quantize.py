"""Weight-only speed-ups for drafters: int8 dynamic quantisation of the linear layers.

A drafter may compute anything: verification uses the probabilities it actually sampled from,
so quantising the draft keeps the output exact while making each draft step cheaper. The
target is never quantised here (its precision is the user's choice of dtype).
"""

from __future__ import annotations

import os
import warnings
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


def quantize_int8(model: PreTrainedModel | torch.nn.Module) -> PreTrainedModel | torch.nn.Module:
    """Swap every ``nn.Linear`` for PyTorch's int8 dynamic-quantised linear, one scale per output row.

    Per-row (per-channel) weight scales cost nothing extra here (the same fbgemm kernels: a
    Qwen2.5-0.5B draft step's linears take 35 ms either way on 2 cores) but keep rows with small
    weights from being rounded to a few levels by one tensor-wide scale: the 0.5B draft's greedy
    choice agrees with the 1.5B target's on 82.2% of positions of held-out code, against 78.6%
    per-tensor and 85.6% in float32. Higher agreement is longer accepted runs at the same draft cost.
    Uses torch's own module swap on this instance (no transformers class is modified).
    The embedding stays float32. Returns the same model object, quantised in place.
    """
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("int8 quantisation needs a float32 model; load it with dtype=torch.float32")
    with warnings.catch_warnings():
        # torch 2.13 marks quantised tensor creation as deprecated; the pinned version supports it.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
    return model


def is_quantized(module: nn.Module) -> bool:
    """An int8 dynamic-quantised linear (what :func:`quantize_int8` swaps in): its weight is a method."""
    return callable(getattr(module, "weight", None))


def float_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight # [out, in] as float32, dequantised if the layer is int8."""
    if is_quantized(linear):
        return linear.weight().dequantize().float()
    return linear.weight.detach().float()


def int8_rows_and_scales(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 dynamic linear's exact weight rows # [out, in] int8, per-row scales # [out] float64
    and zero points # [out] int64 (a per-tensor scale is repeated for each row)."""
    weight = linear.weight()  # quantised [out, in]
    if weight.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scales = torch.full((weight.shape[0],), weight.q_scale(), dtype=torch.float64)
        zero_points = torch.full((weight.shape[0],), weight.q_zero_point(), dtype=torch.long)
    else:
        scales, zero_points = weight.q_per_channel_scales().double(), weight.q_per_channel_zero_points().long()
    return weight.int_repr(), scales, zero_points


def stacked_linear(linears: list[nn.Module]) -> nn.Module:
    """One linear layer computing ``torch.cat([linear(x) for linear in linears], -1)`` in one product.

    Float layers are concatenated row-wise. int8 layers keep their exact int8 rows and per-row
    scales (a per-tensor scale is repeated for each of its rows), so the stacked layer's output
    equals the separate ones': re-quantising dequantised weights would move the scales.
    """
    if not linears or len({linear.in_features for linear in linears}) != 1:
        raise ValueError("stacked_linear needs one or more linear layers of the same input width")
    biases = [linear.bias() if is_quantized(linear) else linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach().float() if b is not None else torch.zeros(linear.out_features) for b, linear in zip(biases, linears)])
    if not any(is_quantized(linear) for linear in linears):
        weight = torch.cat([linear.weight.detach() for linear in linears])
        stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            stacked.weight.copy_(weight)
            if bias is not None:
                stacked.bias.copy_(bias)
        return stacked.requires_grad_(False)
    if not all(is_quantized(linear) for linear in linears):
        raise ValueError("stacked_linear cannot mix int8 and float layers")
    int_rows, scales, zero_points = zip(*(int8_rows_and_scales(linear) for linear in linears))
    weight = torch._make_per_channel_quantized_tensor(torch.cat(int_rows), torch.cat(scales), torch.cat(zero_points), 0)
    stacked = torch.ao.nn.quantized.dynamic.Linear(weight.shape[1], weight.shape[0], bias_=bias is not None, dtype=torch.qint8)
    stacked.set_weight_bias(weight, bias)
    return stacked


@cache
def native_bf16_products() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16): where it does not,
    bfloat16 products are emulated and slower than float32 ones. ``VERISPEC_NO_BF16=1`` says no."""
    from verispec.models.panel_linear import cpu_flags  # (it imports this module)

    return not os.environ.get("VERISPEC_NO_BF16") and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class MixedPrecisionLinear(nn.Linear):
    """A float32 linear layer whose products run in bfloat16 except over its first
    ``float32_columns`` inputs: float32 in and out, weights rounded once, inputs per call.

    For a drafter's layers that int8 would ruin (see :func:`~verispec.drafters.draft_vocab.resolve_head`).
    bfloat16 keeps 8 significant bits per element whatever its size, and where the CPU multiplies
    bfloat16 natively its products run at about twice float32's rate (EAGLE's fc, 3072 -> 1536, on
    this Zen 4: 0.34 against 0.47 ms for one row, 0.75 against 1.5 ms for 3-4 rows). But
    PyTorch's CPU bfloat16 products come out rounded to bfloat16, which swallows inputs whose share
    of the sum is small beside the rest's: EAGLE's token embeddings (|x| ~0.02) beside the target's
    features (|x| up to ~36). Those columns (the first ``float32_columns``) multiply in float32.
    The float32 weight stays (state dict, and readers of ``weight``).

    ``bf16_rest=False`` (CPUs without native bfloat16 products, where PyTorch emulates them slower
    than float32): every column stays float32 and the layer is only computed by its two parts.
    Float32 parts run through our few-row kernels where they run (:func:`~verispec.models.panel_linear.panel_or_same`;
    PyTorch's product beyond their rows): on a 2-core Zen 4 EPYC without AVX-512, EAGLE's fc over
    1 / 3 / 10 rows took 0.73 / 2.3 / 2.3 ms through PyTorch's float32 product and 0.24 / 0.29 /
    0.63 ms through the kernels (one-off timing, weights in cache).
    """

    def __init__(self, linear: nn.Linear, float32_columns: int, bf16_rest: bool = True) -> None:
        if not 0 <= float32_columns <= linear.in_features:
            raise ValueError(f"float32_columns must be within 0..{linear.in_features}, got {float32_columns}")
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch.float32)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.requires_grad_(False)
        self.float32_columns, self.bf16_rest = float32_columns, bf16_rest
        # contiguous copies of each part's columns (the products read them row by row), never saved;
        # the float32 ones are held by their products, a tuple, not submodules: the kernels' packed
        # copies stay out of the state dict
        first, rest = self.weight.detach()[:, :float32_columns].contiguous(), self.weight.detach()[:, float32_columns:].contiguous()
        self.register_buffer("weight_rest_part", rest.to(torch.bfloat16) if bf16_rest else rest, persistent=False)
        self._float32_products = (_part_product(first), None if bf16_rest else _part_product(rest))

    def part_product(self, x: torch.Tensor, rest: bool) -> torch.Tensor:
        """One part's product, no bias # [..., out_features] float32: x # [..., part's columns] holds
        the input's first ``float32_columns`` entries (``rest`` False) or the others (True)."""
        if rest and self.bf16_rest:
            return F.linear(x.to(torch.bfloat16), self.weight_rest_part).float()
        return self._float32_products[int(rest)](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        split = self.float32_columns
        out = self.part_product(x[..., split:], rest=True).add_(self.part_product(x[..., :split], rest=False))  # [..., out_features]
        return out if self.bias is None else out.add_(self.bias)


def _part_product(weight: torch.Tensor) -> nn.Module:
    """x # [..., columns] -> x @ weight.T # [..., out] for a float32 weight # [out, columns]: our
    few-row kernels where they run, else PyTorch's product."""
    from verispec.models.panel_linear import panel_or_same  # (it imports this module)

    part = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=False)  # no random init: 13 ms for fc's half
    part.weight = nn.Parameter(weight, requires_grad=False)
    return panel_or_same(part) if weight.shape[1] else part


def linear_columns(
    linear: nn.Linear,  # float32, or a MixedPrecisionLinear split at these columns
    x: torch.Tensor,  # [..., columns]: the input's entries in these columns only
    columns: slice,
) -> torch.Tensor:
    """The part of ``linear(input)`` that ``input[..., columns] = x`` contributes, bias excluded
    # [..., out_features] float32, in the layer's own precision: a linear layer over a concatenated
    input is the sum of such parts (plus the bias), each computable on its own rows."""
    first, end, step = columns.indices(linear.in_features)
    if isinstance(linear, MixedPrecisionLinear):
        split = linear.float32_columns
        if step != 1 or (first, end) not in ((0, split), (split, linear.in_features)):
            raise ValueError(f"linear_columns: a MixedPrecisionLinear gives its parts only (columns 0..{split} or {split}..{linear.in_features}), got {first}..{end}")
        return linear.part_product(x, rest=first == split)
    if is_quantized(linear):
        raise ValueError("linear_columns takes a float32 or MixedPrecisionLinear layer, not an int8 one")
    return F.linear(x, linear.weight[:, columns])
