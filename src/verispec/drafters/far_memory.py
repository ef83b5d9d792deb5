"""Far-memory attention for drafters (FOLD): exact positions near, one shared position far. Training-free.

A drafter trained on short sequences has never seen large relative distances, so on long inputs its
attention goes astray. Far memory keeps what it was trained on: for a query at position t,

- the local window, keys at t-W+1 .. t, keep their true positions (relative distances 0 .. W-1);
- every older key (the far memory, s <= t-W) is placed at ONE shared position t-W, just beyond the
  window (relative distance W for all of them, whatever their age).

Inside the memory the logits are sharpened by 1/T (a memory that grows with the input would
otherwise spread attention thin), and the memory's total mass is re-weighted by λ against the
window. With ℓ_s = q·k_s/√d at the assigned positions, one softmax over both parts:

    a_s = exp(ℓ_s) / Z                      for local keys
    a_s = λ·exp(ℓ_s / T) / Z                for memory keys
    Z   = Σ_local exp(ℓ_s) + λ·Σ_memory exp(ℓ_s / T)

equivalently out = (Z_loc·o_loc + λ·Z_mem·o_mem) / (Z_loc + λ·Z_mem), o_x the softmax average of
the values within part x and Z_x its normaliser. λ = T = 1 with W >= length is plain attention.

Only drafters use this: the target's attention is never changed, so decoding stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.models.rotary import apply_rotary, rotary_cos_sin

ATTENTION_MODES = ("full", "local", "fold")
# Logit elements computed at once in the blocked attention: bounds memory on long catch-ups (~64 MB).
_BLOCK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class FarMemoryConfig:
    """How a drafter attends over a long context.

    ``mode``: "full" attends at true positions everywhere (as trained); "local" drops the memory
    (attention over the last ``local_window`` keys only, i.e. truncation); "fold" adds the far memory.
    Defaults chosen on the dev split of the long-context benchmark (README, "Long context").
    """

    mode: str = "fold"
    local_window: int = 256  # W: keys with exact positions, the query's own included
    memory_temperature: float = 1.0  # T: memory logits are divided by T (< 1 sharpens; on our dev split it only hurt)
    memory_weight: float = 1.0  # λ: multiplies the memory's total attention mass

    def __post_init__(self) -> None:
        if self.mode not in ATTENTION_MODES:
            raise ValueError(f"--draft-attention must be one of {', '.join(ATTENTION_MODES)}, got {self.mode!r}")
        if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or self.local_window < 1:
            raise ValueError(f"--local-window must be an integer >= 1, got {self.local_window!r}")
        if not (math.isfinite(self.memory_temperature) and self.memory_temperature > 0):
            raise ValueError(f"--memory-temperature must be a finite number > 0, got {self.memory_temperature!r}")
        if not (math.isfinite(self.memory_weight) and self.memory_weight > 0):
            raise ValueError(f"--memory-weight must be a finite number > 0, got {self.memory_weight!r}")

    @property
    def changes_attention(self) -> bool:
        """False for "full": the drafter's own (trained) attention runs untouched."""
        return self.mode != "full"


def assigned_key_positions(
    query_positions: torch.Tensor,  # [n] int64: positions t of the query rows
    num_keys: int,  # keys at true positions 0 .. num_keys-1
    local_window: int,
) -> torch.Tensor:
    """Position each key takes for each query row # [n, num_keys] int64.

    Key s keeps s if s > t - W (the local window, and keys after t, which causal masking hides);
    every older key takes the shared memory position t - W.
    """
    keys = torch.arange(num_keys, device=query_positions.device)  # [num_keys]
    shared = (query_positions - local_window)[:, None]  # [n, 1]
    return torch.where(keys[None, :] <= shared, shared, keys[None, :])


