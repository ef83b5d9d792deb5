"""The target model plus ONE KV cache shared by every running request: a batched verification pass.

Design: a single Hugging Face ``DynamicCache`` of shape [rows, kv_heads, width, head_dim] per layer,
where ``width`` is shared by all rows, and a boolean map ``real`` [rows, width] of the columns
that hold a row's committed tokens. Each round appends max(k_i + 1) columns to every row (shorter
rows are padded); afterwards each row marks as real only the columns it keeps (the fed token and
its accepted drafts). Rejected drafts and padding are never cropped, only masked out, because a
shared tensor cannot be cropped by a different amount per row. Attention sees them through a 4-D
additive mask built here (causal AND real), and RoPE through explicit per-row ``position_ids``
(a row's next position is its count of real columns, not its column index), so each row computes
exactly what it would compute alone.

Why this design rather than per-request caches concatenated each round: the pass reads the cache
in place (no per-round copy of every row's keys/values), and joining, leaving and compaction are
the only copies. A newcomer is prefilled alone (prompts differ in length; batching prefills would
pad them) and merged by left-padding the narrower side to the common width. Finished rows leave by
index selection. Masked columns still cost attention work and memory, so when their share of the
cache grows past ``compact_waste`` the real columns are re-gathered, left-padded, into a narrow cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from verispec.engine.cached_lm import CachedLM, ForwardOutput, cache_argument_name
from verispec.models.screened_head import ScreenedArgmaxHead


@dataclass(frozen=True)
class CompactionPolicy:
    """When to re-gather the real columns of the shared cache into a narrow one."""

    waste: float = 0.5  # compact once more than this share of the cache's cells is padding or rejected drafts
    min_width: int = 64  # ... and the cache is at least this wide (narrow caches are cheap to attend over)

    def __post_init__(self) -> None:
        if not 0.0 < self.waste < 1.0:
            raise ValueError(f"waste must be in (0, 1), got {self.waste!r}")
        if self.min_width < 1:
            raise ValueError(f"min_width must be >= 1, got {self.min_width!r}")


class BatchedTarget:
    """A causal LM serving several sequences at once from one shared, masked KV cache.

    Between passes every row holds its committed sequence minus the last token (the engine's
    invariant). :meth:`extend` feeds each row its own tokens in one forward pass; :meth:`commit`
    then says how many of them each row keeps.
    """

    def __init__(self, model: PreTrainedModel, compaction: CompactionPolicy | None = None, screen_lm_head: bool = True) -> None:
        self.model = model
        self.compaction = compaction if compaction is not None else CompactionPolicy()
        # Its LM head (scaling, soft-capping) turns features into logits; greedy passes may take the
        # argmax through the head's int8 screen.
        argmax_head = ScreenedArgmaxHead.for_head(model.get_output_embeddings()) if screen_lm_head else None
        self._head = CachedLM(model, argmax_head=argmax_head)
        self.body = self._head.body
        self._cache_kwarg = cache_argument_name(type(self.body))
        if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
            # Sliding-window and linear-attention layers drop or summarise old columns, which breaks
            # the "mask instead of crop" bookkeeping.
            raise ValueError("batched serving supports full-attention models only (this model has sliding-window or linear-attention layers)")
        self._dtype = next(model.parameters()).dtype
        self.device = self._head.device
        self._reset()

    def _reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.real = torch.zeros(0, 0, dtype=torch.bool)  # [rows, width]: columns holding committed tokens
        self.next_positions: list[int] = []  # per row: its number of committed-and-cached tokens
        self._fed: list[int] | None = None  # per row: tokens fed by the last extend(), awaiting commit()

    @property
    def rows(self) -> int:
        return len(self.next_positions)

    @property
    def width(self) -> int:
        return int(self.real.shape[1])

    @property
    def vocab_size(self) -> int:
        return self._head.vocab_size

    @property
    def wasted_share(self) -> float:
        """Share of the cache's cells that hold no committed token (padding, rejected drafts)."""
        cells = self.real.numel()
        return 1.0 - int(self.real.sum()) / cells if cells else 0.0

    @torch.inference_mode()
    def add(self, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt[:-1]`` alone and append it as the last row; return its features [n, hidden]."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        self._check_committed()
        alone = CachedLM(self.model)
        features = torch.zeros(0, self.model.config.get_text_config(decoder=True).hidden_size)  # [0, hidden]
        if len(prompt) > 1:
            features = alone.extend(prompt[:-1], num_logits=0).features
        new_width = len(prompt) - 1
        width = max(self.width, new_width)
        old_layers, new_layers = _layer_tensors(self.cache), _layer_tensors(alone.cache)
        merged = []
        for old, new in zip(old_layers, new_layers):
            like = old if old is not None else new
            if like is None:  # neither side holds anything yet (prompts of one token)
                merged = []
                break
            merged.append(tuple(
                torch.cat([_left_pad(o, self.rows, width, l), _left_pad(n, 1, width, l)])
                for o, n, l in zip(old or (None, None), new or (None, None), like)
            ))  # fmt: skip
        self.cache = DynamicCache(ddp_cache_data=merged or None, config=self.model.config)
        real = torch.zeros(self.rows + 1, width, dtype=torch.bool)
        real[: self.rows, width - self.width :] = self.real
        real[self.rows, width - new_width :] = True
        self.real = real
        self.next_positions.append(new_width)
        return features

    @torch.inference_mode()
    def remove(self, keep: list[int]) -> None:
        """Keep only the rows at indices ``keep`` (in that order); free the others."""
        self._check_committed()
        if not keep:
            self._reset()
            return
        if len(keep) == self.rows:
            return
        index = torch.tensor(keep, dtype=torch.long)
        if self.cache.is_initialized:
            self.cache.batch_select_indices(index.to(self.device))
        self.real = self.real[index]
        self.next_positions = [self.next_positions[i] for i in keep]
        self.compact_if_wasteful()

    @torch.inference_mode()
    def extend(self, new_ids: list[list[int]], num_logits: list[int], argmax_only: bool = False) -> list[ForwardOutput]:
        """One forward pass feeding row ``i`` the tokens ``new_ids[i]`` (at least one each).

        Returns per row the logits for its last ``num_logits[i]`` fed tokens and the features of all
        of them, as :meth:`CachedLM.extend` would (``argmax_only``: every row decodes greedily, so only
        the logits' argmax need be right). Call :meth:`commit` before the next pass.
        """
        check_feeds(new_ids, num_logits, self.rows)
        self._check_committed()
        lengths = torch.tensor([len(ids) for ids in new_ids])  # [rows]
        fed_width = int(lengths.max())
        input_ids = torch.zeros(self.rows, fed_width, dtype=torch.long)  # [rows, q]; padding id 0 is masked out
        for row, ids in enumerate(new_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        offsets = torch.arange(fed_width)
        position_ids = torch.tensor(self.next_positions).unsqueeze(1) + offsets  # [rows, q]
        fed_real = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [rows, q]
        mask = self._attention_mask(fed_real)  # [rows, 1, q, width + q]
        out = self.body(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=position_ids.to(self.device),
            use_cache=True,
            **{self._cache_kwarg: self.cache},
        )
        hidden = out.last_hidden_state  # [rows, q, hidden]
        self.real = torch.cat([self.real, torch.zeros(self.rows, fed_width, dtype=torch.bool)], dim=1)
        self._fed = lengths.tolist()
        features = [hidden[row, :length] for row, length in enumerate(self._fed)]  # each [len_i, hidden]
        return head_outputs(self._head, features, num_logits, argmax_only)

    def _attention_mask(self, fed_real: torch.Tensor) -> torch.Tensor:
        """Additive mask [rows, 1, q, width + q]: a fed token sees real columns up to itself."""
        rows, fed_width = fed_real.shape  # fed_real: [rows, q]
        key_real = torch.cat([self.real, fed_real], dim=1)  # [rows, width + q]
        key_index = torch.arange(self.width + fed_width)
        causal = key_index.unsqueeze(0) <= (self.width + torch.arange(fed_width)).unsqueeze(1)  # [q, width + q]
        allowed = key_real.unsqueeze(1) & causal.unsqueeze(0)  # [rows, q, width + q]
        # Additive (0 / most negative) rather than boolean: every attention implementation takes it.
        mask = torch.zeros(allowed.shape, dtype=self._dtype)
        mask.masked_fill_(~allowed, torch.finfo(self._dtype).min)
        return mask.unsqueeze(1)

    @torch.inference_mode()
    def commit(self, kept: list[int]) -> None:
        """Row ``i`` keeps the first ``kept[i]`` tokens it was fed by the last :meth:`extend`."""
        check_kept(kept, self._fed)
        start = self.width - max(self._fed)
        for row, count in enumerate(kept):
            self.real[row, start : start + count] = True
            self.next_positions[row] += count
        self._fed = None
        self.compact_if_wasteful()

    def compact_if_wasteful(self) -> bool:
        if self.width < self.compaction.min_width or self.wasted_share <= self.compaction.waste:
            return False
        self.compact()
        return True

    @torch.inference_mode()
    def compact(self) -> None:
        """Re-gather each row's real columns, in order and left-padded, into the narrowest cache."""
        self._check_committed()
        counts = self.real.sum(1)  # [rows]
        width = int(counts.max()) if self.rows else 0
        # index[row, j]: source column of target column j; the left padding borrows column 0 (masked).
        index = torch.zeros(self.rows, width, dtype=torch.long)
        for row in range(self.rows):
            columns = self.real[row].nonzero().squeeze(1)
            index[row, width - len(columns) :] = columns
        layers = []
        for tensors in _layer_tensors(self.cache):
            if tensors is None:
                layers = []
                break
            keys, values = tensors  # each [rows, kv_heads, old_width, head_dim]
            gather = index.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            layers.append((keys.gather(2, gather), values.gather(2, gather)))
        self.cache = DynamicCache(ddp_cache_data=layers or None, config=self.model.config)
        self.real = torch.arange(width).unsqueeze(0) >= (width - counts).unsqueeze(1)

    def _check_committed(self) -> None:
        if self._fed is not None:
            raise RuntimeError("the last extend() has not been committed")


def check_feeds(new_ids: list[list[int]], num_logits: list[int], rows: int) -> None:
    """A batched pass's arguments: one non-empty feed per row, logits for at most its fed tokens."""
    if len(new_ids) != rows or len(num_logits) != rows:
        raise ValueError(f"new_ids and num_logits need one entry per row ({rows}), got {len(new_ids)} and {len(num_logits)}")
    if any(not ids for ids in new_ids):
        raise ValueError("every row needs at least one new token")
    if any(not 0 <= n <= len(ids) for n, ids in zip(num_logits, new_ids)):
        raise ValueError("num_logits[i] must be in [0, len(new_ids[i])]")


def check_kept(kept: list[int], fed: list[int] | None) -> None:
    """A commit's counts: one per row, each within what the pending pass fed that row."""
    if fed is None:
        raise RuntimeError("commit() without a pending extend()")
    if len(kept) != len(fed) or any(not 0 <= k <= f for k, f in zip(kept, fed)):
        raise ValueError(f"kept must give each row a count in [0, fed], got {kept} for fed {fed}")


def head_outputs(head: CachedLM, features: list[torch.Tensor], num_logits: list[int], argmax_only: bool) -> list[ForwardOutput]:
    """Each row's logits for its last ``num_logits[i]`` features # [len_i, hidden], through ``head``'s
    LM head (or argmax screen) for all rows in one matrix product, with its features."""
    wanted = [f[len(f) - n :] for f, n in zip(features, num_logits)]
    logits = head.logits(torch.cat(wanted), argmax_only).split(num_logits)  # each [num_logits_i, vocab]
    return [ForwardOutput(logits=l, features=f) for l, f in zip(logits, features)]


def _layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each layer's (keys, values) [rows, kv_heads, width, head_dim], or None while it holds nothing."""
    return [(layer.keys, layer.values) if layer.is_initialized and layer.keys.numel() else None for layer in cache.layers]


def _left_pad(tensor: torch.Tensor | None, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` [rows, heads, w, dim] (None: w = 0) left-padded with zeros to ``width`` columns."""
    heads, dim = like.shape[1], like.shape[3]
    if tensor is None:
        return like.new_zeros(rows, heads, width, dim)
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    return torch.cat([tensor.new_zeros(rows, heads, missing, dim), tensor], dim=2)
