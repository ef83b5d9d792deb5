"""One attention layer's KV cache for one sequence, preallocated and grown by doubling.

Our own attention code (the EAGLE and parallel heads, the lean forward of a draft model) appends
keys/values into a buffer in place instead of concatenating a new tensor every step, and rolls
back by moving an end pointer: a crop costs nothing and frees nothing.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Keys and values of one attention layer for one sequence; ``crop`` is the only rollback."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values # [kv_heads, n, head_dim]; return all of them up to the new end."""
        start = self.length
        all_keys, all_values = self.claim(keys.shape[1], keys.shape[0], keys.shape[2], keys.dtype)
        all_keys[:, start:] = keys
        all_values[:, start:] = values
        return all_keys, all_values

    def claim(self, num_new: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the end ``num_new`` positions on (growing the buffers if needed) for a caller that
        writes those keys/values itself; return the keys/values up to the new end # [kv_heads, end, head_dim]
        (views of the buffers, whose capacity is ``self.keys.shape[1]``)."""
        end = self.length + num_new
        if self.keys is None or end > self.keys.shape[1]:
            capacity = max(end, 2 * (0 if self.keys is None else self.keys.shape[1]), 256)
            grown_k = torch.empty(kv_heads, capacity, head_dim, dtype=dtype)
            grown_v = torch.empty_like(grown_k)
            if self.keys is not None:
                grown_k[:, : self.length] = self.keys[:, : self.length]
                grown_v[:, : self.length] = self.values[:, : self.length]
            self.keys, self.values = grown_k, grown_v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.length = length


class RowLog:
    """Rows of one sequence's cached tokens (e.g. top-layer features [n, hidden]), grown by doubling
    and rolled back with the sequence's caches; ``crop`` is the only rollback."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # [capacity, width]
        self.length = 0

    @property
    def width(self) -> int | None:
        return None if self.rows is None else self.rows.shape[1]

    def append(self, rows: torch.Tensor) -> None:
        """Store a copy of rows # [n, width] after the others."""
        start, end = self.length, self.length + rows.shape[0]
        if self.rows is None or end > self.rows.shape[0]:
            grown = torch.empty(max(end, 2 * (0 if self.rows is None else self.rows.shape[0]), 256), rows.shape[1], dtype=rows.dtype)
            if self.rows is not None:
                grown[:start] = self.rows[:start]
            self.rows = grown
        self.rows[start:end] = rows
        self.length = end

    def view(self) -> torch.Tensor:
        """All stored rows # [length, width]."""
        return self.rows[: self.length] if self.rows is not None else torch.zeros(0, 0)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.length = length


def causal_mask_after(cached: int, num_new: int, device: torch.device | None = None) -> torch.Tensor | None:
    """Which keys each of ``num_new`` rows appended after ``cached`` positions attends to # [num_new, cached+num_new]
    bool: every cached position and the new ones up to itself. None for a single row (it sees all)."""
    if num_new == 1:
        return None
    return torch.ones(num_new, cached + num_new, dtype=torch.bool, device=device).tril(cached)
