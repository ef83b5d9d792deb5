"""Tiny causal LMs built from a config inside the tests: no downloads, seconds to run."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode


def tiny_config(vocab_size: int = 96, layers: int = 2, hidden_size: int = 32, intermediate_size: int = 64) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def tiny_target(seed: int = 0, vocab_size: int = 96, sharpness: float = 8.0) -> Qwen2ForCausalLM:
    """A random tiny LM whose next-token distributions are peaked enough for drafts to be accepted.

    Random weights give nearly flat logits; scaling the LM head makes argmaxes stable (no
    near-ties between batched and single-token passes) and sampled distributions interesting.
    """
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(vocab_size)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None
    return model.requires_grad_(False)


def noisy_copy(model: Qwen2ForCausalLM, noise: float, seed: int = 1) -> Qwen2ForCausalLM:
    """A drafter that mostly agrees with ``model``: its weights plus Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    copy = Qwen2ForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    copy.generation_config.eos_token_id = None
    return copy.requires_grad_(False)


def anti_copy(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    """A drafter whose logits are the target's negated: its top-k is the target's bottom-k."""
    copy = Qwen2ForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        copy.lm_head.weight.neg_()
    copy.generation_config.eos_token_id = None
    return copy.requires_grad_(False)


# A real-layout GGUF (tokenizer, chat template, quantised weights), for loading and CLI tests.

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen2_gguf(path: Path) -> None:
    """A 45 kB Qwen2 GGUF laid out like the real ones: byte-level BPE tokenizer with a chat
    template and control tokens, untied output matrix, Q8_0 weights (so conversion really
    dequantises) next to F32 norms and biases."""
    rng = np.random.default_rng(0)
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + SPECIALS
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    kv = kv_heads * hidden // heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS))  # 3 = control
    w.add_token_merges(MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a)

    tensor("token_embd.weight", vocab, hidden)
    tensor("output.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    for i in range(layers):
        for name, shape in [("attn_norm.weight", (hidden,)), ("ffn_norm.weight", (hidden,)),
                            ("attn_q.weight", (hidden, hidden)), ("attn_q.bias", (hidden,)),
                            ("attn_k.weight", (kv, hidden)), ("attn_k.bias", (kv,)),
                            ("attn_v.weight", (kv, hidden)), ("attn_v.bias", (kv,)),
                            ("attn_output.weight", (hidden, hidden)), ("ffn_gate.weight", (inter, hidden)),
                            ("ffn_up.weight", (inter, hidden)), ("ffn_down.weight", (hidden, inter))]:
            tensor(f"blk.{i}.{name}", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
