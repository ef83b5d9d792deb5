"""The int8-screened greedy LM head: the full head's argmax, bit-exact logits where it matters, full fallbacks."""

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.bench.methods import parse_variant
from verispec.engine.cached_lm import CachedLM
from verispec.engine.lean_lm import target_lm
from verispec.models import quantize_int8
from verispec.models import screened_head
from verispec.models.panel_linear import PanelLinear, int8_uses_vnni, panel_kernels_unavailable_reason, use_panel_kernels
from verispec.models.screened_head import ScreenedArgmaxHead
from verispec.serving.batch_cache import BatchedTarget

pytestmark = pytest.mark.skipif(panel_kernels_unavailable_reason() is not None, reason=f"panel kernels: {panel_kernels_unavailable_reason()}")


def peaked_head(vocab: int = 20000, hidden: int = 192, bias: bool = False, seed: int = 0) -> PanelLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(hidden, vocab, bias=bias).requires_grad_(False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return PanelLinear(linear)


def features_near(head: PanelLinear, tokens: list[int], noise: float = 0.3) -> torch.Tensor:
    """Features pointing at ``tokens`` (so each row has a clear argmax), plus noise and an outlier."""
    generator = torch.Generator().manual_seed(len(tokens))
    rows = head.weight.detach()[tokens] * 40 + noise * torch.randn(len(tokens), head.in_features, generator=generator)
    rows[:, 3] += 25.0  # a large activation: coarse 8-bit steps on the VNNI path
    return rows.contiguous()


def assert_same_argmax_and_exact_values(screen: ScreenedArgmaxHead, features: torch.Tensor) -> torch.Tensor:
    full = screen.head(features)
    screened = screen(features)
    assert screened.shape == full.shape
    assert torch.equal(screened.argmax(-1), full.argmax(-1))
    finite = torch.isfinite(screened)
    assert torch.equal(screened[finite], full[finite])  # bit for bit the float32 head's values
    assert bool(torch.isneginf(screened[~finite]).all())
    return screened


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_screened_argmax_is_the_full_heads_and_skips_most_logits(rows, bias):
    head = peaked_head(bias=bias)
    screen = ScreenedArgmaxHead(head)
    tokens = [(37 * i + 11) % head.out_features for i in range(rows)]
    screened = assert_same_argmax_and_exact_values(screen, features_near(head, tokens))
    assert screened.argmax(-1).tolist() == tokens
    if screen.vnni:  # 8-bit activations (VNNI CPUs): the huge entry's channel left them
        assert 3 in screen.float32_channels
    else:  # float activations against int8 weights: no channel needs keeping out
        assert screen.float32_channels == []
    # The screen did its job: most logits were never computed in float32.
    assert int(torch.isfinite(screened).sum()) < rows * head.out_features // 4


@pytest.mark.parametrize("rows", [1, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_every_logit_lies_within_its_bound_of_the_int8_approximation(rows, bias):
    # The screen's soundness, over every logit (not only the argmax): |l_v - A_v| <= B_v, for
    # features with a large outlier (coarse 8-bit activation steps) and plain random ones.
    head = peaked_head(bias=bias, seed=rows)
    screen = ScreenedArgmaxHead(head)
    generator = torch.Generator().manual_seed(rows)
    for features in (features_near(head, list(range(rows))), 3 * torch.randn(rows, head.in_features, generator=generator)):
        approx, bound = screen.logit_bounds(features)
        error = (head(features).double() - approx.double()).abs()
        assert bool((error <= bound).all())
        assert float(error.max()) > 0.05 * float(bound.min())  # and not vacuously loose


def test_exact_and_near_ties_resolve_as_the_full_head_does():
    weight = peaked_head().weight.detach().clone()
    weight[901] = weight[900]  # an exact tie: argmax takes the lower index
    weight[1501] = weight[1500] * (1 + 1e-7)  # a near-tie far inside the int8 error
    head = PanelLinear(_linear_of(weight))
    screen = ScreenedArgmaxHead(head)
    features = features_near(head, [901, 900, 1501, 1500])
    screened = assert_same_argmax_and_exact_values(screen, features)
    assert screened.argmax(-1)[:2].tolist() == [900, 900]
    assert set(screened.argmax(-1)[2:].tolist()) <= {1500, 1501}


def _linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_unsure_rows_too_many_rows_and_bad_features_fall_back_to_the_full_head():
    weight = peaked_head().weight.detach().clone()
    weight[:5000] = weight[0] + 1e-4 * torch.randn(5000, weight.shape[1])  # a quarter of the vocabulary within the screen's error
    head = PanelLinear(_linear_of(weight))
    screen = ScreenedArgmaxHead(head)
    unsure = features_near(head, [0, 1, 2])  # survivors in half the panels: the full head is cheaper
    assert torch.equal(screen(unsure), head(unsure))
    many = features_near(head, list(range(head.max_kernel_rows + 1)))  # beyond the panel kernel
    assert torch.equal(screen(many), head(many))
    broken = features_near(head, [5, 6])
    broken[1, 0] = float("nan")
    assert torch.equal(screen(broken).isnan(), head(broken).isnan())


def test_only_float32_panel_heads_are_screened():
    linear = torch.nn.Linear(64, 300).requires_grad_(False)
    assert ScreenedArgmaxHead.for_head(linear) is None
    assert ScreenedArgmaxHead.for_head(PanelLinear(quantize_int8(torch.nn.Sequential(linear))[0])) is None
    head = PanelLinear(linear)
    assert ScreenedArgmaxHead.for_head(head) is ScreenedArgmaxHead.for_head(head)  # built once per head
    with pytest.raises(ValueError, match="float32 PanelLinear"):
        ScreenedArgmaxHead(linear)


def panel_target(vocab_size: int = 8192):
    return use_panel_kernels(tiny_target(vocab_size=vocab_size))


def test_greedy_decoding_is_unchanged_and_uses_the_screen(monkeypatch):
    target = panel_target()
    prompt = [1, 2, 3]
    full = SpeculativeDecoder(target, DraftModel(noisy_copy(target, 0.3)), gamma=5, screen_lm_head=False).generate(prompt, 48, stop=[])
    calls = []  # (rows, whether logits were skipped) per call
    original = ScreenedArgmaxHead.__call__

    def counted(self, features):
        logits = original(self, features)
        calls.append((len(features), bool(torch.isneginf(logits).any())))
        return logits

    monkeypatch.setattr(ScreenedArgmaxHead, "__call__", counted)
    plain = SpeculativeDecoder(target).generate(prompt, 48, stop=[])
    speculative = SpeculativeDecoder(target, DraftModel(noisy_copy(target, 0.3)), gamma=5).generate(prompt, 48, stop=[])
    assert plain.token_ids == speculative.token_ids == full.token_ids
    # Plain steps and multi-row verification passes went through it, and it skipped logits in both.
    assert any(rows == 1 and skipped for rows, skipped in calls) and any(rows > 1 and skipped for rows, skipped in calls)
    assert sum(speculative.stats.accepted_per_round) > 0
    calls.clear()
    SpeculativeDecoder(target).generate(prompt, 8, SamplingParams(temperature=0.7, seed=0), stop=[])
    assert not calls  # sampling needs every probability: the full head


def test_the_screen_is_built_for_panel_targets_only_and_never_for_capped_logits():
    target = panel_target()
    assert isinstance(target_lm(target).argmax_head, ScreenedArgmaxHead)
    assert target_lm(target, screen_lm_head=False).argmax_head is None
    assert target_lm(tiny_target(vocab_size=8192)).argmax_head is None  # PyTorch's kernels: nothing to screen
    capped = panel_target()
    capped.config.final_logit_softcapping = 30.0  # saturating caps can tie distinct logits
    assert CachedLM(capped, argmax_head=ScreenedArgmaxHead.for_head(capped.lm_head)).argmax_head is None
    with pytest.raises(ValueError, match="screen_lm_head must be True or False"):
        SpeculativeDecoder(target, screen_lm_head="yes")


def test_batched_serving_passes_take_the_screen_only_when_every_row_is_greedy():
    target = panel_target()
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outputs = {}
    for screen in (True, False):
        batch = BatchedTarget(target, screen_lm_head=screen)
        for prompt in prompts:
            batch.add(prompt)
        outputs[screen] = batch.extend([[4, 9, 10], [7, 11]], [3, 2], argmax_only=True)
    for screened, full in zip(outputs[True], outputs[False]):
        assert torch.equal(screened.logits.argmax(-1), full.logits.argmax(-1))
        assert torch.equal(screened.features, full.features)
    assert any(bool(torch.isneginf(output.logits).any()) for output in outputs[True])
    assert not any(bool(torch.isneginf(output.logits).any()) for output in outputs[False])


def test_bench_methods_take_a_screen_setting():
    assert parse_variant("plain:screen=0").screen == 0
    assert parse_variant("ngram+draft-adaptive:gamma=16:screen=1").screen == 1
    with pytest.raises(ValueError, match="screen out of range"):
        parse_variant("plain:screen=2")
    with pytest.raises(ValueError, match="screen applies to our methods only"):
        parse_variant("hf-plain:screen=1")


@pytest.mark.skipif(not int8_uses_vnni(), reason="8-bit activations only on the VNNI path")
def test_the_bound_needs_its_8bit_activation_term(monkeypatch):
    # Weights exactly on their int8 grid (every row's scale is 2^-10): the weight-rounding term is
    # ~0, so what separates the float32 logits from the approximation is the 8-bit rounding of the
    # activations. The bound holds with its activation term and fails without it.
    generator = torch.Generator().manual_seed(0)
    integers = torch.randint(-127, 128, (4096, 192), generator=generator).float()
    integers[:, 0] = 127
    head = PanelLinear(_linear_of(integers * 2.0**-10))
    screen = ScreenedArgmaxHead(head)
    features = torch.randn(8, 192, generator=generator)
    error = (head(features).double() - screen.logit_bounds(features)[0].double()).abs()
    assert bool((error <= screen.logit_bounds(features)[1]).all())
    monkeypatch.setattr(screened_head, "_activation_error", lambda main: torch.zeros(main.shape[0], 1, dtype=torch.float64))
    assert not bool((error <= screen.logit_bounds(features)[1]).all())


def test_costs_time_greedy_passes_through_the_screen_on_real_text(monkeypatch):
    from verispec.bench.costs import forward_costs

    target = use_panel_kernels(tiny_target())
    calls = []
    original = ScreenedArgmaxHead.__call__
    monkeypatch.setattr(ScreenedArgmaxHead, "__call__", lambda self, features: calls.append(features.shape[0]) or original(self, features))
    text = [(5 * i + 3) % 50 for i in range(40)]
    forward_costs(target, 16, [1, 4], repeats=2, text_ids=text)
    assert calls == []  # the full head: every logit
    costs = forward_costs(target, 16, [1, 4], repeats=2, text_ids=text, argmax_only=True)
    assert [c.new_tokens for c in costs] == [1, 4] and calls == [1] + [1, 1] + [4, 4]  # warm-up, then each pass
    with pytest.raises(ValueError, match="text_ids holds 19 tokens"):
        forward_costs(target, 16, [1, 4], text_ids=text[:19])
