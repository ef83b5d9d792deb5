"""The lean forward (our own decoder loop over the model's modules) against the model's transformers forward."""


from __future__ import annotations

import copy

import pytest
import torch
from marks import needs_kernels
from tiny_models import noisy_copy, tiny_target
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from verispec.drafters import DraftModel
from verispec.engine import SpeculativeDecoder
from verispec.engine.cached_lm import CachedLM
from verispec.engine.lean_lm import LeanDecoder, LeanLM, _FusedStack, lean_unsupported_reason, target_lm
from verispec.models import quantize_int8
from verispec.models.panel_linear import bf16_kernels_available, panel_kernels_unavailable_reason, use_panel_kernels
from verispec.models.quantize import stacked_linear
from verispec.sampling import SamplingParams

# torch.ao quantisation is deprecated in the pinned torch (still supported): keep its warnings out of the report.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tiny_llama(**overrides) -> LlamaForCausalLM:  # noqa: ANN003 - config fields
    torch.manual_seed(2)
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rope_theta=500.0)
    config = LlamaConfig(**{**fields, **overrides})
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(8.0)
    return model


def replay(lm: CachedLM) -> list[torch.Tensor]:
    """Logits of a fixed sequence of extends and rollbacks: prefill, single steps, a block, crops."""
    out = [lm.extend(list(range(3, 14)), num_logits=3).logits]
    out.append(lm.extend([20], num_logits=1).logits)
    out.append(lm.extend([21, 22, 23, 24], num_logits=4).logits)
    lm.crop(len(lm) - 3)  # drop three "rejected drafts"
    out.append(lm.extend([30, 31], num_logits=2).logits)
    pending = lm.sync(lm.token_ids[:9] + [40, 41])  # rollback to a common prefix, as a draft session does
    out.append(lm.extend(pending, num_logits=len(pending)).logits)
    lm.release()
    out.append(lm.extend([5, 6, 7], num_logits=3).logits)  # usable again after release
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_lean_forward_matches_the_models_own_through_extends_and_rollbacks(family, int8):
    model = tiny_target() if family == "qwen2" else tiny_llama()
    model = quantize_int8(model) if int8 else model
    expected = replay(CachedLM(model))
    # int8 compares with fbgemm's kernels, as the model's own forward runs: our panel kernels keep
    # activations in float32 (tests/test_panel_linear.py checks them against a float64 reference).
    got = replay(LeanLM(model, LeanDecoder(model, panel_kernels=not int8)))
    for step, (want, have) in enumerate(zip(expected, got)):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_stacked_linear_equals_the_separate_layers():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, n, bias=bias) for n, bias in ((8, True), (4, False), (4, True))]
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(stacked_linear(layers)(x), torch.cat([layer(x) for layer in layers], -1))
        # int8: per-row and per-tensor source scales both kept exactly (same int8 rows, same scales).
        per_row = [quantize_int8(torch.nn.Sequential(copy.deepcopy(layer)))[0] for layer in layers]
        per_tensor = [torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(copy.deepcopy(layer)), {torch.nn.Linear}, dtype=torch.qint8)[0] for layer in layers]
        for quantized in (per_row, per_tensor):
            stacked = stacked_linear(quantized)
            assert torch.equal(stacked.weight().int_repr(), torch.cat([q.weight().int_repr() for q in quantized]))
            torch.testing.assert_close(stacked(x), torch.cat([q(x) for q in quantized], -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="mix int8 and float"):
        stacked_linear([per_row[0], layers[1]])
    with pytest.raises(ValueError, match="same input width"):
        stacked_linear([layers[0], torch.nn.Linear(8, 4)])


def test_draft_model_uses_the_lean_forward_and_decoding_stays_exact():
    target = tiny_target()
    draft = quantize_int8(noisy_copy(target, noise=0.1))
    # fbgemm's kernels on both sides (the panel kernels may quantise activations per row, where the
    # CPU has 8-bit dot products, so their drafts can differ in rounding: exactness is checked below).
    lean, framework = DraftModel(draft, panel_kernels=False), DraftModel(draft, lean=False)
    assert lean.lean_decoder is not None and framework.lean_decoder is None
    assert DraftModel(draft, panel_kernels=False).lean_decoder is lean.lean_decoder  # stacked weights built once per model
    prompt = [6, 1, 7, 3]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=4)):
        results = [SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, 40, sampling, stop=[]) for drafter in (lean, framework)]
        # Same drafts (the lean forward computes what the model does), so the same rounds and output.
        assert results[0].token_ids == results[1].token_ids
        assert results[0].stats.num_accepted == results[1].stats.num_accepted > 0
    plain = SpeculativeDecoder(target).generate(prompt, 40, stop=[]).token_ids
    for drafter in (lean, DraftModel(draft)):  # the default: panel kernels where they run
        assert SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, 40, stop=[]).token_ids == plain


