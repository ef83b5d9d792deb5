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
        # bfloat16 copies of the first ``_copied`` keys/values (see ``low_precision``).
        self._low_keys: torch.Tensor | None = None  # [kv_heads, capacity, head_dim]
        self._low_values: torch.Tensor | None = None
        self._copied = 0

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
        self._copied = min(self._copied, length)  # rows past the end will be written anew

    def copy_row(self, source: int, destination: int) -> None:
        """Overwrite the key/value at ``destination`` (< length) with the one at ``source``."""
        if not (0 <= source < self.length and 0 <= destination < self.length):
            raise ValueError(f"copy_row positions must be in [0, {self.length}), got {source} -> {destination}")
        self.keys[:, destination] = self.keys[:, source]
        self.values[:, destination] = self.values[:, source]
        self._copied = min(self._copied, destination)

    def low_precision(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. end-1 in bfloat16 # [kv_heads, end, head_dim] each.

        For attention over a long cached prefix that tolerates rounding (a drafting head's far
        memory): reading 16K bfloat16 rows takes ~0.6 ms here against ~1.7 ms in float32. The
        copies are kept, and each call converts only the rows not converted yet: rows below the
        end change only through ``crop`` and ``copy_row``, which forget the copies past them.
        """
        if not 0 <= end <= self.length:
            raise ValueError(f"low_precision end must be in [0, {self.length}], got {end}")
        if self._low_keys is None or end > self._low_keys.shape[1]:
            capacity = self.keys.shape[1]  # >= length >= end
            grown_k = torch.empty(self.keys.shape[0], capacity, self.keys.shape[2], dtype=torch.bfloat16)
            grown_v = torch.empty_like(grown_k)
            if self._low_keys is not None:
                grown_k[:, : self._copied] = self._low_keys[:, : self._copied]
                grown_v[:, : self._copied] = self._low_values[:, : self._copied]
            self._low_keys, self._low_values = grown_k, grown_v
        if end > self._copied:
            self._low_keys[:, self._copied : end] = self.keys[:, self._copied : end]
            self._low_values[:, self._copied : end] = self.values[:, self._copied : end]
            self._copied = end
        return self._low_keys[:, :end], self._low_values[:, :end]


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
