"""Grouped-query attention without copying the cache: same logits, no repeat_kv on masked passes."""

import torch
from transformers.integrations import sdpa_attention

from tiny_models import tiny_target
from verispec.engine.cached_lm import CachedLM
from verispec.models.gqa_attention import GQA_SDPA, use_gqa_attention


def _passes(model):
    lm = CachedLM(model)
    ids = list(range(3, 40))
    prefill = lm.extend(ids[:30], num_logits=30).logits  # [30, vocab]
    block = lm.extend(ids[30:36], num_logits=6).logits  # [6, vocab]: a verification-like pass after a cache
    lm.crop(33)
    step = lm.extend([7], num_logits=1).logits  # [1, vocab]
    return prefill, block, step


def test_logits_identical_and_the_cache_is_not_expanded(monkeypatch):
    target = tiny_target()
    assert target.config.num_attention_heads > target.config.num_key_value_heads  # a GQA model
    reference = _passes(target)
    use_gqa_attention(target)
    assert target.config._attn_implementation == GQA_SDPA
    expanded = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: expanded.append(1) or original(*args))
    for ours, theirs in zip(_passes(target), reference):
        assert torch.equal(ours, theirs)
    assert expanded == []  # transformers' SDPA would expand keys/values for the masked 6-token pass


def test_applies_only_to_sdpa_models():
    target = tiny_target()
    target.set_attn_implementation("eager")
    use_gqa_attention(target)
    assert target.config._attn_implementation == "eager"