def test_models_the_lean_forward_cannot_run_fall_back_or_are_refused_by_name():
    scaled = tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    assert "rope type 'linear'" in lean_unsupported_reason(scaled)
    torch.manual_seed(0)
    sliding = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8)).eval()
    assert "sliding-window" in lean_unsupported_reason(sliding)
    assert "dtype torch.float16" in lean_unsupported_reason(tiny_target().to(torch.float16))
    bf16 = lean_unsupported_reason(tiny_target().to(torch.bfloat16))  # runs where the AVX512-BF16 kernels do
    assert bf16 is None if panel_kernels_unavailable_reason() is None and bf16_kernels_available() else "dtype torch.bfloat16" in bf16
    assert lean_unsupported_reason(tiny_target()) is None
    assert DraftModel(scaled).lean_decoder is None  # default: the model's own forward
    with pytest.raises(ValueError, match="rope type 'linear'"):
        DraftModel(scaled, lean=True)
    with pytest.raises(ValueError, match="lean must be"):
        DraftModel(tiny_target(), lean="yes")


def test_shared_decoder_is_rebuilt_after_the_model_is_quantised_in_place():
    model = noisy_copy(tiny_target(), noise=0.1)
    before = LeanDecoder.shared(model)
    assert LeanDecoder.shared(model) is before
    quantize_int8(model)
    after = LeanDecoder.shared(model)
    assert after is not before and after.source_o_proj is model.model.layers[0].self_attn.o_proj


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_one_call_stack_step_matches_the_op_by_op_forward(family, monkeypatch):
    # The kernel library's whole-stack step (verispec_lean_stack) against the same decoder run op by
    # op, int8 as the draft runs (float32 is checked against the model's own forward above).
    model = quantize_int8(tiny_target() if family == "qwen2" else tiny_llama())
    fused, op_by_op = LeanDecoder(model), LeanDecoder(model)
    op_by_op.fused = None
    assert fused.fused is not None and fused.fused.max_rows == fused.layers[0].qkv[0].max_kernel_rows
    calls = []
    real_call = _FusedStack.__call__
    monkeypatch.setattr(_FusedStack, "__call__", lambda self, *args: calls.append(len(args[0])) or real_call(self, *args))
    for want, have in zip(replay(LeanLM(model, op_by_op)), replay(LeanLM(model, fused))):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    assert calls and max(calls) <= fused.fused.max_rows  # the few-row steps went through it; wider blocks did not


