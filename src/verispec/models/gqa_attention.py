"""Verification passes over a long cache without copying it: grouped-query attention in place.

transformers' SDPA path expands every layer's cached keys and values from the model's few KV heads
to all query heads (``repeat_kv``, a full copy) whenever a pass carries an attention mask, i.e. for
every pass over 2+ new tokens after a cache — every verification pass. Single-token steps skip
the copy. Measured here (1.5B target, 2 threads, 4,096 cached tokens): a 4-token pass 730 ms against
400 ms for 1 token, 260 ms of it in those copies. PyTorch's SDPA reads the shared KV heads directly
with ``enable_gqa=True``, masked or not. This module registers that as an attention implementation
through transformers' ``AttentionInterface`` (its public extension point; no class is modified)
with SDPA's masks and switches a model to it; every other case goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "verispec_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, q_len, kv_len] bool or additive float, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output # [batch, q_len, heads, head_dim]; masked multi-row GQA without copying keys/values.

    Half-precision inputs on the CPU are attended in float32 and the output cast back: PyTorch's CPU
    SDPA took 524 us for one bfloat16 query row over 300 cached tokens (12 heads, 2 KV heads) against
    98 us with the conversions to float32 and back (2 threads, AMD EPYC), 14 ms of a 140 ms step of
    the bfloat16 1.5B target. Every pass of a model takes this path, so plain and speculative decoding
    attend alike (and a little more precisely than in bfloat16)."""
    if query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu":
        mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() else attention_mask
        output, _ = gqa_sdpa_attention(module, query.float(), key.float(), value.float(), mask, dropout, scaling, **kwargs)
        return output.to(query.dtype), None
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if not grouped or attention_mask is None or query.shape[2] == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [batch, heads, q_len, head_dim]
    return output.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Run ``model``'s attention through :func:`gqa_sdpa_attention` (in place) if it uses SDPA now."""
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the masks SDPA gets, built the same way
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(GQA_SDPA)
    return model
