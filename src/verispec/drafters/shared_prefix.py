"""Attention of many short row groups over ONE shared cached prefix, without copying the prefix.

Drafting heads run many independent rows after the same context: the parallel head's blocks
(a round's, or (K-1)·m known-slot blocks for contextual correction), the EAGLE head's one-step
rows that score candidate pairs. Each batch entry attends to the shared prefix (broadcast, not
expanded per row) and to its own new rows:

    out = softmax( [q·K_prefixᵀ ; q·K_ownᵀ] / √d ) · [V_prefix ; V_own]
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
    own_scores = grouped @ own[0].transpose(-1, -2)  # [batch, kv, group·n, n]
    if causal and num_new > 1:
        future = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).triu(1).repeat(heads // kv_heads, 1)
        own_scores = own_scores.masked_fill(future, float("-inf"))
    if prefix is None:
        weights = own_scores.softmax(-1)
        return (weights @ own[1]).reshape(batch, heads, num_new, head_dim)
    prefix_scores = grouped @ prefix[0].transpose(-1, -2)  # [batch, kv, group·n, P]
    if prefix_visible is not None:
        prefix_scores = prefix_scores.masked_fill(~prefix_visible, float("-inf"))
    weights = torch.cat((prefix_scores, own_scores), dim=-1).softmax(-1)
    num_prefix = prefix_scores.shape[-1]
    out = weights[..., :num_prefix] @ prefix[1] + weights[..., num_prefix:] @ own[1]
    return out.reshape(batch, heads, num_new, head_dim)
