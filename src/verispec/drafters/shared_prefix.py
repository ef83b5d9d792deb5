"""Attention of many short row groups over ONE shared cached prefix, without copying the prefix.

Drafting heads run many independent rows after the same context: the parallel head's blocks
(a round's, or (K-1)·m known-slot blocks for contextual correction), the EAGLE head's one-step
rows that score candidate pairs. Each batch entry attends to the shared prefix (broadcast, not
expanded per row) and to its own new rows:

    out = softmax( [q·K_prefixᵀ ; q·K_ownᵀ] / √d ) · [V_prefix ; V_own]

Products with cached keys and values run in the cache's precision (a bfloat16 cache: half the
bytes a draft step reads over a long context), scores and outputs in float32.
"""

from __future__ import annotations

import math

import torch

KeysValues = tuple[torch.Tensor, torch.Tensor]  # keys, values # [batch or 1, kv_heads, n, head_dim]


def shared_prefix_attention(
    query: torch.Tensor,  # [batch, heads, n, head_dim]
    prefix: KeysValues | None,  # [batch or 1, kv_heads, P, head_dim]: rotated keys, values
    prefix_visible: torch.Tensor | None,  # [batch, 1, 1, P] bool: which prefix keys a batch entry sees (None: all)
    own: KeysValues,  # [batch, kv_heads, n, head_dim]: the entry's own rows' keys, values
    causal: bool,  # own rows see each other causally (True) or all of each other (False)
) -> torch.Tensor:
    """Grouped-query attention output # [batch, heads, n, head_dim]."""
    batch, heads, num_new, head_dim = query.shape
    kv_heads = own[0].shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * num_new, head_dim) / math.sqrt(head_dim)
    own_scores = cache_product(grouped, own[0].transpose(-1, -2))  # [batch, kv, group·n, n]
    if causal and num_new > 1:
        future = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).triu(1).repeat(heads // kv_heads, 1)
        own_scores = own_scores.masked_fill(future, float("-inf"))
    if prefix is None:
        weights = own_scores.softmax(-1)
        return cache_product(weights, own[1]).reshape(batch, heads, num_new, head_dim)
    prefix_scores = cache_product(grouped, prefix[0].transpose(-1, -2))  # [batch, kv, group·n, P]
    if prefix_visible is not None:
        prefix_scores = prefix_scores.masked_fill(~prefix_visible, float("-inf"))
    weights = torch.cat((prefix_scores, own_scores), dim=-1).softmax(-1)
    num_prefix = prefix_scores.shape[-1]
    out = cache_product(weights[..., :num_prefix], prefix[1]) + cache_product(weights[..., num_prefix:], own[1])
    return out.reshape(batch, heads, num_new, head_dim)


def cache_product(
    rows: torch.Tensor,  # [..., r, x]
    cached: torch.Tensor,  # [..., x, y]: cached keys (transposed) or values, batch dims broadcast against rows'
) -> torch.Tensor:
    """``rows @ cached`` # [..., r, y] in the precision of ``cached``, float32 out.

    A bfloat16 cache is multiplied one matrix at a time: a cache's buffers are longer than its
    contents, so its keys are not one contiguous batch, and PyTorch's bfloat16 batched product
    copies them first (3.7 ms for one query row over 16K keys against 0.9 ms per head here).
    """
    if cached.dtype == torch.float32:
        return rows.float() @ cached
    batch = torch.broadcast_shapes(rows.shape[:-2], cached.shape[:-2])
    rows = rows.to(cached.dtype).expand(*batch, *rows.shape[-2:]).reshape(-1, *rows.shape[-2:])
    matrices = cached.expand(*batch, *cached.shape[-2:]).reshape(-1, *cached.shape[-2:])  # views: merges size-1 or contiguous dims
    return torch.stack([torch.mm(row_block, matrix) for row_block, matrix in zip(rows, matrices)]).float().view(*batch, rows.shape[-2], -1)
