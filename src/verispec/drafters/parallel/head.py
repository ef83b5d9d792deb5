"""The parallel draft head: K future positions from ONE forward pass over the target's features.

Context (as EAGLE reads it): committed position i carries the target's feature f_i and the
embedding of the token one step ahead, so its row is

    c_i = fc( [embed(x_{i+1}) ; f_i] )          i = 0 .. L-1   (x_L: the last committed token)

and passes through the head's decoder layers causally, its keys/values cached per sequence.
Block: K learned query vectors ("mask tokens") m_0..m_{K-1} sit at positions L..L+K-1, attend
to every cached context position and to each other (bidirectional inside the block), and slot j
is read out through the target's frozen LM head as the draft distribution of x_{L+1+j}:

    b_j = fc( [m_j ; norm(h_{L-1})] )            (slot j unknown: m_j a learned "mask token" embedding)
    b_j = fc( [embed(c) ; norm(h_{L-1})] )       (slot j given as the KNOWN token c = x_{L+1+j})
    q_draft(x_{L+1+j}) = softmax( W · norm( layers( b | context ) )_j )

norm(h_{L-1}) is the last context row's normed output: the context's own guess of the next
feature — with EAGLE's weights, EAGLE's prediction of f_L — so every slot enters like a context
row, through the same fc, with a token embedding (real or mask) beside a feature, and attention
refines it: the slots need not first learn to find the last row among hundreds.

Heads made before 2026-12-04 (``slot_input="add"``, read from files without the key) summed
instead, b_j = m_j + h_{L-1} (+ known(embed(c))): with h's norm ~150 and m_j's ~3 after training,
every slot drafted nearly the anchor's token and a known slot hardly moved its neighbours (measured:
contextual correction never changed a path) — hence the fc input.

Known slots are what contextual correction conditions on (training draws them at random so
that input is in-distribution). The decoder layer is the Llama/Qwen2 block EAGLE uses, so the
EAGLE head's trained weights can initialise the first layer (:meth:`ParallelHead.load_eagle`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.eagle.head import EagleConfig, EagleHead
from verispec.drafters.far_memory import FarMemoryConfig, FarMemoryRows, far_memory_attention, far_memory_prefix_attention
from verispec.drafters.shared_prefix import KeysValues, append_and_attend, shared_prefix_attention
from verispec.models.quantize import linear_columns
from verispec.models.rotary import apply_rotary, rotary_cos_sin
from verispec.engine.kv_cache import LayerKVCache



@dataclass(frozen=True)
class ParallelConfig(EagleConfig):
    """EAGLE's layer shape plus the block: ``block_size`` K drafted positions, ``num_layers`` 1-2.

    ``first_from_anchor``: the first draft is read from the anchor (the last context row's output,
    normed: EAGLE's own next-feature prediction) instead of block slot 0. Training with an anchor
    loss sets it: that readout keeps the EAGLE head's first-token accuracy, which slot 0 loses.
    """

    block_size: int = 4
    num_layers: int = 1
    first_from_anchor: bool = False
    slot_input: str = "add"  # "fc" (new heads) or "add" (what files written before the key existed mean)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slot_input not in ("fc", "add"):
            raise ValueError(f"ParallelConfig.slot_input must be 'fc' or 'add', got {self.slot_input!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"ParallelConfig.block_size must be a positive integer, got {self.block_size!r}")
        if self.num_layers not in (1, 2):
            raise ValueError(f"ParallelConfig.num_layers must be 1 or 2, got {self.num_layers!r}")

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None, block_size: int = 4, num_layers: int = 1, first_from_anchor: bool = False, slot_input: str = "fc") -> "ParallelConfig":  # noqa: ANN001
        """The head shape that fits a Llama/Qwen2/Mistral-family target config."""
        layer = EagleConfig.for_target(target_config, intermediate_size)
        return cls(**dataclasses.asdict(layer), block_size=block_size, num_layers=num_layers, first_from_anchor=first_from_anchor, slot_input=slot_input)


class DecoderLayer(nn.Module):
    """Pre-norm grouped-query attention with rotary positions + SiLU-gated MLP (EAGLE's layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, head_dim
        self.input_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, config.num_heads * head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * head_dim, hidden, bias=False)
        self.post_attention_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, n, hidden]
        cos: torch.Tensor,  # [batch or 1, 1, n, head_dim]: rotary tables of the n rows' positions
        sin: torch.Tensor,  # [batch or 1, 1, n, head_dim]
        prefix: KeysValues | None,  # earlier positions' keys/values, shared by every row of the batch
        prefix_visible: torch.Tensor | None,  # [batch, 1, 1, prefix] bool: which prefix keys a row may see (None: all)
        causal: bool,  # the n rows see each other causally (context) or all of each other (block)
        far: FarMemoryRows | None = None,  # far-memory attention over an UNrotated prefix (None: as trained)
    ) -> tuple[torch.Tensor, KeysValues]:
        """(new hidden # [batch, n, hidden], this call's keys/values # [batch, kv_heads, n, head_dim]:
        keys rotated, or unrotated with ``far`` — what a far-memory cache holds)."""
        query, key, value = self.project(hidden)
        rotated_key = apply_rotary(key, cos, sin)
        if far is None:
            context = shared_prefix_attention(apply_rotary(query, cos, sin), prefix, prefix_visible, (rotated_key, value), causal)
            return self.finish(hidden, context), (rotated_key, value)
        context = far_memory_prefix_attention(query, prefix if prefix is not None else _empty_prefix(key), prefix_visible, (rotated_key, value), causal, far)
        return self.finish(hidden, context), (key, value)

    def project(self, hidden: torch.Tensor, query_from: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unrotated query # [batch, heads, n - query_from, head_dim] of rows ``query_from``.. (default
        all), key and value # [batch, kv_heads, n, head_dim] of every row of ``hidden`` # [batch, n, hidden]."""
        batch, num_new, _ = hidden.shape
        normed = self.input_norm(hidden)
        query = self.q_proj(normed[:, query_from:]).view(batch, num_new - query_from, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(normed).view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(normed).view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return query, key, value

    def finish(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Output projection and MLP (residuals included). hidden: # [batch, n, hidden]; context: # [batch, heads, n, head_dim]"""
        batch, num_new, _ = hidden.shape
        hidden = hidden + self.o_proj(context.transpose(1, 2).reshape(batch, num_new, -1))
        normed = self.post_attention_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))


