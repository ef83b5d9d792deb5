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

Only drafters use this: the target's attention is never changed, so decoding stays exact. For the
same reason a long memory may be read in bfloat16 (:func:`low_precision_memory`): rounding changes
the drafts a little, never the output.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from verispec.models.panel_linear import panel_kernels_unavailable_reason, panel_library
from verispec.models.quantize import native_bf16_products
from verispec.models.rotary import apply_rotary, rotary_cos_sin

ATTENTION_MODES = ("full", "local", "fold", "auto")
# "auto": our heads were trained on sequences of at most this many tokens (``max_seq_len``); a
# shorter prompt gets the attention as trained, a longer one the local window ("local"): at 8K and
# 16K tokens it was the fastest setting in every bench run on this project's CPUs (README, Long
# context) — far memory drafts a little better there but its memory costs more than that saves.
AUTO_WINDOW_AFTER = 1024
# Logit elements computed at once in the blocked attention: bounds memory on long catch-ups (~64 MB).
_BLOCK_ELEMENTS = 1 << 24
# From this many memory keys on, a head step reads the memory in bfloat16 where the CPU multiplies
# it natively: one query row's two memory products (12 heads over 2 KV heads) took 0.64 ms against
# 1.7 ms in float32 over 16K keys on a Zen 4 (2 threads), 0.34 against 0.54 ms over 8K, 0.19
# against 0.27 over 4K; at 1K they tie and below it float32 is faster.
LOW_PRECISION_MEMORY_FROM = 4096


@dataclass(frozen=True)
class FarMemoryConfig:
    """How a drafter attends over a long context.

    ``mode``: "full" attends at true positions everywhere (as trained); "local" drops the memory
    (attention over the last ``local_window`` keys only, i.e. truncation); "fold" adds the far memory;
    "auto" is "full" for prompts of at most ``AUTO_WINDOW_AFTER`` tokens and "local" for longer ones,
    decided once per request (:meth:`for_prompt`: a cache keeps one setting for its whole life).
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
        """False for "full": the drafter's own (trained) attention runs untouched ("auto" may change it)."""
        return self.mode != "full"

    def for_prompt(self, prompt_length: int) -> "FarMemoryConfig | None":
        """What a request whose prompt has ``prompt_length`` tokens runs: "auto" resolved ("local"
        past ``AUTO_WINDOW_AFTER`` tokens, else None), any other mode itself (None for "full")."""
        if self.mode == "auto":
            return replace(self, mode="local") if prompt_length > AUTO_WINDOW_AFTER else None
        return self if self.changes_attention else None


