"""Attention of many short row groups over ONE shared cached prefix, without copying the prefix.

Drafting heads run many independent rows after the same context: the parallel head's blocks
(a round's, or (K-1)·m known-slot blocks for contextual correction), the EAGLE head's one-step
rows that score candidate pairs. Each batch entry attends to the shared prefix (all entries'
rows stacked against it in one product, never a copy per entry) and to its own new rows:

    out = softmax( [q·K_prefixᵀ ; q·K_ownᵀ] / √d ) · [V_prefix ; V_own]

Several requests drafted together (batched serving) pass :class:`SequencePrefixes`: each request's
own cached prefix for its consecutive run of batch entries, so every product outside attention
runs once over all requests' rows while each row reads only its own request's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.engine.kv_cache import LayerKVCache

KeysValues = tuple[torch.Tensor, torch.Tensor]  # keys, values # [batch or 1, kv_heads, n, head_dim]


@dataclass(frozen=True)
class SequencePrefixes:
    """One cached prefix per sequence; ``counts[s]`` consecutive batch entries attend to ``prefixes[s]``."""

    prefixes: list[KeysValues]  # per sequence # [1, kv_heads, P_s, head_dim]
    counts: list[int]  # batch entries of each sequence, in batch order

    def __post_init__(self) -> None:
        if len(self.prefixes) != len(self.counts) or any(count < 1 for count in self.counts):
            raise ValueError(f"SequencePrefixes needs one prefix per sequence and 1+ batch entries each, got {len(self.prefixes)} prefixes for counts {self.counts}")

    def repeated(self, times: int) -> "SequencePrefixes":
        """The same prefixes when every batch entry becomes ``times`` consecutive entries."""
        return SequencePrefixes(self.prefixes, [count * times for count in self.counts])


def for_rows(context, times: int):  # noqa: ANN001, ANN201 - KeysValues | SequencePrefixes | None, the same kind back
    """``context`` for a batch whose every entry became ``times`` consecutive rows (a shared prefix is unchanged)."""
    return context.repeated(times) if isinstance(context, SequencePrefixes) else context


def shared_prefix_attention(
    query: torch.Tensor,  # [batch, heads, n, head_dim]
    prefix: KeysValues | SequencePrefixes | None,  # [batch or 1, kv_heads, P, head_dim]: rotated keys, values
    prefix_visible: torch.Tensor | None,  # [batch, 1, 1, P] bool: which prefix keys a batch entry sees (None: all)
    own: KeysValues,  # [batch, kv_heads, n, head_dim]: the entry's own rows' keys, values
    causal: bool,  # own rows see each other causally (True) or all of each other (False)
    own_visible: torch.Tensor | None = None,  # [batch, 1, 1, n] bool: which own rows a batch entry sees (None: as ``causal`` says)
) -> torch.Tensor:
    """Grouped-query attention output # [batch, heads, n, head_dim]."""
    if isinstance(prefix, SequencePrefixes):
        if prefix_visible is not None or own_visible is not None:
            raise ValueError("SequencePrefixes: every entry sees its whole prefix and own rows (prefix_visible must be None, as must own_visible)")
        if sum(prefix.counts) != query.shape[0]:
            raise ValueError(f"SequencePrefixes counts {prefix.counts} do not add up to the batch of {query.shape[0]}")
        parts = zip(query.split(prefix.counts), own[0].split(prefix.counts), own[1].split(prefix.counts), prefix.prefixes)
        return torch.cat([shared_prefix_attention(part, one, None, (keys, values), causal) for part, keys, values, one in parts])
    batch, heads, num_new, head_dim = query.shape
    kv_heads = own[0].shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * num_new, head_dim) / math.sqrt(head_dim)
    own_scores = grouped @ own[0].transpose(-1, -2)  # [batch, kv, group·n, n]
    if causal and num_new > 1:
        future = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).triu(1).repeat(heads // kv_heads, 1)
        own_scores = own_scores.masked_fill(future, float("-inf"))
    if own_visible is not None:
        own_scores = own_scores.masked_fill(~own_visible, float("-inf"))
    if prefix is None:
        weights = own_scores.softmax(-1)
        return (weights @ own[1]).reshape(batch, heads, num_new, head_dim)
    prefix_scores = _times_prefix(grouped, prefix[0].transpose(-1, -2))  # [batch, kv, group·n, P]
    if prefix_visible is not None:
        prefix_scores = prefix_scores.masked_fill(~prefix_visible, float("-inf"))
    weights = torch.cat((prefix_scores, own_scores), dim=-1).softmax(-1)
    num_prefix = prefix_scores.shape[-1]
    out = _times_prefix(weights[..., :num_prefix], prefix[1]) + weights[..., num_prefix:] @ own[1]
    return out.reshape(batch, heads, num_new, head_dim)


def _times_prefix(
    rows: torch.Tensor,  # [batch, kv_heads, r, d]
    prefix: torch.Tensor,  # [batch or 1, kv_heads, d, c]: the prefix's keys transposed, or its values
) -> torch.Tensor:
    """rows @ prefix # [batch, kv_heads, r, c]. A prefix shared by the whole batch is multiplied ONCE
    by all entries' rows stacked: a broadcast batched matmul would copy it per entry (torch.matmul
    expands, then reshapes), which cost a corrected parallel round over a 512-token context more
    than its products (8 requests' pair fits: ~100 MB of copies)."""
    batch, kv_heads, num_rows, _ = rows.shape
    if prefix.shape[0] != 1 or batch == 1:
        return rows @ prefix
    stacked = rows.transpose(0, 1).reshape(1, kv_heads, batch * num_rows, -1)  # [1, kv_heads, batch·r, d]
    return (stacked @ prefix).view(kv_heads, batch, num_rows, -1).transpose(0, 1)


def append_and_attend(
    query: torch.Tensor,  # [1, heads, Q, head_dim]: rotated queries of each sequence's last ``queried[s]`` new rows, sequence after sequence
    key: torch.Tensor,  # [1, kv_heads, N, head_dim]: rotated keys of every sequence's ``counts[s]`` new rows, sequence after sequence
    value: torch.Tensor,  # [1, kv_heads, N, head_dim]
    caches: list[LayerKVCache],  # one per sequence, batch 1
    counts: list[int],  # new rows of each sequence
    queried: list[int],  # of those, how many (the last ones) have a query: 1 .. counts[s]
) -> torch.Tensor:
    """Append each sequence's new keys and values to its own cache and attend its queried rows over
    everything cached before them, the new rows causally among themselves # [1, heads, Q, head_dim]:
    a cached head step or catch-up, for one sequence or for a batch of them whose products ran once."""
    contexts, first, first_query = [], 0, 0
    for cache, count, asked in zip(caches, counts, queried):
        keys, values = cache.append(key[0, :, first : first + count], value[0, :, first : first + count])  # [kv_heads, length, head_dim]
        seen = keys.shape[1] - asked  # keys every queried row sees; the queried rows' own keys are causal among them
        prefix = (keys[None, :, :seen], values[None, :, :seen]) if seen else None
        contexts.append(shared_prefix_attention(query[:, :, first_query : first_query + asked], prefix, None, (keys[None, :, seen:], values[None, :, seen:]), causal=True))
        first, first_query = first + count, first_query + asked
    return torch.cat(contexts, dim=2)
