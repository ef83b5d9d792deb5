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


def test_half_precision_attends_in_float32():
    # bfloat16 on the CPU: attention in float32 (PyTorch's bfloat16 SDPA is ~5x slower for one query
    # row), the output rounded back once. Same as the float32 computation on the upcast inputs.
    torch.manual_seed(0)
    target = use_gqa_attention(tiny_target().bfloat16())
    module = target.model.layers[0].self_attn
    from verispec.models.gqa_attention import gqa_sdpa_attention

    query = torch.randn(1, 4, 3, 8, dtype=torch.bfloat16)
    key, value = torch.randn(2, 1, 2, 10, 8, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool).tril(diagonal=7)
    output, _ = gqa_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    expected, _ = gqa_sdpa_attention(module, query.float(), key.float(), value.float(), mask, scaling=0.3)
    assert output.dtype == torch.bfloat16
    assert torch.equal(output, expected.bfloat16())
    logits = CachedLM(target).extend(list(range(3, 20)), num_logits=2).logits
    assert bool(torch.isfinite(logits).all())  # CachedLM hands logits over as float32
