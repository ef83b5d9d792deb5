"""Keys, values and features of sequences a model has already run, so a new sequence starts from
its longest shared prefix instead of prefilling it again.

Prefill is what a chat server pays per turn: on this CPU the 1.5B float32 target reads a prompt at
~50-70 tokens/s, so the tenth turn of a conversation re-reads nine turns it has seen before, and
every request re-reads the chat template's system prompt. :class:`PrefixCache` keeps copies of
finished (and prefilled) sequences' per-layer keys/values and top-layer features; a sequence
starting on an empty cache copies in the longest prefix it shares with any stored sequence and
computes only the rest.

Exactness: a restored position holds exactly what computing it would give only if a position's
keys, values and features do not depend on how the sequence's tokens were split into passes. The
fused lean stack computes every row as a pass over that row alone (the kernels' sums and the
row's own attention), so :class:`~verispec.engine.lean_lm.LeanLM` with a prefix cache runs every
pass of its sequence through it (``LeanDecoder.forward(..., row_exact=True)``) and a request's
tokens are then the same whatever was served before it (tested bit for bit).

Ownership: entries are copies; a restore copies into the sequence's own caches. Nothing here is
shared with a running sequence, so rollback stays with the sequence's owner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.engine.kv_cache import LayerKVCache, RowLog

DEFAULT_PREFIX_CACHE_MB = 1024


@dataclass
class _Entry:
    token_ids: torch.Tensor  # [n] int64
    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim]
    values: list[torch.Tensor]  # per layer [kv_heads, n, head_dim]
    features: torch.Tensor  # [n, hidden]

    @property
    def nbytes(self) -> int:
        tensors = [self.token_ids, self.features, *self.keys, *self.values]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # sequences started through the cache
    hits: int = 0  # ... that reused at least one position
    reused_tokens: int = 0  # positions copied instead of computed
    computed_tokens: int = 0  # positions those sequences' first passes still computed


class PrefixCache:
    """Stored sequences of one model, least recently used dropped first past ``max_bytes``.

    A stored sequence that another one extends is dropped for it (the longer one serves both), and
    a sequence already covered by a stored one is not stored again.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id -> entry, least recently used first
        self._next_id = 0
        self.bytes = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def longest_match(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the best stored sequence shares."""
        return self._best(torch.tensor(token_ids, dtype=torch.long))[1]

    def restore(self, token_ids: list[int], caches: list[LayerKVCache], features: RowLog) -> torch.Tensor:
        """Copy the longest stored prefix of ``token_ids`` into empty ``caches`` / ``features``;
        return its features # [reused, hidden] (reused may be 0)."""
        if caches[0].length or features.length:
            raise ValueError("restore() needs an empty sequence")
        wanted = torch.tensor(token_ids, dtype=torch.long)
        key, reused = self._best(wanted)
        self.stats.lookups += 1
        if key is None or reused == 0:
            return torch.zeros(0, features.width or 0)
        entry = self._entries[key]
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.reused_tokens += reused
        for cache, keys, values in zip(caches, entry.keys, entry.values):
            all_keys, all_values = cache.claim(reused, keys.shape[0], keys.shape[2], keys.dtype)
            all_keys.copy_(keys[:, :reused])
            all_values.copy_(values[:, :reused])
        restored = entry.features[:reused].clone()
        features.append(restored)
        return restored

    def store(self, token_ids: list[int], caches: list[LayerKVCache], features: torch.Tensor) -> None:
        """Keep a copy of a sequence: ``caches`` hold its ``token_ids`` and features # [n, hidden] are theirs."""
        count = len(token_ids)
        if count == 0 or any(cache.length != count for cache in caches) or features.shape[0] != count:
            raise ValueError(f"store() needs caches and features holding exactly the {count} tokens")
        wanted = torch.tensor(token_ids, dtype=torch.long)
        shared = {key: _common(entry.token_ids, wanted) for key, entry in self._entries.items()}  # one comparison per entry
        covering = [key for key, common in shared.items() if common == count]
        if covering:  # already there (as this sequence or a longer one): just mark it used
            self._entries.move_to_end(covering[0])
            return
        entry = _Entry(
            wanted,
            [cache.keys[:, :count].clone() for cache in caches],
            [cache.values[:, :count].clone() for cache in caches],
            features.clone(),
        )
        if entry.nbytes > self.max_bytes:
            return
        for key in [key for key, common in shared.items() if common == len(self._entries[key].token_ids)]:
            self._drop(key)  # a prefix of this one: superseded
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def keep(self, token_ids: list[int], caches: list[LayerKVCache], features: RowLog) -> bool:
        """:meth:`store` a sequence whose owner is letting it go, if its caches and feature log hold
        exactly the tokens on record (a pass that raised midway may have written keys it never
        recorded: then nothing is stored, and the owner goes on). Whether it was stored."""
        count = len(token_ids)
        if not count or features.length != count or any(cache.length != count for cache in caches):
            return False
        self.store(token_ids, caches, features.view())
        return True

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _best(self, wanted: torch.Tensor) -> tuple[int | None, int]:
        best_key, best = None, 0
        for key, entry in self._entries.items():
            common = _common(entry.token_ids, wanted)
            if common > best:
                best_key, best = key, common
        return best_key, best

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes


def prefix_cache_of_mb(megabytes: int, argument: str = "prefix_cache_mb") -> PrefixCache | None:
    """A PrefixCache of ``megabytes`` MB, None for 0; a ValueError naming ``argument`` otherwise."""
    if isinstance(megabytes, bool) or not isinstance(megabytes, int) or megabytes < 0:
        raise ValueError(f"{argument} must be an integer >= 0, got {megabytes!r}")
    return PrefixCache(megabytes << 20) if megabytes else None


def start_sequence(
    prefixes: PrefixCache, token_ids: list[int], caches: list[LayerKVCache], features: RowLog, compute: Callable[[list[int]], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """An empty sequence's first pass over ``token_ids``: the longest stored prefix restored, the
    rest computed by ``compute(rest)`` (which appends to ``caches`` and returns its features
    # [len(rest), hidden]), every feature logged and the whole stored (a request cut short still
    leaves its prompt). Returns the features # [len(token_ids), hidden] and how many were restored."""
    restored = prefixes.restore(token_ids, caches, features)
    reused, every = len(restored), restored
    if reused < len(token_ids):
        computed = compute(token_ids[reused:])
        features.append(computed)
        prefixes.stats.computed_tokens += len(computed)
        every = torch.cat([restored, computed]) if reused else computed
    prefixes.store(token_ids, caches, features.view())
    return every, reused


def _common(stored: torch.Tensor, wanted: torch.Tensor) -> int:
    """Length of the common prefix of two id vectors # [n], [m]."""
    length = min(len(stored), len(wanted))
    differs = (stored[:length] != wanted[:length]).nonzero()
    return int(differs[0]) if len(differs) else length