def checked_far_memory(far_memory: FarMemoryConfig | None) -> FarMemoryConfig | None:
    """A drafter's ``far_memory`` argument: the config if it changes attention, None for None or
    mode "full" (the head as trained); ValueError for anything but a FarMemoryConfig or None."""
    if far_memory is not None and not isinstance(far_memory, FarMemoryConfig):
        raise ValueError(f"far_memory must be a FarMemoryConfig or None, got {type(far_memory).__name__}")
    return far_memory if far_memory is not None and far_memory.changes_attention else None


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
    memory: tuple[torch.Tensor, torch.Tensor] | None = None,  # keys, values # [kv_heads, >= start+n-W, head_dim] in a lower precision
) -> torch.Tensor:
    """Causal attention with far memory (the module docstring's equation) # [heads, n, head_dim].

    Row t sees keys s <= t: local ones (t-W < s <= t) at their true positions, the rest (fold
    only; "local" drops them) at the shared position t-W. Grouped-query: query head h reads kv head
    h // (heads / kv_heads). Rows are processed in blocks so a long catch-up never holds an
    [n, n] logit matrix. Memory scores use (R(t)q)·(R(t-W)k) = (R(W)q)·k: one rotation of the
    query instead of re-rotating every memory key for every row. With ``memory`` (fold only; from
    :func:`low_precision_memory`) the memory's two products run in its precision on copies of the
    same keys and values; logits, exponentials and the normaliser stay float32.
    """
    heads, num_rows, head_dim = query.shape
    kv_heads, num_keys, _ = keys.shape
    _check_resolved(config)
    if num_keys != start + num_rows:
        raise ValueError(f"far_memory_attention: {num_keys} keys for rows at {start}..{start + num_rows - 1}")
    grouped = query.reshape(kv_heads, heads // kv_heads, num_rows, head_dim)  # [kv_heads, group, n, head_dim]
    block = max(1, _BLOCK_ELEMENTS // (heads * max(num_keys, 1)))
    outputs = [
        _attend_block(grouped[:, :, first : first + block], keys, values, start + first, inv_freq, config, memory)
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
    memory: tuple[torch.Tensor, torch.Tensor] | None,  # low-precision copies of keys, values # [kv_heads, >= memory_end, head_dim]
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
    local_logits = _grouped_matmul(apply_rotary(query, cos_q, sin_q), local_keys.transpose(1, 2)).mul_(scale)  # [kv_heads, group, b, n_loc]
    if rows > 1:  # one row (a draft step) sees its whole window and memory: nothing to mask
        distance = row_positions[:, None] - local_positions[None, :]  # [b, n_loc]: t - s
        local_logits.masked_fill_((distance < 0) | (distance >= window), -math.inf)
    memory_end = first + rows - window  # keys 0 .. memory_end-1 are memory for the block's last row
    if config.mode != "fold" or memory_end <= 0:
        return _grouped_matmul(torch.softmax(local_logits, dim=-1), values[:, local_from : first + rows])
    cos_w, sin_w = rotary_cos_sin(torch.tensor([float(window)], device=device), inv_freq)
    at_window = apply_rotary(query, cos_w, sin_w)  # [kv_heads, group, b, d]: every memory key at distance W
    ends = (row_positions - window + 1).clamp_(min=0)  # [b]: row t's memory is keys 0 .. t-W
    memory_keys, memory_values = (keys, values) if memory is None else memory
    memory_keys, memory_values = memory_keys[:, :memory_end], memory_values[:, :memory_end]  # [kv_heads, n_mem, d]
    memory_context, memory_lse = _memory_part(at_window, memory_keys, memory_values, ends, scale / config.memory_temperature)
    # One softmax over both parts: the memory enters as one term of mass λ·Z_mem = e^(lse + log λ).
    memory_log_mass = memory_lse.add_(math.log(config.memory_weight))  # [kv_heads, group, b]
    peak = torch.maximum(local_logits.amax(dim=-1), memory_log_mass)  # finite: a row always sees its own key
    local_weights = local_logits.sub_(peak[..., None]).exp_()
    memory_share = (memory_log_mass - peak).exp_()  # λ·Z_mem, scaled as the local weights are
    total = local_weights.sum(dim=-1) + memory_share  # Z_loc + λ·Z_mem (scaled)
    local_part = _grouped_matmul(local_weights, values[:, local_from : first + rows])
    return local_part.add_(memory_context.mul_(memory_share[..., None])).div_(total[..., None])


def _memory_part(
    query: torch.Tensor,  # [kv_heads, group, b, d] rotated to the memory's distance W
    keys: torch.Tensor,  # [kv_heads, n_mem, d] unrotated (float32, or bfloat16 copies)
    values: torch.Tensor,  # [kv_heads, n_mem, d]
    ends: torch.Tensor,  # [b] int64: row r's memory is keys 0 .. ends[r]-1
    scaling: float,  # 1/(√d·T)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within the memory alone: context o_mem # [kv_heads, group, b, d] and the log of its
    normaliser, log Z_mem = log Σ_s e^(scaling·q·k_s) # [kv_heads, group, b] (a row with no memory:
    context 0, -inf). Float32 memories run our attention kernel where it is built (the target's
    own attention code: each key read once for every row and head of its kv head); bfloat16 copies
    and machines without the kernels run PyTorch's products."""
    library = _memory_kernel() if keys.dtype == torch.float32 and keys.shape[-1] % 8 == 0 else None
    if library is None:
        logits = _grouped_matmul(query.to(keys.dtype), keys.transpose(1, 2)).float().mul_(scaling)  # [kv_heads, group, b, n_mem]
        logits.masked_fill_(torch.arange(keys.shape[1], device=keys.device)[None, :] >= ends[:, None], -math.inf)
        lse = logits.logsumexp(dim=-1)
        weights = logits.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_()  # rows without memory: all 0
        return _grouped_matmul(weights.to(values.dtype), values).float(), lse
    kv_heads, group, rows, head_dim = query.shape
    query = query.contiguous()
    keys, values = _rows_in_place(keys), _rows_in_place(values)
    ends = ends.to(torch.int64).contiguous()
    context, lse = torch.empty_like(query), torch.empty(kv_heads, group, rows, dtype=torch.float32)
    library.verispec_memory_attention(
        query.data_ptr(), kv_heads, group, rows, head_dim, keys.data_ptr(), keys.stride(0), values.data_ptr(), values.stride(0),
        ends.data_ptr(), scaling, context.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
    )
    return context, lse


def _rows_in_place(states: torch.Tensor) -> torch.Tensor:
    """``states`` # [kv_heads, n, d] with each position's d floats together and a head's positions
    in order (a cache's view: heads a capacity apart), copied only if they are not."""
    return states if states.stride(2) == 1 and states.stride(1) == states.shape[2] else states.contiguous()


@functools.cache
def _memory_kernel():  # noqa: ANN202 - the ctypes library, or None
    """The compiled kernels, or None where they cannot run or be built (PyTorch's products then:
    a draft is never worth failing a request over; the target's kernel choice reports build errors)."""
    if panel_kernels_unavailable_reason() is not None:
        return None
    try:
        return panel_library()
    except RuntimeError:
        return None


def _check_resolved(config: FarMemoryConfig) -> None:
    if config.mode == "auto":
        raise ValueError('far-memory mode "auto" is decided per request: attend with FarMemoryConfig.for_prompt(prompt_length)')


def low_precision_memory(cache, end: int, config: FarMemoryConfig | None) -> tuple[torch.Tensor, torch.Tensor] | None:  # noqa: ANN001 - a LayerKVCache
    """The far memory's keys and values in bfloat16 for rows ending at position ``end`` (exclusive)
    of ``cache`` (:meth:`~verispec.engine.kv_cache.LayerKVCache.low_precision`, converted once
    per row), when that memory holds at least ``LOW_PRECISION_MEMORY_FROM`` keys and the CPU
    multiplies bfloat16 natively; None otherwise (float32 attention)."""
    if config is None or config.mode != "fold" or not native_bf16_products():
        return None
    memory_end = end - config.local_window  # keys 0 .. end-1-W are memory for the last row
    return cache.low_precision(memory_end) if memory_end >= LOW_PRECISION_MEMORY_FROM else None


def _grouped_matmul(grouped: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """grouped # [kv_heads, group, b, x] @ shared # [kv_heads, x, y] -> # [kv_heads, group, b, y].

    One bmm with the group folded into the rows: broadcasting ``shared`` over the group instead
    would copy it once per query head (keys can be 16K long).
    """
    kv_heads, group, rows, width = grouped.shape
    folded = grouped.reshape(kv_heads, group * rows, width)
    if shared.dtype == torch.float32:
        return torch.bmm(folded, shared).view(kv_heads, group, rows, -1)
    # bfloat16 bmm copied a whole [kv_heads, 16K, d] view of the cache whose heads lie a capacity
    # apart (2.5 ms); one mm per KV head reads each head's rows in place (0.4 ms).
    return torch.stack([torch.mm(folded[head], shared[head]) for head in range(kv_heads)]).view(kv_heads, group, rows, -1)


@dataclass(frozen=True)
class FarMemoryRows:
    """Where a call's query rows sit, for far-memory attention over a cached prefix (see
    :func:`far_memory_prefix_attention`): the config, the rows' positions and the rotary frequencies."""

    config: FarMemoryConfig
    positions: torch.Tensor  # [batch or 1, n] int64: position t of each query row
    inv_freq: torch.Tensor  # [head_dim/2]


def far_memory_prefix_attention(
    query: torch.Tensor,  # [batch, heads, n, head_dim] UNrotated
    prefix: tuple[torch.Tensor, torch.Tensor],  # UNrotated keys, values # [batch or 1, kv_heads, P, head_dim]: key s at position s
    prefix_visible: torch.Tensor | None,  # [batch, 1, 1, P] bool: which prefix keys each batch entry sees (None: all)
    own: tuple[torch.Tensor, torch.Tensor],  # keys ROTATED at their rows' positions, values # [batch, kv_heads, n, head_dim]
    causal: bool,  # the n own rows see each other causally (True) or all of each other (False)
    rows: FarMemoryRows,
) -> torch.Tensor:
    """Far-memory attention of rows appended after a shared cached prefix # [batch, heads, n, head_dim].

    What drafting heads run when many short row groups follow one cached context (a parallel
    head's block and its contextual-correction blocks; the EAGLE corrector's one-step rows): the
    module docstring's equation with the prefix split per row t into local keys (t-W < s: true
    positions) and far memory (s <= t-W: the shared position t-W, logits / T, mass × λ; "local"
    drops it). The rows' own keys are always local, at their true positions: a block (a few rows)
    is far shorter than any useful window. With W >= every distance this is plain attention
    (:func:`~verispec.drafters.shared_prefix.shared_prefix_attention` on rotated keys).
    """
    batch, heads, num_new, head_dim = query.shape
    keys, values = prefix
    _check_resolved(rows.config)
    kv_heads, num_prefix = own[0].shape[1], keys.shape[2]
    group, window, scale = heads // kv_heads, rows.config.local_window, 1.0 / math.sqrt(head_dim)
    position_rows = rows.positions.shape[0]  # batch, or 1 for rows at the same positions in every entry
    cos, sin = rotary_cos_sin(rows.positions.reshape(-1).float(), rows.inv_freq)
    rotated = apply_rotary(query, cos.view(position_rows, 1, num_new, -1), sin.view(position_rows, 1, num_new, -1))
    grouped = rotated.reshape(batch, kv_heads, group * num_new, head_dim) * scale  # query head g·group+j, row r -> index j·n + r
    row_positions = rows.positions[:, None, :].expand(position_rows, group, num_new).reshape(position_rows, 1, group * num_new, 1)
    own_scores = grouped @ own[0].transpose(-1, -2)  # [batch, kv, group·n, n]
    if causal and num_new > 1:
        future = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).triu(1).repeat(group, 1)
        own_scores = own_scores.masked_fill(future, -math.inf)
    parts, part_values = [own_scores], [own[1]]
    visible = prefix_visible  # [batch, 1, 1, P] or None
    # Local part: keys within W of some row, rotated at their true positions.
    local_from = max(0, int(rows.positions.min()) - window + 1) if num_prefix else 0
    if local_from < num_prefix:
        key_positions = torch.arange(local_from, num_prefix, device=query.device)
        cos_k, sin_k = rotary_cos_sin(key_positions.float(), rows.inv_freq)
        local_scores = grouped @ apply_rotary(keys[:, :, local_from:], cos_k, sin_k).transpose(-1, -2)  # [batch, kv, group·n, P-local_from]
        masked = row_positions - key_positions >= window
        if visible is not None:
            masked = masked | ~visible[..., local_from:]
        parts.append(local_scores.masked_fill(masked, -math.inf))
        part_values.append(values[:, :, local_from:])
    # Far memory: every key at distance W ((R(t)q)·(R(t-W)k) = (R(W)q)·k), sharpened and weighted.
    memory_end = min(num_prefix, max(0, int(rows.positions.max()) - window + 1))
    if rows.config.mode == "fold" and memory_end > 0:
        cos_w, sin_w = rotary_cos_sin(torch.tensor([float(window)], device=query.device), rows.inv_freq)
        at_window = apply_rotary(query, cos_w, sin_w).reshape(batch, kv_heads, group * num_new, head_dim)
        memory_scores = (at_window @ keys[:, :, :memory_end].transpose(-1, -2)).mul_(scale / rows.config.memory_temperature).add_(math.log(rows.config.memory_weight))
        masked = row_positions - torch.arange(memory_end, device=query.device) < window
        if visible is not None:
            masked = masked | ~visible[..., :memory_end]
        parts.append(memory_scores.masked_fill(masked, -math.inf))
        part_values.append(values[:, :, :memory_end])
    weights = torch.cat(parts, dim=-1).softmax(-1)  # one softmax over own rows, local window and memory
    out, first = 0, 0
    for scores, part in zip(parts, part_values):
        width = scores.shape[-1]
        out = out + weights[..., first : first + width] @ part
        first += width
    return out.reshape(batch, heads, num_new, head_dim)
