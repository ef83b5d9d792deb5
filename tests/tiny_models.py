"""Tiny causal LMs built from a config inside the tests: no downloads, seconds to run."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_config(vocab_size: int = 96, layers: int = 2) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
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