@needs_kernels
def test_one_call_stack_step_grows_the_kv_buffers_it_writes():
    # Past the first 256 positions the caches are reallocated between calls; keys written by the
    # kernel before must survive the move (float32: compared with the model's own forward).
    model = tiny_llama()
    decoder = LeanDecoder(model)
    assert decoder.fused is not None and decoder.fused.max_rows == 128
    lean, reference = LeanLM(model, decoder), CachedLM(model)
    ids = [int(token) for token in torch.randint(3, 90, (300,), generator=torch.Generator().manual_seed(0))]
    for lm in (lean, reference):
        lm.extend(ids[:250], num_logits=1)
    for position in range(250, 300, 10):
        block = ids[position : position + 10]
        torch.testing.assert_close(lean.extend(block, num_logits=10).logits, reference.extend(block, num_logits=10).logits, atol=1e-4, rtol=1e-4)
    assert lean.cache[0].keys.shape[1] == 512 and lean.cache[0].length == 300


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-head-dim-128"])
def test_a_target_on_the_panel_kernels_runs_one_call_passes_over_its_own_packed_weights(family):
    # use_panel_kernels swaps the target's own linears; target_lm then runs them as one kernel call
    # per pass (q, k, v and gate, up as separate parts: no stacked copy) and matches the model's
    # transformers forward through extends and rollbacks. Head size 128 as in Qwen2.5-1.5B: the
    # kernel's attention must not assume the draft's 64.
    model = {"qwen2": tiny_target, "llama": tiny_llama, "llama-head-dim-128": lambda: tiny_llama(head_dim=128, num_attention_heads=2)}[family]()
    expected = replay(CachedLM(model))
    assert type(target_lm(model)) is CachedLM  # plain float32 linears: transformers' forward
    use_panel_kernels(model)
    lm = target_lm(model)
    assert isinstance(lm, LeanLM) and lm.decoder.fused is not None
    layer, source = lm.decoder.layers[0], model.model.layers[0]
    assert layer.qkv == [source.self_attn.q_proj, source.self_attn.k_proj, source.self_attn.v_proj]
    assert layer.gate_up == [source.mlp.gate_proj, source.mlp.up_proj]
    assert list(lm.decoder.fused.dims)[6:] == [3, 2]
    for step, (want, have) in enumerate(zip(expected, replay(lm))):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@needs_kernels
def test_a_panel_target_verifies_rows_exactly_as_one_token_steps_compute_them():
    # On the panel kernels (AVX-512 or AVX2) every row of a pass is the same sequence of operations as
    # a 1-token pass: the logits of a 6-token verification pass equal, bit for bit, those of 6 single steps.
    model = use_panel_kernels(tiny_target())
    together, one_by_one = target_lm(model), target_lm(model)
    prompt = list(range(3, 20))
    for lm in (together, one_by_one):
        lm.extend(prompt, num_logits=1)
    block = [40, 41, 42, 43, 44, 45]
    batched = together.extend(block, num_logits=len(block)).logits
    single = torch.cat([one_by_one.extend([token], num_logits=1).logits for token in block])
    assert torch.equal(batched, single)


@needs_kernels
def test_speculative_decoding_of_a_panel_target_equals_its_plain_decoding():
    target = use_panel_kernels(tiny_target())
    draft = noisy_copy(tiny_target(), noise=0.02)
    prompt = list(range(3, 12))
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40, stop=[])
    speculative = SpeculativeDecoder(target, DraftModel(draft), gamma=4).generate(prompt, max_new_tokens=40, stop=[])
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.target_calls < plain.stats.target_calls


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_long_context_attention_gives_each_row_what_a_one_token_step_gives(head_dim):
    # The kernel's attention walks the cache in blocks shared by every row and query head of a kv
    # group (AVX-512: head sizes 64 and 128 keep a head in registers, others take the general loop;
    # AVX2: value sums 64 columns at a time in registers, then 8 at a time: 80 takes both; and a
    # kv group's tasks in tiles of three, here across rows, against one task at a time in the single
    # steps, whose kv groups have two). After a 150-token prompt (several blocks, not a multiple of
    # four) a 7-row pass must give, bit for bit, what 7 single steps give, and match the model's own
    # forward.
    model = use_panel_kernels(tiny_llama(head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2))
    together, one_by_one, reference = target_lm(model), target_lm(model), CachedLM(model)
    prompt = [int(token) for token in torch.randint(3, 90, (150,), generator=torch.Generator().manual_seed(1))]
    for lm in (together, one_by_one, reference):
        lm.extend(prompt, num_logits=1)
    block = [40, 41, 42, 43, 44, 45, 46]
    batched = together.extend(block, num_logits=len(block)).logits
    assert torch.equal(batched, torch.cat([one_by_one.extend([token], num_logits=1).logits for token in block]))
    torch.testing.assert_close(batched, reference.extend(block, num_logits=len(block)).logits, atol=1e-4, rtol=1e-4)
