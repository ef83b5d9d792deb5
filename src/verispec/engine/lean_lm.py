"""A lean forward for Llama/Qwen2/Mistral-family models: a draft step without the framework around it.

One draft step of the 0.5B draft on this 2-core CPU spent ~35 ms in its 169 matrix products and
~20 ms around them in transformers' generic forward (a new concatenated KV tensor per layer per
step, mask construction, per-op dispatch of rotary embedding and norms). :class:`LeanDecoder`
runs the SAME weight modules (float32 or int8) with fewer, larger steps:

- q/k/v and gate/up each as one stacked product (:func:`~verispec.models.quantize.stacked_linear`,
  exact for int8: same int8 rows, same per-row scales);
- keys/values written in place into a preallocated per-layer buffer (:class:`LayerKVCache`),
  rolled back by moving its end;
- RMSNorm as one fused call; rotary angles computed once per step for all layers;
- the products through our few-row kernels (:class:`~verispec.models.panel_linear.PanelLinear`)
  where they run: same int8 weight rows and scales, float32 activations;
- and where every product runs them, a few-token step (a draft step) as ONE call into the kernel
  library (``verispec_lean_stack``: the whole stack in one parallel region), since the ~700 small
  ops between the products cost a 1-token step of the 0.5B draft ~8 ms on top of its ~20 ms of
  products.

The model's own modules are read, never modified or patched. A drafter runs it (verification
keeps the output exact whatever the drafter computes), and so does a target switched to the panel
kernels (:func:`target_lm`): the output is then exactly that of this forward, for plain and
speculative decoding alike, and it differs from transformers' forward of the same weights only in
rounding. Tests check it against the model's own forward.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.rotary import apply_rotary, rotary_cos_sin
from verispec.engine.cached_lm import Branch, CachedLM, ForwardOutput, checked_branches
from verispec.engine.kv_cache import LayerKVCache, RowLog, causal_mask_after
from verispec.engine.prefix_cache import PrefixCache, start_sequence
from verispec.models.panel_linear import PanelLinear, bf16_kernels_available, bf16_uses_amx, bf16_widened, int8_uses_amx, panel_library, panel_or_same
from verispec.models.quantize import is_quantized, stacked_linear
from verispec.models.screened_head import ScreenedArgmaxHead

_FAMILIES = ("llama", "qwen2", "mistral")
# Passes over more tokens than the fused stack takes per call run it in pieces (where its products are
# on AMX tiles) up to this many tokens; longer ones go op by op, where PyTorch's attention is the
# faster: the stack's own attention is written for a few new rows (the 0.5B int8 draft's prompt of
# 512 / 1,024 / 2,048 tokens: 1.4 / 4.0 / 11.5 s in pieces against 1.4 / 4.0 / 8.9 s op by op).
MAX_CHUNKED_PASS = 1024


def lean_unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (a transformers causal LM), or None if it can."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in _FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(_FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the lean forward implements SiLU-gated MLPs)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type', rope.get('type'))!r} (the lean forward implements plain rotary positions)"
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "use_sliding_window", config.model_type == "mistral") and getattr(config, "sliding_window", None)
    if sliding or any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention"
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16 and not bf16_kernels_available():
        return "dtype torch.bfloat16 without the bfloat16 panel kernels (the lean forward runs float32 models, int8 linears included, and bfloat16 ones on those kernels)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (the lean forward runs float32 models, int8 linears included, and bfloat16 ones on the bfloat16 panel kernels)"
    body = model.get_decoder()
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "its rotary embedding is scaled"
    for layer in body.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attention is None or mlp is None or not all(hasattr(attention, name) for name in names):
            return f"layer type {type(layer).__name__} is not the Llama/Qwen2 block"
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            return f"MLP type {type(mlp).__name__} is not SiLU-gated"
        linears = (*[getattr(attention, name) for name in names], mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(isinstance(module, (nn.Linear, PanelLinear)) or is_quantized(module) for module in linears):
            return "its linear layers are replaced (e.g. packed kernels); the lean forward reads nn.Linear, int8 Linear or PanelLinear"
    return None


def lean_product(module: nn.Module, panel_kernels: bool) -> nn.Module:
    """How a linear layer runs in the lean forward: our kernels (:func:`panel_or_same`) with
    ``panel_kernels``, else as it is — except bfloat16 layers, which always take our kernels: the lean
    forward's activations are float32, which PyTorch's bfloat16 products do not take."""
    bf16 = isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16
    return panel_or_same(module) if panel_kernels or bf16 else module


def _runs_panel_kernels(model: nn.Module) -> bool:
    """Whether every linear layer of ``model``'s decoder is a float32 (or every one a bfloat16)
    :class:`PanelLinear` (the model was switched to the panel kernels, e.g. a target with
    ``--target-kernels panel``)."""
    linears = [module for module in model.get_decoder().modules() if isinstance(module, (nn.Linear, PanelLinear)) or is_quantized(module)]
    return bool(linears) and all(isinstance(module, PanelLinear) and not module.is_int8 for module in linears) and len({module.is_bf16 for module in linears}) == 1


def target_runs_lean(model: nn.Module) -> bool:
    """Whether :func:`target_lm` runs ``model`` through the lean forward (panel kernels, covered architecture)."""
    return _runs_panel_kernels(model) and lean_unsupported_reason(model) is None


def target_lm(model: nn.Module, screen_lm_head: bool = True, prefixes: PrefixCache | None = None) -> CachedLM:
    """The cached sequence the engine runs a target through: a :class:`LeanLM` when the target runs
    the panel kernels and the lean forward covers it — then a pass over up to 128 tokens is one
    kernel call over the model's own packed weights (no copy), ~25 ms less per 1.5B pass than
    transformers' forward around the same kernels — else a :class:`CachedLM`.

    Exactness is unaffected: plain and speculative decoding both run this, and with the AVX-512
    kernels every row of a pass is computed exactly as a 1-token pass computes it.

    ``screen_lm_head``: greedy passes (``extend(..., argmax_only=True)``) take the argmax of a
    float32 panel LM head through its int8 screen (:class:`~verispec.models.screened_head.ScreenedArgmaxHead`:
    the same argmax, about a quarter of the head's bytes).

    ``prefixes``: start from (and keep) stored prefixes; needs :func:`prefix_reuse_unsupported_reason` None."""
    argmax_head = ScreenedArgmaxHead.for_head(model.get_output_embeddings()) if screen_lm_head else None
    if prefixes is not None and (reason := prefix_reuse_unsupported_reason(model)) is not None:
        raise ValueError(f"prefix reuse cannot run this target: {reason}")
    if target_runs_lean(model):
        return LeanLM(model, LeanDecoder.shared(model), argmax_head=argmax_head, prefixes=prefixes)
    return CachedLM(model, argmax_head=argmax_head)


def prefix_reuse_unsupported_reason(model: nn.Module) -> str | None:
    """Why a :class:`~verispec.engine.prefix_cache.PrefixCache` cannot serve ``model`` as a target
    (its reuse must be exact: only the fused lean stack computes every row as alone), or None."""
    if not target_runs_lean(model):
        return "it does not run the lean forward (it needs the panel kernels and a Llama/Qwen2/Mistral-family model)"
    if LeanDecoder.shared(model).fused is None:
        return "the fused stack does not cover this model's products"
    return None


@dataclass
class _Layer:
    # Products whose outputs are concatenated: one stacked weight, or the model's own q, k, v
    # (gate, up) where they already run the panel kernels (their packed weights, no stacked copy).
    qkv: list[nn.Module]  # hidden -> (heads + 2·kv_heads)·head_dim
    o_proj: nn.Module
    gate_up: list[nn.Module]  # hidden -> 2·intermediate
    down_proj: nn.Module
    input_norm: torch.Tensor  # [hidden] RMSNorm weight
    post_attention_norm: torch.Tensor  # [hidden]


class LeanDecoder:
    """The decoder stack of ``model``, built once per model and shared by every sequence's :class:`LeanLM`.

    ``panel_kernels``: run the products through :class:`~verispec.models.panel_linear.PanelLinear`
    where the kernels run here (default), else PyTorch's (float32 or fbgemm int8) kernels; a
    bfloat16 model's products run the bfloat16 panel kernels either way.
    """

    def __init__(self, model: nn.Module, panel_kernels: bool = True) -> None:
        reason = lean_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        self.panel_kernels = panel_kernels
        fast = functools.partial(lean_product, panel_kernels=panel_kernels)
        config = model.config.get_text_config(decoder=True)
        body = model.get_decoder()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.eps = float(config.rms_norm_eps)
        self.embed_tokens = body.embed_tokens
        # float32 activations whatever the weights: a bfloat16 model's norms and embeddings are upcast
        # (exactly), its products round their inputs to bfloat16 (PanelLinear, the fused stack).
        self.norm = body.norm.weight.detach().float()
        self.inv_freq = body.rotary_emb.inv_freq.detach().float()  # the model's own frequencies

        def group(modules: list[nn.Module]) -> list[nn.Module]:
            if all(isinstance(module, PanelLinear) for module in modules):
                return modules
            return [fast(stacked_linear(modules))]

        self.layers = [
            _Layer(
                qkv=group([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                o_proj=fast(layer.self_attn.o_proj),
                gate_up=group([layer.mlp.gate_proj, layer.mlp.up_proj]),
                down_proj=fast(layer.mlp.down_proj),
                input_norm=layer.input_layernorm.weight.detach().float(),
                post_attention_norm=layer.post_attention_layernorm.weight.detach().float(),
            )
            for layer in body.layers
        ]
        self.source_o_proj = body.layers[0].self_attn.o_proj  # what shared() compares to see a swap
        self.fused = _FusedStack.for_decoder(self)

    @classmethod
    def shared(cls, model: nn.Module, panel_kernels: bool = True) -> "LeanDecoder":
        """One decoder per model object and kernel choice (its stacked weights are a copy: build
        them once), rebuilt if the model's modules were swapped since (e.g. quantised in place)."""
        decoders = _SHARED.setdefault(model, {})
        decoder = decoders.get(panel_kernels)
        if decoder is None or decoder.source_o_proj is not model.get_decoder().layers[0].self_attn.o_proj:
            decoder = decoders[panel_kernels] = cls(model, panel_kernels)
        return decoder

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden] float32
        return self.embed_tokens(input_ids).float()

    def new_cache(self) -> list[LayerKVCache]:
        return [LayerKVCache() for _ in self.layers]

    @torch.inference_mode()
    def forward_many(self, input_ids: list[list[int]], sequences: list[list[LayerKVCache]], row_exact: bool = False) -> list[torch.Tensor]:
        """Top-layer features # [n_i, hidden] of each sequence's new ids, continuing its caches: as many
        sequences per fused call as the kernels take rows (batched serving; needs ``self.fused``). A
        sequence alone in its call runs :meth:`forward`, call for call what a single sequence runs
        (``row_exact`` as there)."""
        lengths = [len(ids) for ids in input_ids]
        features: list[torch.Tensor] = []
        for first, last in _groups(lengths, self.fused.max_rows):
            if last - first == 1:
                features.append(self.forward(torch.tensor(input_ids[first], dtype=torch.long), sequences[first], row_exact))
                continue
            starts = [caches[0].length for caches in sequences[first:last]]
            positions = torch.cat([torch.arange(start, start + count, dtype=torch.float32) for start, count in zip(starts, lengths[first:last])])  # [n]
            cos, sin = rotary_cos_sin(positions, self.inv_freq)  # each [n, head_dim]
            embedded = self.embed(torch.tensor([token for ids in input_ids[first:last] for token in ids], dtype=torch.long))  # [n, hidden]
            features += self.fused(embedded, sequences[first:last], lengths[first:last], cos, sin).split(lengths[first:last])
        return features

    @torch.inference_mode()
    def forward_branches(self, input_ids: torch.Tensor, caches: list[LayerKVCache], row_prefix: list[int], row_parent: list[int] | None = None) -> torch.Tensor:
        """:meth:`forward` for a draft tree in one fused call: input_ids # [n] is a chain followed by
        branch rows; ``row_prefix`` [n] holds -1 for a chain row and, for a branch row, the position
        where its path leaves the chain: it sees the cache below that position, then ``row_parent``'s
        chain of branch rows (a row's parent row, -1 for none; None: no branch has one), then itself,
        and is rotated to prefix + its depth. Every row goes to the next slot of the cache (a branch
        row after the chain), and every row's features are bit for bit what feeding its path at its
        position in a chain gives."""
        num_new, start = len(input_ids), caches[0].length
        if self.fused is None or num_new > self.fused.max_rows:
            raise ValueError(f"branch rows need the fused stack and at most {0 if self.fused is None else self.fused.max_rows} rows")
        depth = [0] * num_new
        for row in range(num_new):
            if row_parent is not None and row_parent[row] >= 0:
                depth[row] = depth[row_parent[row]] + 1
        positions = torch.tensor([start + row if prefix < 0 else prefix + depth[row] for row, prefix in enumerate(row_prefix)], dtype=torch.float32)
        cos, sin = rotary_cos_sin(positions, self.inv_freq)  # [n, head_dim]
        return self.fused(self.embed(input_ids), [caches], [num_new], cos, sin, row_prefix, row_parent)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, caches: list[LayerKVCache], row_exact: bool = False) -> torch.Tensor:
        """Top-layer features # [n, hidden] of input_ids # [n] continuing the cached sequence (appended to ``caches``).

        ``row_exact``: every pass through the fused stack (``max_rows`` rows a call), however long,
        so that each position's keys, values and features are exactly what a pass over it
        alone gives, however the sequence was split into passes (prefix reuse needs that; the
        op-by-op path's products and attention may round differently for different row counts)."""
        num_new, start = len(input_ids), caches[0].length
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rotary_cos_sin(torch.arange(start, start + num_new, dtype=torch.float32), self.inv_freq)  # [n, head_dim]
        if self.fused is not None and num_new <= self.fused.max_rows:
            return self.fused(self.embed(input_ids), [caches], [num_new], cos, sin)
        if row_exact and self.fused is None:
            raise ValueError("row_exact passes need the fused stack (LeanDecoder.fused)")
        if self.fused is not None and (row_exact or (self.fused.chunks_long_passes and num_new <= MAX_CHUNKED_PASS)):  # a prompt, in pieces
            embedded, rows = self.embed(input_ids), self.fused.max_rows
            return torch.cat([
                self.fused(embedded[first : first + rows], [caches], [min(rows, num_new - first)], cos[first : first + rows], sin[first : first + rows])
                for first in range(0, num_new, rows)
            ])
        mask = causal_mask_after(start, num_new)
        shape = (self.hidden_size,)
        hidden = self.embed(input_ids)  # [n, hidden]
        for layer, cache in zip(self.layers, caches):
            normed = F.rms_norm(hidden, shape, layer.input_norm, self.eps)
            query, key, value = (  # each [heads or kv_heads, n, head_dim]
                part.reshape(num_new, -1, head_dim).transpose(0, 1)
                for part in _parts(layer.qkv, normed, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
            )
            keys, values = cache.append(apply_rotary(key, cos, sin), value)  # [kv_heads, start+n, head_dim]
            context = F.scaled_dot_product_attention(apply_rotary(query, cos, sin)[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)
            hidden = hidden + layer.o_proj(context[0].transpose(0, 1).reshape(num_new, heads * head_dim))
            normed = F.rms_norm(hidden, shape, layer.post_attention_norm, self.eps)
            gate, up = _parts(layer.gate_up, normed, (layer.down_proj.in_features,) * 2)
            hidden = hidden + layer.down_proj(F.silu(gate) * up)
        return F.rms_norm(hidden, shape, self.norm, self.eps)


def _groups(lengths: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive index ranges [first, last) of ``lengths`` each summing to at most ``max_rows``
    (a single longer entry gets a range of its own)."""
    groups, first, total = [], 0, 0
    for index, length in enumerate(lengths):
        if index > first and total + length > max_rows:
            groups.append((first, index))
            first, total = index, 0
        total += length
    if lengths:
        groups.append((first, len(lengths)))
    return groups


def _parts(products: list[nn.Module], x: torch.Tensor, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """The outputs of ``products`` on x # [n, in], one # [n, width] per width: a stacked product's
    output split (views), or each product's own output. Never concatenated: over a long prompt the
    gate/up outputs are ~50 MB a layer, and copying them cost 0.4-2 s of a 709-token prefill here."""
    if len(products) == 1:
        return list(products[0](x).split(widths, dim=-1))
    return [product(x) for product in products]


class _FusedStack:
    """The arguments of ``verispec_lean_stack`` for one :class:`LeanDecoder`, built once: pointers to
    every layer's packed panels, scales, biases and norm weights (the decoder keeps the tensors alive)."""

    @classmethod
    def for_decoder(cls, decoder: "LeanDecoder") -> "_FusedStack | None":
        """None unless every product of ``decoder`` runs the panel kernels with one weight kind."""
        products = [module for layer in decoder.layers for module in (*layer.qkv, layer.o_proj, *layer.gate_up, layer.down_proj)]
        if not all(isinstance(module, PanelLinear) for module in products):
            return None
        if len({(module.is_int8, module.is_bf16) for module in products}) != 1 or decoder.head_dim % 8 or decoder.head_dim > 256 or decoder.num_heads % decoder.num_kv_heads:
            return None
        first = decoder.layers[0]  # the kernel takes one q/k/v and gate/up grouping for all layers
        if any(len(layer.qkv) != len(first.qkv) or len(layer.gate_up) != len(first.gate_up) for layer in decoder.layers):
            return None
        return cls(decoder, products)

    def __init__(self, decoder: "LeanDecoder", products: list[PanelLinear]) -> None:
        self.decoder = decoder
        self.is_int8 = products[0].is_int8
        self.kind = 1 if self.is_int8 else 2 if products[0].is_bf16 else 0  # WeightKind in panel_kernels.cpp
        self.max_rows = min(module.max_kernel_rows for module in products)
        # Longer passes (a prompt) as several calls of max_rows rows where the products run AMX tiles:
        # the 0.5B int8 draft's 150-token prompt in two calls instead of op by op through fbgemm; a
        # bfloat16 target's 140 / 250-token prompt 0.97 / 1.77 s against 1.25 / 2.45 s op by op through
        # PyTorch's bfloat16 products (README, Performance). So do bfloat16 products on the AVX2
        # kernels, where PyTorch's are emulated: a 150 / 400-token prompt 5.2 / 13.8 s against
        # 11.7 / 30.6 s (Zen 4 without AVX-512). Float32 passes keep the product --target-kernels auto timed.
        self.chunks_long_passes = (self.is_int8 and int8_uses_amx()) or (products[0].is_bf16 and (bf16_uses_amx() or bf16_widened()))
        intermediate = decoder.layers[0].down_proj.in_features
        first = decoder.layers[0]
        self.dims = (ctypes.c_int64 * 8)(
            len(decoder.layers), decoder.hidden_size, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim, intermediate, len(first.qkv), len(first.gate_up)
        )

        def pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
            return (ctypes.c_void_p * len(tensors))(*[None if tensor is None else tensor.data_ptr() for tensor in tensors])

        self.norm_weights = [weight.contiguous() for layer in decoder.layers for weight in (layer.input_norm, layer.post_attention_norm)]
        self.final_norm = decoder.norm.contiguous()
        self.weights = pointers([module.packed for module in products])
        self.scales = pointers([module.scale for module in products])
        self.colsums = pointers([module.colsum for module in products])
        self.biases = pointers([module.kernel_bias for module in products])
        self.norms = pointers(self.norm_weights)

    def __call__(
        self,
        hidden: torch.Tensor,  # [n, hidden] token embeddings, sequence by sequence (overwritten: the residual stream)
        sequences: list[list[LayerKVCache]],  # each sequence's per-layer caches
        rows: list[int],  # new tokens per sequence (summing to n)
        cos: torch.Tensor,  # [n, head_dim] each row's rotary angles
        sin: torch.Tensor,  # [n, head_dim]
        row_prefix: list[int] | None = None,  # [n] per row: -1 (a chain row), or a branch row's prefix length
        row_parent: list[int] | None = None,  # [n] per row: a branch row's parent branch row, or -1
    ) -> torch.Tensor:  # [n, hidden] top-layer features
        """One pass extending several sequences: the products run over all their rows at once, each
        row's attention reads its own sequence's cache (batched serving; one sequence: a decoding step).
        ``row_prefix``: a branch row (one sequence) sees positions 0..prefix-1, its ancestors along
        ``row_parent`` and itself (see :meth:`LeanLM.extend_branches`); None: every row is a chain row."""
        decoder = self.decoder
        starts = [caches[0].length for caches in sequences]
        for caches, count in zip(sequences, rows):  # the kernel writes the new keys/values in place: claim the positions first
            for cache in caches:
                cache.claim(count, decoder.num_kv_heads, decoder.head_dim)
        # Layer-major, as the kernel reads them: [layers][sequences] capacities, [layers][sequences][keys, values] buffers.
        layer_caches = [caches[layer] for layer in range(len(decoder.layers)) for caches in sequences]
        capacities = [cache.keys.shape[1] for cache in layer_caches]
        buffers = [buffer.data_ptr() for cache in layer_caches for buffer in (cache.keys, cache.values)]
        hidden = hidden.contiguous()
        cos, sin, out = cos.contiguous(), sin.contiguous(), torch.empty_like(hidden)
        int64s = lambda values: (ctypes.c_int64 * len(values))(*values)  # noqa: E731
        panel_library().verispec_lean_stack(
            self.dims, decoder.eps, self.kind, len(sequences), int64s(rows), int64s(starts), int64s(capacities),
            (ctypes.c_void_p * len(buffers))(*buffers), hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.weights, self.scales, self.colsums, self.biases, self.norms, self.final_norm.data_ptr(), out.data_ptr(),
            None if row_prefix is None else int64s(row_prefix), None if row_parent is None else int64s(row_parent), torch.get_num_threads(),
        )
        return out


_SHARED: "weakref.WeakKeyDictionary[nn.Module, dict[bool, LeanDecoder]]" = weakref.WeakKeyDictionary()


class LeanLM(CachedLM):
    """:class:`CachedLM` (same extend / crop / sync / release) running a :class:`LeanDecoder` on its own cache.

    ``prefixes``: a :class:`~verispec.engine.prefix_cache.PrefixCache` of this model: the sequence's
    first pass starts from the longest prefix stored there and stores what it computed, and
    :meth:`release` stores the whole sequence (a chat's next turn starts from it).
    ``row_exact`` (with ``prefixes``): every pass runs row-exact through the fused stack (see
    :meth:`LeanDecoder.forward`), so the logits do not depend on what was stored before — what a
    target needs. A drafter's LM may leave it off: its logits only decide what is proposed, and a
    cold prompt of several hundred tokens prefills ~15% faster op by op.
    """

    def __init__(
        self,
        model: nn.Module,
        decoder: LeanDecoder,
        lm_head: nn.Module | None = None,
        argmax_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prefixes: PrefixCache | None = None,
        row_exact: bool = True,
    ) -> None:
        if prefixes is not None and row_exact and decoder.fused is None:
            raise ValueError("an exact prefix cache needs the fused lean stack (panel kernels over every product of the model)")
        self.decoder = decoder
        self.prefixes = prefixes
        self.row_exact = row_exact and prefixes is not None
        # The features of the cached tokens, kept (and rolled back) only to store them with the keys/values.
        self.feature_log = RowLog() if prefixes is not None else None
        self.reused_tokens = 0  # positions the first pass restored instead of computing
        super().__init__(model, lm_head=lm_head, argmax_head=argmax_head)

    def _empty_cache(self) -> list[LayerKVCache]:
        return self.decoder.new_cache()

    def _run_body(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.prefixes is None:
            return self.decoder.forward(input_ids, self.cache)
        if self.cache[0].length == 0:  # a prompt: from the longest stored prefix
            compute = lambda ids: self.decoder.forward(torch.tensor(ids, dtype=torch.long), self.cache, self.row_exact)  # noqa: E731
            features, self.reused_tokens = start_sequence(self.prefixes, input_ids.tolist(), self.cache, self.feature_log, compute)
            return features
        features = self.decoder.forward(input_ids, self.cache, self.row_exact)  # [n, hidden]
        self.feature_log.append(features)
        return features

    def _drop_cached(self, num_tokens: int) -> None:
        for layer_cache in self.cache:
            layer_cache.crop(layer_cache.length - num_tokens)
        if self.feature_log is not None:
            self.feature_log.crop(self.feature_log.length - num_tokens)

    def log_features(self, features: torch.Tensor) -> None:
        """Record the features # [n, hidden] of tokens a caller fed through the decoder directly (batched drafting)."""
        if self.feature_log is not None:
            self.feature_log.append(features)

    @torch.inference_mode()
    def fill_for_timing(self, count: int, generator: torch.Generator) -> None:
        """Append ``count`` positions of random keys and values (token id 0) to an empty sequence,
        for timing only: what a pass's attention over them costs does not depend on their values, and
        a real prefill of a long context takes minutes (16K tokens: ~8 on 2 cores). Never decode
        from it: the positions are not the model's."""
        if len(self.token_ids) or self.prefixes is not None:
            raise ValueError("fill_for_timing needs an empty sequence without a prefix cache")
        for layer_cache in self.cache:
            keys, values = layer_cache.claim(count, self.decoder.num_kv_heads, self.decoder.head_dim)
            keys.normal_(generator=generator)
            values.normal_(generator=generator)
        self.token_ids.extend([0] * count)

    def release(self) -> None:
        if self.prefixes is not None:  # the whole sequence, before freeing it
            self.prefixes.keep(self.token_ids, self.cache, self.feature_log)
        super().release()
        if self.feature_log is not None:
            self.feature_log = RowLog()

    def max_branch_rows(self) -> int:
        return 0 if self.decoder.fused is None else self.decoder.fused.max_rows

    @torch.inference_mode()
    def extend_branches(self, new_ids: list[int], branches: list[Branch], argmax_only: bool = False) -> ForwardOutput:
        start = len(self.token_ids)
        checked_branches(len(new_ids), branches)
        row_prefix = [-1] * len(new_ids) + [start + index for index, _, _ in branches]
        parents = [parent for _, _, parent in branches]
        row_parent = [-1] * len(new_ids) + [-1 if parent < 0 else len(new_ids) + parent for parent in parents] if max(parents, default=-1) >= 0 else None
        input_ids = torch.tensor(new_ids + [token for _, token, _ in branches], dtype=torch.long)
        features = self.decoder.forward_branches(input_ids, self.cache, row_prefix, row_parent)  # [n, hidden]
        self.token_ids.extend(input_ids.tolist())
        self.log_features(features)
        return ForwardOutput(logits=self.logits(features, argmax_only), features=features)

    @torch.inference_mode()
    def keep_branch(self, branch_slot: int, position: int) -> None:
        if not 0 <= position < branch_slot < len(self.token_ids):
            raise ValueError(f"keep_branch needs position < branch_slot < {len(self.token_ids)}, got {position}, {branch_slot}")
        # The branch row's keys/values were computed at its position (rotary angles, attention): move them there.
        for layer_cache in self.cache:
            layer_cache.copy_row(branch_slot, position)
        if self.feature_log is not None:
            self.feature_log.rows[position] = self.feature_log.rows[branch_slot]
        self.token_ids[position] = self.token_ids[branch_slot]


@torch.inference_mode()
def next_logits_many(lms: list[CachedLM], new_ids: list[list[int]]) -> list[torch.Tensor]:
    """Each LM's next-token logits # [vocab] after appending its ``new_ids``: several sequences in one
    call of the fused stack where they are :class:`LeanLM` s on one fused decoder (one product over all
    their rows per weight, instead of one pass over the weights each), with one LM-head product when
    they share the head; otherwise one :meth:`~CachedLM.extend` each. Every row is computed as it is
    alone (the kernels' sums do not depend on the rows beside them), so the logits are the same."""
    first = lms[0]
    decoder = getattr(first, "decoder", None)
    # A first pass that may start from a stored prefix goes through its LM's own extend (a prompt: a
    # pass of its own anyway).
    starting = any(getattr(lm, "prefixes", None) is not None and not lm.token_ids for lm in lms)
    if starting or len(lms) == 1 or decoder is None or decoder.fused is None or any(getattr(lm, "decoder", None) is not decoder for lm in lms):
        return [lm.extend(ids, num_logits=1).logits[0] for lm, ids in zip(lms, new_ids)]
    if any(not ids for ids in new_ids):
        raise ValueError("next_logits_many needs at least one new token per sequence")
    features = decoder.forward_many(new_ids, [lm.cache for lm in lms], row_exact=any(getattr(lm, "row_exact", False) for lm in lms))
    for lm, ids, rows in zip(lms, new_ids, features):
        lm.token_ids.extend(ids)
        lm.log_features(rows)
    last = torch.stack([rows[-1] for rows in features])  # [n, hidden]
    if all(lm.lm_head is first.lm_head for lm in lms):
        return list(first.logits(last))
    return [lm.logits(row[None])[0] for lm, row in zip(lms, last)]
