"""The EAGLE draft head: one decoder layer that autoregresses the target's top-layer features.

At position i the head reads the target's feature f_i (what the target's LM head reads to
predict token i+1) together with the embedding of token x_{i+1} — the token one step ahead,
which the target actually chose, so the head need not guess it — and predicts f_{i+1}:

    f̂_{i+1} = norm( layer( fc( [embed(x_{i+1}) ; f_i] ) ) )

The target's frozen LM head turns f̂_{i+1} into the draft distribution of x_{i+2}. The head
owns only ``fc``, one pre-norm decoder layer (grouped-query attention with rotary positions,
SiLU-gated MLP: the Llama/Qwen2 block) and a final norm. It is our own small module, not the
target's class, so its attention (and its KV cache) are ours to control. Embeddings and LM
head stay the target's and are never stored in the head's checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.far_memory import FarMemoryConfig, FarMemoryRows, far_memory_attention, far_memory_prefix_attention, low_precision_memory
from verispec.drafters.shared_prefix import KeysValues, append_and_attend, shared_prefix_attention
from verispec.models.quantize import linear_columns
from verispec.models.rotary import apply_rotary, rotary_cos_sin
from verispec.engine.kv_cache import LayerKVCache

CATCH_UP_CHUNK = 1024  # rows a catch-up computes at once (see EagleHead._last_row_inputs)


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # the target's feature width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the head's MLP width (smaller than the target's keeps it cheap)
    vocab_size: int  # the target's vocabulary (width of its LM head)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = True  # bias on q/k/v projections (Qwen2 style)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"EagleConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"EagleConfig.head_dim must be even for rotary positions, got {self.head_dim}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None) -> "EagleConfig":  # noqa: ANN001 - a transformers config
        """The head shape that fits a Llama/Qwen2/Mistral-family target config."""
        config = target_config.get_text_config(decoder=True)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size or config.intermediate_size,
            vocab_size=config.vocab_size,
            rope_theta=float(getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            attention_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
        )


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.fc = nn.Linear(2 * hidden, hidden)
        self.input_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Start close to "the next feature is the current one mixed in": fc passes the feature half through.
        with torch.no_grad():
            hidden = self.config.hidden_size
            self.fc.weight[:, hidden:] += torch.eye(hidden)

    def forward(
        self,
        features: torch.Tensor,  # [batch, n, hidden]: f_i (real, or the head's own earlier prediction)
        next_embeds: torch.Tensor,  # [batch, n, hidden]: embed(x_{i+1})
        start: int = 0,  # position of the first row (training: 0; drafting: the cache length)
        cache: LayerKVCache | None = None,  # batch 1 only; None: causal attention within the n rows
        far_memory: FarMemoryConfig | None = None,  # cached path only; None or mode "full": as trained
        last_only: bool = False,  # cached path only: cache every row's key/value, predict for the last row only
        embed_rows: torch.Tensor | None = None,  # [n] long, last_only only: row i reads next_embeds[:, embed_rows[i]] (next_embeds # [1, distinct, hidden])
    ) -> torch.Tensor:
        """Predicted next features # [batch, n, hidden] (# [1, 1, hidden] with ``last_only``).

        With ``far_memory`` (mode "local" or "fold") the cache holds UNrotated keys, rotated per
        (row, key) at attention time (see :mod:`verispec.drafters.far_memory`); a cache must be
        used with one setting for its whole life.

        ``last_only`` is the catch-up over a prompt: a one-layer head needs only the keys and
        values of the earlier rows, so their query, attention and MLP (~90% of a row's cost) are skipped.
        With ``embed_rows`` it is given each distinct next token's embedding once: a long prompt
        repeats its tokens (16K tokens of stdlib code: ~1,600 distinct), and fc's embedding half
        is then computed once per distinct token — about half of fc, the catch-up's largest product.
        """
        batch, num_new, _ = features.shape
        if cache is not None and (batch != 1 or start != cache.length):
            raise ValueError(f"a cached head step takes batch 1 at position {cache.length}, got batch {batch} at {start}")
        if last_only and cache is None:
            raise ValueError("last_only runs on the cached (drafting) path: pass a LayerKVCache")
        if embed_rows is not None and (not last_only or embed_rows.shape != (num_new,)):
            raise ValueError(f"embed_rows needs last_only and one index per row ({num_new}), got shape {tuple(embed_rows.shape)}")
        first_row = num_new - 1 if last_only else 0  # rows first_row .. num_new-1 get a prediction
        if last_only:
            hidden, normed, key, value = self._last_row_inputs(features, next_embeds, embed_rows)
        else:
            hidden, normed, key, value = self._inputs(features, next_embeds)
        query = self._query(normed)
        if far_memory is not None and far_memory.changes_attention:
            if cache is None:
                raise ValueError("far-memory attention runs on the cached (drafting) path: pass a LayerKVCache")
            return self._finish(hidden, self._far_memory_context(query[0], key[0], value[0], cache, far_memory)[None])
        key = apply_rotary(key, *self._rope(start, start + num_new, features.device))
        query = apply_rotary(query, *self._rope(start + first_row, start + num_new, features.device))
        if cache is None:
            context = F.scaled_dot_product_attention(query, key, value, is_causal=num_new > 1, enable_gqa=True)
        else:
            # Grouped products over the cache, not SDPA: PyTorch's CPU SDPA took 10.8 ms for one
            # query row over 16K cached keys (12 heads, 2 KV heads), these 2.7 ms (0.38 against
            # 0.22 ms at 2K, 0.08 against 0.10 ms at 512).
            context = append_and_attend(query, key, value, [cache], [num_new], [num_new - first_row])
        return self._finish(hidden, context)

    def advance_many(
        self,
        features: list[torch.Tensor],  # each [n_s, hidden]: f_i of sequence s's new rows (real, or the head's own prediction)
        next_embeds: list[torch.Tensor],  # each [n_s, hidden]: embed(x_{i+1}) of those rows
        caches: list[LayerKVCache],  # one per sequence
        far_memory: list[FarMemoryConfig | None] | None = None,  # per sequence, what its cache was filled with; None: all as trained
    ) -> torch.Tensor:
        """Feed each sequence s its ``n_s`` new rows at the end of ``caches[s]`` and predict the next
        feature of its last row # [sequences, hidden]: per sequence what :meth:`forward` with that
        cache, ``far_memory[s]`` and ``last_only`` computes (a drafting step is n_s = 1; a round's
        catch-up a few rows), with the products run once over every sequence's rows (batched
        serving: the head's weights read once a step, not once a request). Every row's key and value
        are cached; only the last rows get a query, attention and MLP. Sequences attending as trained
        share one attention call; one with far memory (its cache holds unrotated keys) attends alone."""
        if not len(features) == len(next_embeds) == len(caches) or any(len(f) == 0 or len(f) != len(e) for f, e in zip(features, next_embeds)):
            raise ValueError(f"advance_many takes one cache and 1+ rows of features and embeddings per sequence: {len(features)} / {len(next_embeds)} / {len(caches)}")
        if far_memory is not None and len(far_memory) != len(caches):
            raise ValueError(f"advance_many takes one far_memory entry per sequence: {len(far_memory)} for {len(caches)}")
        counts = [len(rows) for rows in features]
        firsts = [sum(counts[:s]) for s in range(len(counts))]  # each sequence's first row
        last = torch.tensor(counts).cumsum(0) - 1  # each sequence's last row
        hidden, normed, key, value = self._inputs(torch.cat(features)[None], torch.cat(next_embeds)[None])  # key, value: [1, kv_heads, N, head_dim] unrotated
        query = self._query(normed[:, last])  # [1, heads, sequences, head_dim] unrotated
        folded = [config is not None and config.changes_attention for config in far_memory or [None] * len(caches)]
        context = torch.empty_like(query)
        trained = [s for s, fold in enumerate(folded) if not fold]
        if trained:
            rows = torch.cat([torch.arange(firsts[s], firsts[s] + counts[s]) for s in trained])  # the trained sequences' rows
            positions = torch.cat([torch.arange(caches[s].length, caches[s].length + counts[s]) for s in trained]).float()
            cos, sin = rotary_cos_sin(positions.to(key.device), self.inv_freq)  # [rows, head_dim]
            last_rows = torch.tensor([counts[s] for s in trained]).cumsum(0) - 1  # each one's last row among them
            trained_query = apply_rotary(query[:, :, trained], cos[last_rows], sin[last_rows])
            trained_key = apply_rotary(key[:, :, rows], cos, sin)
            context[:, :, trained] = append_and_attend(trained_query, trained_key, value[:, :, rows], [caches[s] for s in trained], [counts[s] for s in trained], [1] * len(trained))
        for s in (s for s, fold in enumerate(folded) if fold):  # as forward's far-memory path, for its last row
            own = slice(firsts[s], firsts[s] + counts[s])
            context[0, :, s : s + 1] = self._far_memory_context(query[0, :, s : s + 1], key[0, :, own], value[0, :, own], caches[s], far_memory[s])
        return self._finish(hidden[:, last], context)[0]

    def append_keys_values(
        self,
        features: list[torch.Tensor],  # each [n_s, hidden]: f_i of sequence s's new rows
        next_embeds: list[torch.Tensor],  # each [n_s, hidden]: embed(x_{i+1}) of those rows
        caches: list[LayerKVCache],  # one per sequence
        far_memory: list[FarMemoryConfig | None] | None = None,  # per sequence, what its cache is filled with; None: all as trained
    ) -> None:
        """Cache each sequence's new rows' keys and values, predicting nothing: what a head whose
        cache is only READ later needs (the parallel drafter's corrector, whose pair-fit steps
        attend to the cache but never continue from its last row). The keys and values equal
        those :meth:`forward` with ``last_only`` and :meth:`advance_many` cache (rotated at
        their positions, or unrotated where ``far_memory`` changes attention), but no row gets a
        query, attention or MLP: a round's catch-up reads fc and the key/value projections (~5 MB
        of int8 weights for the 1.5B target) instead of the whole layer (~45 MB). fc runs once
        over every sequence's rows, CATCH_UP_CHUNK rows at a time."""
        if not len(features) == len(next_embeds) == len(caches) or any(len(f) == 0 or len(f) != len(e) for f, e in zip(features, next_embeds)):
            raise ValueError(f"append_keys_values takes one cache and 1+ rows of features and embeddings per sequence: {len(features)} / {len(next_embeds)} / {len(caches)}")
        if far_memory is not None and len(far_memory) != len(caches):
            raise ValueError(f"append_keys_values takes one far_memory entry per sequence: {len(far_memory)} for {len(caches)}")
        _, _, key, value = self._last_row_inputs(torch.cat(features)[None], torch.cat(next_embeds)[None], None)  # [1, kv_heads, N, head_dim] unrotated
        first = 0
        for cache, rows, config in zip(caches, features, far_memory or [None] * len(caches)):
            own = slice(first, first + len(rows))
            own_key = key[0, :, own]
            if config is None or not config.changes_attention:  # a far-memory cache holds unrotated keys
                own_key = apply_rotary(own_key, *self._rope(cache.length, cache.length + len(rows), key.device))
            cache.append(own_key, value[0, :, own])
            first = own.stop

    def _far_memory_context(
        self,
        query: torch.Tensor,  # [heads, q, head_dim] unrotated: the last q of the new rows
        key: torch.Tensor,  # [kv_heads, n, head_dim] unrotated: the n new rows (q <= n)
        value: torch.Tensor,  # [kv_heads, n, head_dim]
        cache: LayerKVCache,  # filled with ``far_memory`` (unrotated keys: a key's position depends on the query row)
        far_memory: FarMemoryConfig,
    ) -> torch.Tensor:
        """Append the new rows' keys and values to ``cache`` and attend the last q rows with far
        memory (bfloat16 memory where :func:`low_precision_memory` says so) # [heads, q, head_dim]."""
        keys, values = cache.append(key, value)
        memory = low_precision_memory(cache, cache.length, far_memory)
        return far_memory_attention(query, keys, values, cache.length - query.shape[1], self.inv_freq, far_memory, memory)

    def independent_steps(
        self,
        features: torch.Tensor,  # [rows, hidden]: f_i of each row (real, or drafted by another head)
        next_embeds: torch.Tensor,  # [rows, hidden]: embed(x_{i+1}), the token one step ahead of each row
        positions: torch.Tensor,  # [rows] long: each row's position i
        context: KeysValues,  # keys, values # [1, kv_heads, P, head_dim]: cached real rows, shared
        context_visible: torch.Tensor | None = None,  # [rows, P] bool: the cached rows each row sees (None: all)
        far_memory: FarMemoryConfig | None = None,  # the config the cache was filled with (its keys then unrotated)
    ) -> torch.Tensor:
        """One head step for each of R rows that do not see one another # [rows, hidden].

        Row r attends to its visible cached rows and to itself, as if it alone were appended at
        ``positions[r]``: what a drafting step computes, for R alternatives at once (contextual
        correction scores every candidate's successor this way, in one call). The cache comes
        from :meth:`forward` with the same ``far_memory`` (keys rotated as trained, or unrotated).
        """
        hidden, query, (key, value), (cos, sin) = self._rows_at(features, next_embeds, positions)
        visible = None if context_visible is None else context_visible[:, None, None, :]
        if far_memory is not None and far_memory.changes_attention:
            rows = FarMemoryRows(far_memory, positions[:, None], self.inv_freq)
            attended = far_memory_prefix_attention(query, context, visible, (key, value), False, rows)  # [R, heads, 1, head_dim]
        else:
            attended = shared_prefix_attention(apply_rotary(query, cos, sin), context, visible, (key, value), causal=False)
        return self._finish(hidden, attended)[:, 0]

    def tree_steps(
        self,
        features: torch.Tensor,  # [rows, hidden]: f_i of each row (a chain draft's or a tree node's input feature)
        next_embeds: torch.Tensor,  # [rows, hidden]: embed of each row's token
        positions: torch.Tensor,  # [rows] long: each row's position
        context: KeysValues,  # keys, values # [1, kv_heads, P, head_dim]: the cache (rotated as trained)
        context_visible: torch.Tensor,  # [rows, P] bool: the cached positions each row sees
        ancestors: KeysValues | None = None,  # [1, kv_heads, S, head_dim]: earlier tree rows' keys (rotated), values
        ancestors_visible: torch.Tensor | None = None,  # [rows, S] bool: the tree rows each row sees (its ancestors)
    ) -> tuple[torch.Tensor, KeysValues]:
        """One drafting step for the rows of a draft tree, in ONE call # ([rows, hidden], their rotated
        keys and values # each [rows, kv_heads, head_dim]): a chain draft (seeing the whole cache) and
        runner-up nodes (each seeing the real rows, the chain drafts before its branch point and its
        tree ancestors), so the head's weights are read once a step for the chain and its branches.
        A row computes what a cached step feeding its path computes (up to rounding: other row counts)."""
        hidden, query, (key, value), (cos, sin) = self._rows_at(features, next_embeds, positions)
        query = apply_rotary(query, cos, sin)
        own, own_visible = (key, value), None
        if ancestors is not None and ancestors[0].shape[2]:
            rows = len(features)
            own = tuple(torch.cat((part.expand(rows, -1, -1, -1), mine), dim=2) for part, mine in zip(ancestors, (key, value)))
            own_visible = torch.cat((ancestors_visible, torch.ones(rows, 1, dtype=torch.bool)), dim=1)[:, None, None, :]
        attended = shared_prefix_attention(query, context, context_visible[:, None, None, :], own, causal=False, own_visible=own_visible)
        return self._finish(hidden, attended)[:, 0], (key[:, :, 0], value[:, :, 0])

    def unrolled(
        self,
        features: torch.Tensor,  # [batch, n, hidden]: real f_i
        next_embeds: torch.Tensor,  # [batch, n, hidden]: embed(x_{i+1})
        steps: int,
    ) -> list[torch.Tensor]:
        """What drafting steps 1..``steps`` predict at every row, one pass per step ("training-time test").

        Drafting feeds the head its OWN predictions after the first draft: step 1 is row i on real
        f_i; step s reads, at row i, step s-1's prediction f̂_i (that step's output at row i-1) and
        attends to the real rows up to i-s+1 plus rows i-s+2..i of steps 2..s — exactly the keys
        a cached drafting step would hold. Training on these (not only on real inputs) teaches
        the head to recover from its own errors, where the second draft's acceptance collapses.
        Returns one # [batch, n, hidden] per step; step s's rows i < s-1 have no drafting
        counterpart (the caller ignores them).
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        num_rows = features.shape[1]
        cos, sin = self._rope(0, num_rows, features.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        inputs = features
        for step in range(steps):
            hidden, normed, key, value = self._inputs(inputs, next_embeds)
            query = self._query(normed)
            keys.append(apply_rotary(key, cos, sin))
            values.append(value)
            mask = unrolled_mask(num_rows, step, features.device)  # [n, (step+1)·n]
            context = F.scaled_dot_product_attention(apply_rotary(query, cos, sin), torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True)
            outputs.append(self._finish(hidden, context))
            inputs = torch.cat((features[:, :1], outputs[-1][:, :-1]), dim=1)  # row i reads f̂_i; row 0 has none (ignored)
        return outputs

    def _rows_at(self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> tuple:
        """One-row steps of R rows (features, next_embeds # [R, hidden]) at ``positions`` # [R]: hidden
        # [R, 1, hidden], the UNrotated query # [R, heads, 1, head_dim], the key rotated at each row's
        position and the value # [R, kv_heads, 1, head_dim], and that rotation's cos, sin # [R, 1, 1, head_dim]."""
        hidden, normed, key, value = self._inputs(features[:, None], next_embeds[:, None])
        cos, sin = rotary_cos_sin(positions.float(), self.inv_freq)  # [R, head_dim]
        cos, sin = cos[:, None, None], sin[:, None, None]
        return hidden, self._query(normed), (apply_rotary(key, cos, sin), value), (cos, sin)

    def _inputs(self, features: torch.Tensor, next_embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(hidden and its normed form # [batch, n, hidden], unrotated key and value
        # [batch, kv_heads, n, head_dim]) of rows reading features and next_embeds # [batch, n, hidden]."""
        # .to: under training's bfloat16 autocast the residual stream (and every norm) stays in the features' precision
        hidden = self.fc(torch.cat((next_embeds, features), dim=-1)).to(features.dtype)
        return (hidden, *self._attention_inputs(hidden))

    def _attention_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(normed hidden # [batch, n, hidden], unrotated key and value # [batch, kv_heads, n, head_dim])."""
        batch, num_new, _ = hidden.shape
        config = self.config
        normed = self.input_norm(hidden)
        key = self.k_proj(normed).view(batch, num_new, config.num_kv_heads, config.head_dim).transpose(1, 2)
        value = self.v_proj(normed).view(batch, num_new, config.num_kv_heads, config.head_dim).transpose(1, 2)
        return normed, key, value

    def _last_row_inputs(
        self,
        features: torch.Tensor,  # [1, n, hidden]
        next_embeds: torch.Tensor,  # [1, n, hidden], or [1, distinct, hidden] with embed_rows
        embed_rows: torch.Tensor | None,  # [n] long: the next_embeds row each row reads; None: row i reads row i
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`_inputs` for a catch-up: hidden and normed of the LAST row only # [1, 1, hidden], keys
        and values of every row. Computed CATCH_UP_CHUNK rows at a time: the concatenated inputs
        and the norm then stay in the CPU's caches (at 16K rows the norm alone took 97 ms at once,
        32 ms in chunks) and no [n, 2·hidden] input copy is ever whole (200 MB at 16K). With
        ``embed_rows``, fc([e; f]) = W_e·e + (W_f·f + b), the W_e·e once per distinct embedding."""
        size = self.config.hidden_size
        token_parts = None if embed_rows is None else linear_columns(self.fc, next_embeds, slice(0, size))  # [1, distinct, hidden]: W_e·e
        keys, values = [], []
        for first in range(0, features.shape[1], CATCH_UP_CHUNK):
            rows = slice(first, first + CATCH_UP_CHUNK)
            if token_parts is None:
                hidden, normed, key, value = self._inputs(features[:, rows], next_embeds[:, rows])
            else:
                hidden = linear_columns(self.fc, features[:, rows], slice(size, None)).add_(token_parts[:, embed_rows[rows]])
                hidden = hidden if self.fc.bias is None else hidden.add_(self.fc.bias)
                normed, key, value = self._attention_inputs(hidden)
            keys.append(key)
            values.append(value)
        return hidden[:, -1:], normed[:, -1:], torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def _query(self, normed: torch.Tensor) -> torch.Tensor:
        """Unrotated query # [batch, heads, n, head_dim] of normed rows # [batch, n, hidden]."""
        batch, num_new, _ = normed.shape
        return self.q_proj(normed).view(batch, num_new, self.config.num_heads, self.config.head_dim).transpose(1, 2)

    def _finish(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Output projection, MLP and final norm. hidden: # [batch, n, hidden]; context: # [batch, heads, n, head_dim]"""
        batch, num_new = hidden.shape[:2]
        hidden = hidden + self.o_proj(context.transpose(1, 2).reshape(batch, num_new, -1))
        normed = self.post_attention_norm(hidden)
        hidden = hidden + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return self.norm(hidden)

    def _rope(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(torch.arange(start, end, device=device, dtype=torch.float32), self.inv_freq)


def unrolled_mask(num_rows: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Keys visible to unrolled step ``step`` (0-based) # [n, (step+1)·n] bool, keys laid out step by step.

    Row i of step s sees step 0's rows c <= i - s (the real context) and, of each step k = 1..s,
    the one row i - s + k (the drafts made before it in the same round, and itself).
    """
    rows = torch.arange(num_rows, device=device)[:, None]
    cols = torch.arange(num_rows, device=device)[None, :]
    blocks = [cols <= rows - step] + [cols == rows - step + k for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)