def far_memory_attention(
    query: torch.Tensor,  # [heads, n, head_dim] UNrotated, rows at positions start .. start+n-1
    keys: torch.Tensor,  # [kv_heads, start+n, head_dim] UNrotated, key s at true position s
    values: torch.Tensor,  # [kv_heads, start+n, head_dim]
    start: int,
    inv_freq: torch.Tensor,  # [head_dim/2] rotary frequencies
    config: FarMemoryConfig,
) -> torch.Tensor:
    """Causal attention with far memory (the module docstring's equation) # [heads, n, head_dim].

    Row t sees keys s <= t: local ones (t-W < s <= t) at their true positions, the rest (fold
    only; "local" drops them) at the shared position t-W. Grouped-query: query head h reads kv head
    h // (heads / kv_heads). Rows are processed in blocks so a long catch-up never holds an
    [n, n] logit matrix. Memory scores use (R(t)q)·(R(t-W)k) = (R(W)q)·k: one rotation of the
    query instead of re-rotating every memory key for every row.
    """
    heads, num_rows, head_dim = query.shape
    kv_heads, num_keys, _ = keys.shape
    if num_keys != start + num_rows:
        raise ValueError(f"far_memory_attention: {num_keys} keys for rows at {start}..{start + num_rows - 1}")
    grouped = query.reshape(kv_heads, heads // kv_heads, num_rows, head_dim)  # [kv_heads, group, n, head_dim]
    block = max(1, _BLOCK_ELEMENTS // (heads * max(num_keys, 1)))
    outputs = [
        _attend_block(grouped[:, :, first : first + block], keys, values, start + first, inv_freq, config)
        for first in range(0, num_rows, block)
    ]
    return torch.cat(outputs, dim=2).reshape(heads, num_rows, head_dim)


def _attend_block(
    query: torch.Tensor,  # [kv_heads, group, b, head_dim] unrotated, rows at positions first .. first+b-1
    keys: torch.Tensor,  # [kv_heads, num_keys, head_dim] unrotated
    values: torch.Tensor,  # [kv_heads, num_keys, head_dim]
    first: int,
    inv_freq: torch.Tensor,  # [head_dim/2]
    config: FarMemoryConfig,
) -> torch.Tensor:
    """One block of rows # [kv_heads, group, b, head_dim]."""
    window, rows = config.local_window, query.shape[2]
    device, scale = query.device, 1.0 / math.sqrt(query.shape[-1])
    row_positions = torch.arange(first, first + rows, device=device)  # [b]
    # Local part: keys any row of the block may see at true positions, from first-W+1 to the last row.
    local_from = max(0, first - window + 1)
    local_positions = torch.arange(local_from, first + rows, device=device)  # [n_loc]
    cos_q, sin_q = rotary_cos_sin(row_positions.float(), inv_freq)
    cos_k, sin_k = rotary_cos_sin(local_positions.float(), inv_freq)
    local_keys = apply_rotary(keys[:, local_from : first + rows], cos_k, sin_k)  # [kv_heads, n_loc, d]
    distance = row_positions[:, None] - local_positions[None, :]  # [b, n_loc]: t - s
    in_window = (distance >= 0) & (distance < window)
    local_logits = _grouped_matmul(apply_rotary(query, cos_q, sin_q), local_keys.transpose(1, 2)).mul_(scale)  # [kv_heads, group, b, n_loc]
    local_logits.masked_fill_(~in_window, -math.inf)
    memory_end = first + rows - window  # keys 0 .. memory_end-1 are memory for the block's last row
    if config.mode != "fold" or memory_end <= 0:
        return _grouped_matmul(torch.softmax(local_logits, dim=-1), values[:, local_from : first + rows])
    cos_w, sin_w = rotary_cos_sin(torch.tensor([float(window)], device=device), inv_freq)
    memory_keys = keys[:, :memory_end]  # [kv_heads, n_mem, d], all at relative distance W
    memory_logits = _grouped_matmul(apply_rotary(query, cos_w, sin_w), memory_keys.transpose(1, 2))  # [kv_heads, group, b, n_mem]
    memory_logits.mul_(scale / config.memory_temperature).add_(math.log(config.memory_weight))
    in_memory = torch.arange(memory_end, device=device)[None, :] <= (row_positions - window)[:, None]  # [b, n_mem]
    memory_logits.masked_fill_(~in_memory, -math.inf)
    # One softmax over both parts, without concatenating them (in place: these are the block's largest tensors).
    peak = torch.maximum(local_logits.amax(dim=-1, keepdim=True), memory_logits.amax(dim=-1, keepdim=True))
    local_weights, memory_weights = local_logits.sub_(peak).exp_(), memory_logits.sub_(peak).exp_()
    total = local_weights.sum(dim=-1, keepdim=True) + memory_weights.sum(dim=-1, keepdim=True)  # Z_loc + λ·Z_mem (scaled)
    out = _grouped_matmul(local_weights, values[:, local_from : first + rows]) + _grouped_matmul(memory_weights, values[:, :memory_end])
    return out / total


def _grouped_matmul(grouped: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """grouped # [kv_heads, group, b, x] @ shared # [kv_heads, x, y] -> # [kv_heads, group, b, y].

    One bmm with the group folded into the rows: broadcasting ``shared`` over the group instead
    would copy it once per query head (keys can be 16K long).
    """
    kv_heads, group, rows, width = grouped.shape
    return torch.bmm(grouped.reshape(kv_heads, group * rows, width), shared).view(kv_heads, group, rows, -1)