def _empty_prefix(key: torch.Tensor) -> KeysValues:
    """No cached positions # [batch, kv_heads, 0, head_dim] (a block before any context)."""
    empty = key[:, :, :0]
    return empty, empty


class ParallelHead(nn.Module):
    def __init__(self, config: ParallelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mask_embeds = nn.Parameter(torch.empty(config.block_size, hidden))  # m_j, one per block slot
        if config.slot_input == "add":
            self.known = nn.Linear(hidden, hidden, bias=False)  # a known slot's token embedding -> its input
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._mask_rows_key: tuple | None = None  # what _mask_slot_rows' kept rows were computed from
        self._mask_rows: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        EagleHead.reset_parameters(self)  # the same linears, fc passing the feature half through
        nn.init.normal_(self.mask_embeds, std=1.0 / math.sqrt(self.config.hidden_size))

    def load_eagle(self, eagle: EagleHead) -> None:
        """Initialise fc, the first layer and the final norm from a trained EAGLE head of the same shape."""
        mapped = {(name if name.startswith(("fc.", "norm.")) else "layers.0." + name): value for name, value in eagle.state_dict().items()}
        missing = set(mapped) - set(self.state_dict())
        if missing:
            raise ValueError(f"EAGLE head does not fit this parallel head: {sorted(missing)[:3]}")
        self.load_state_dict(mapped, strict=False)

    def encode_context(
        self,
        features: torch.Tensor,  # [batch, n, hidden]: f_i
        next_embeds: torch.Tensor,  # [batch, n, hidden]: embed(x_{i+1})
        start: int = 0,  # position of the first row
        caches: list[LayerKVCache] | None = None,  # one per layer, batch 1; None: the n rows alone
        far_memory: FarMemoryConfig | None = None,  # cached path only; None or mode "full": as trained
        last_only: bool = False,  # cached path only: the LAST row's output (a one-layer head computes no other)
    ) -> tuple[list[KeysValues], torch.Tensor]:
        """(keys/values of every context position so far, per layer # [batch, kv_heads, start+n, head_dim];
        the n rows' outputs h_i before the final norm # [batch, n, hidden]).

        With ``far_memory`` (mode "local" or "fold") the caches hold UNrotated keys, placed per
        (row, key) at attention time (:mod:`verispec.drafters.far_memory`), and the rows attend
        with far memory; blocks drafted after them must pass the same config to :meth:`draft_block`.

        ``last_only``: outputs # [1, 1, hidden] of the last row only — what drafting reads (the anchor).
        A one-layer head then gives every other row its key and value only, no query, attention or
        MLP (a prompt's catch-up, as the EAGLE head's); a deeper head's later layers read every row's
        output, so it computes them all and returns the last."""
        if caches is not None and (features.shape[0] != 1 or any(cache.length != start for cache in caches)):
            raise ValueError(f"a cached context step takes batch 1 at position {caches[0].length}, got batch {features.shape[0]} at {start}")
        if last_only and caches is None:
            raise ValueError("last_only runs on the cached (drafting) path: pass a LayerKVCache per layer")
        hidden = self.fc(torch.cat((next_embeds, features), dim=-1))
        if last_only and len(self.layers) == 1:
            return self._encode_last_row(hidden, start, caches[0], far_memory)
        everything = []
        if far_memory is not None and far_memory.changes_attention:
            if caches is None:
                raise ValueError("far-memory attention runs on the cached (drafting) path: pass a LayerKVCache per layer")
            for layer, cache in zip(self.layers, caches):
                query, key, value = layer.project(hidden)
                keys, values = cache.append(key[0], value[0])  # unrotated: a key's position depends on the query row
                hidden = layer.finish(hidden, far_memory_attention(query[0], keys, values, start, self.inv_freq, far_memory)[None])
                everything.append((keys[None], values[None]))
            return everything, hidden[:, -1:] if last_only else hidden
        cos, sin = self._rope(torch.arange(start, start + features.shape[1], device=features.device))
        for index, layer in enumerate(self.layers):
            prefix = None if caches is None or start == 0 else cached(caches[index])
            hidden, (key, value) = layer(hidden, cos, sin, prefix, None, causal=True)
            if caches is None:
                everything.append((key, value))
            else:
                keys, values = caches[index].append(key[0], value[0])
                everything.append((keys[None], values[None]))
        return everything, hidden[:, -1:] if last_only else hidden

    def _encode_last_row(
        self,
        hidden: torch.Tensor,  # [1, n, hidden]: fc's output for the n new rows
        start: int,  # position of the first new row
        cache: LayerKVCache,  # the one layer's
        far_memory: FarMemoryConfig | None,
    ) -> tuple[list[KeysValues], torch.Tensor]:
        """:meth:`encode_context` with ``last_only`` for a one-layer head: every row's key and value
        cached, the last row's output # [1, 1, hidden]."""
        layer, num_new = self.layers[0], hidden.shape[1]
        query, key, value = layer.project(hidden, query_from=num_new - 1)  # query # [1, heads, 1, head_dim]
        if far_memory is not None and far_memory.changes_attention:
            keys, values = cache.append(key[0], value[0])  # unrotated: a key's position depends on the query row
            context = far_memory_attention(query[0], keys, values, start + num_new - 1, self.inv_freq, far_memory)[None]
        else:
            cos, sin = self._rope(torch.arange(start, start + num_new, device=hidden.device))
            context = append_and_attend(apply_rotary(query, cos[-1:], sin[-1:]), apply_rotary(key, cos, sin), value, [cache], [num_new], [1])
        return [cached(cache)], layer.finish(hidden[:, -1:], context)

    def encode_many(
        self,
        features: list[torch.Tensor],  # each [n_s, hidden]: f_i of sequence s's new context rows
        next_embeds: list[torch.Tensor],  # each [n_s, hidden]: embed(x_{i+1}) of those rows
        caches: list[list[LayerKVCache]],  # per sequence, one cache per layer (attended as trained: no far memory)
    ) -> torch.Tensor:
        """Append each sequence's rows to its own caches, as :meth:`encode_context` does for one
        sequence, and return each sequence's last output h # [sequences, hidden]. fc, the
        projections and the MLP run once over every sequence's rows (batched serving: the head's
        weights read once a round, not once a request); each row attends to its own sequence only."""
        if not len(features) == len(next_embeds) == len(caches) or any(len(f) == 0 or len(f) != len(e) for f, e in zip(features, next_embeds)):
            raise ValueError(f"encode_many takes per sequence its caches and 1+ rows of features and embeddings: {len(features)} / {len(next_embeds)} / {len(caches)}")
        counts = [len(rows) for rows in features]
        hidden = self.fc(torch.cat((torch.cat(next_embeds), torch.cat(features)), dim=-1))[None]  # [1, N, hidden]
        positions = torch.cat([torch.arange(layers[0].length, layers[0].length + count) for layers, count in zip(caches, counts)])
        cos, sin = self._rope(positions)  # [N, head_dim]
        for index, layer in enumerate(self.layers):
            query, key, value = layer.project(hidden)  # [1, heads or kv_heads, N, head_dim]
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            context = append_and_attend(query, key, value, [layers[index] for layers in caches], counts, counts)  # every new row queries
            hidden = layer.finish(hidden, context)
        return hidden[0, torch.tensor(counts).cumsum(0) - 1]

    def draft_block(
        self,
        context: list[KeysValues],  # per layer # [batch or 1, kv_heads, P, head_dim]
        anchor: torch.Tensor,  # [batch or 1, hidden]: h_{L-1}, the output of the row's last visible context position
        block_start: torch.Tensor,  # [batch] int: position of slot 0 (the context length L of that row)
        known_embeds: torch.Tensor | None = None,  # [batch, K, hidden]: embed(token) of known slots (others ignored)
        known: torch.Tensor | None = None,  # [batch, K] bool: which slots are given as known tokens
        context_visible: torch.Tensor | None = None,  # [batch, P] bool: context positions a row may see (None: all)
        far_memory: FarMemoryConfig | None = None,  # the config the context was encoded with (its keys then unrotated)
    ) -> torch.Tensor:
        """Normed features of the K block slots # [batch, K, hidden]; slot j drafts x_{L+1+j}."""
        block = self.config.block_size
        if self.config.slot_input == "fc":
            hidden = self._slot_inputs(anchor, max(len(anchor), len(block_start)), known_embeds, known)
        else:
            hidden = self.mask_embeds + anchor[:, None]  # [batch, K, hidden]
            if known is not None:
                hidden = hidden + self.known(known_embeds) * known[..., None]
        positions = block_start[:, None] + torch.arange(block, device=block_start.device)  # [batch, K]
        cos, sin = self._rope(positions)
        cos, sin = cos[:, None], sin[:, None]  # [batch, 1, K, head_dim]
        visible = None if context_visible is None else context_visible[:, None, None, :]
        far = FarMemoryRows(far_memory, positions, self.inv_freq) if far_memory is not None and far_memory.changes_attention else None
        for layer, prefix in zip(self.layers, context):
            hidden, _ = layer(hidden, cos, sin, prefix, visible, causal=False, far=far)
        return self.norm(hidden)

    def _slot_inputs(
        self,
        anchor: torch.Tensor,  # [batch or 1, hidden]: h_{L-1}
        batch: int,
        known_embeds: torch.Tensor | None,  # [batch, K, hidden]: embed(token) of known slots
        known: torch.Tensor | None,  # [batch, K] bool
    ) -> torch.Tensor:
        """b_j = fc([e_j ; norm(h_{L-1})]) of every slot # [batch, K, hidden], e_j the mask embedding
        m_j or a known token's embedding.

        fc is linear, so it is computed by halves, fc([e ; g]) = W_e·e + W_f·g + bias: a row's K
        slots share the guess g (one product row per block, not K) and only known slots' embeddings
        need a product of their own beside the K mask rows. A block pass otherwise multiplies K rows
        of twice the width — on a 2-core Zen 1 EPYC its largest float32 product (one-off timing).
        """
        size = self.config.hidden_size
        # Each half in fc's own precision (a drafting copy's fc multiplies the feature half in bfloat16).
        guess = linear_columns(self.fc, self.norm(anchor), slice(size, 2 * size)) + self.fc.bias  # [batch or 1, hidden]
        slots = self._mask_slot_rows().expand(batch, self.config.block_size, -1)  # [batch, K, hidden]
        if known is not None and bool(known.any()):
            given = torch.zeros_like(slots)
            given[known] = linear_columns(self.fc, known_embeds[known], slice(0, size))  # [known slots, hidden]
            slots = torch.where(known[..., None], given, slots)
        return slots + guess[:, None]

    def _mask_slot_rows(self) -> torch.Tensor:
        """W_e·m_j of the K mask slots # [K, hidden]. They depend on the weights only, so a frozen
        head (drafting: ``requires_grad`` off, as drafters load heads) keeps them from one block pass
        to the next while fc's weight and the mask embeddings are the same tensors at the same
        in-place version (``load_state_dict`` bumps it). A head being trained computes them every
        time, also in its no-grad validation: a fused optimiser step leaves the version unchanged."""
        size = self.config.hidden_size
        if self.fc.weight.requires_grad or self.mask_embeds.requires_grad:
            return linear_columns(self.fc, self.mask_embeds, slice(0, size))
        weight, masks = self.fc.weight, self.mask_embeds
        key = (weight.data_ptr(), weight._version, masks.data_ptr(), masks._version)
        if self._mask_rows_key != key:
            self._mask_rows = linear_columns(self.fc, masks.detach(), slice(0, size))
            self._mask_rows_key = key
        return self._mask_rows

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin # [..., n, head_dim] for positions # [..., n]."""
        cos, sin = rotary_cos_sin(positions.reshape(-1).float(), self.inv_freq)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def cached(cache: LayerKVCache) -> KeysValues:
    """The keys/values a cache holds # [1, kv_heads, length, head_dim]."""
    return cache.keys[None, :, : cache.length], cache.values[None, :, : cache.length]
