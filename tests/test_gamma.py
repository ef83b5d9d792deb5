"""The adaptive gamma controller on simulated rounds, and adaptive decoding staying exact."""

import random

import pytest

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.drafters import CombinedDrafter, NgramDrafter
from verispec.engine.gamma import AdaptiveGamma


def _simulate(controller, rounds, acceptance, verify_cost, draft_cost, rng):
    """Feed the controller rounds drawn from an i.i.d. acceptance model; return chosen gammas."""
    chosen = []
    for _ in range(rounds):
        gamma = controller.choose()
        accepted = 0
        while accepted < gamma and rng.random() < acceptance:
            accepted += 1
        controller.observe(gamma, accepted, gamma * draft_cost, verify_cost(gamma + 1), gamma)
        chosen.append(gamma)
    return chosen


def cpu_like_verify(rows):
    """Costs shaped like the 1.5B target here: up to 3 rows nearly free, then a jump."""
    return 0.30 if rows <= 3 else 0.60 + 0.01 * rows


def test_high_acceptance_with_flat_verify_cost_drafts_the_maximum():
    controller = AdaptiveGamma(max_gamma=6)
    chosen = _simulate(controller, 200, 0.95, lambda rows: 0.3, 0.01, random.Random(0))
    assert sum(g == 6 for g in chosen[-50:]) >= 45


def test_verify_cost_jump_keeps_gamma_below_it():
    controller = AdaptiveGamma(max_gamma=6)
    chosen = _simulate(controller, 300, 0.8, cpu_like_verify, 0.12, random.Random(1))
    tail = chosen[-100:]
    assert max(set(tail), key=tail.count) == 2  # 3 rows: the largest pass that costs the same as 1


def test_collapse_switches_to_plain_and_probes_with_backoff():
    controller = AdaptiveGamma(max_gamma=4)
    rng = random.Random(2)
    _simulate(controller, 50, 0.9, cpu_like_verify, 0.12, rng)
    chosen = _simulate(controller, 300, 0.0, cpu_like_verify, 0.12, rng)  # adversarial text: nothing accepted
    tail = chosen[-200:]
    assert tail.count(0) >= 180  # mostly plain decoding
    probes = [i for i, g in enumerate(tail) if g > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps[-1] >= gaps[0] and max(gaps) >= 32  # the probe interval backs off


def test_recovery_after_collapse():
    controller = AdaptiveGamma(max_gamma=4)
    rng = random.Random(3)
    _simulate(controller, 100, 0.0, cpu_like_verify, 0.12, rng)
    chosen = _simulate(controller, 300, 0.95, cpu_like_verify, 0.12, rng)
    assert sum(g > 0 for g in chosen[-100:]) >= 95


def test_oscillating_acceptance_never_gets_stuck():
    controller = AdaptiveGamma(max_gamma=4)
    rng = random.Random(4)
    for phase in range(6):
        chosen = _simulate(controller, 120, 0.95 if phase % 2 == 0 else 0.0, cpu_like_verify, 0.12, rng)
        if phase % 2 == 0:
            assert sum(g > 0 for g in chosen[-40:]) >= 35
        else:
            assert chosen[-40:].count(0) >= 30


def test_bad_max_gamma():
    with pytest.raises(ValueError, match="max_gamma"):
        AdaptiveGamma(max_gamma=0)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=2)], ids=["greedy", "sampled"])
def test_adaptive_decoding_is_exact_and_within_bounds(sampling):
    target = tiny_target()
    drafter = DraftModel(noisy_copy(target, noise=0.2))
    decoder = SpeculativeDecoder(target, drafter, gamma=5, adaptive_gamma=True)
    plain = SpeculativeDecoder(target).generate([1, 2, 3], 60, sampling, stop=[])
    for _ in range(2):  # the second generation reuses the measured costs
        result = decoder.generate([1, 2, 3], 60, sampling, stop=[])
        assert all(0 <= d <= 5 for d in result.stats.drafted_per_round)
        assert all(1 <= n <= d + 1 for n, d in zip(result.stats.emitted_per_round, result.stats.drafted_per_round))
        if sampling.is_greedy:
            assert result.token_ids == plain.token_ids


def test_combined_drafter_uses_lookup_first_and_stays_exact():
    target = tiny_target()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    combined = CombinedDrafter(NgramDrafter(), DraftModel(noisy_copy(target, noise=0.2)))
    assert combined.name == "ngram+draft-model"
    result = SpeculativeDecoder(target, combined, gamma=4).generate(prompt, 40, stop=[])
    assert result.token_ids == SpeculativeDecoder(target).generate(prompt, 40, stop=[]).token_ids
    # Lookup rounds cost no drafter pass; model rounds cost one per draft token.
    assert result.stats.draft_calls < result.stats.num_drafted


@pytest.mark.parametrize("spiked_pass", [0, 1])  # the plain pass that measures the baseline, the first draft round's
def test_one_timing_spike_does_not_keep_a_collapsed_text_drafting(spiked_pass):
    controller = AdaptiveGamma(max_gamma=4)
    passes = iter(range(10**6))

    def verify(rows):  # one pass hit by a 100x pause (GC, another thread holding the GIL), then never again
        return 0.3 * (100.0 if next(passes) == spiked_pass else 1.0)

    chosen = _simulate(controller, 48, 0.0, verify, 0.05, random.Random(4))
    assert chosen[0] == 0  # the first round measures plain decoding's cost
    calm = _simulate(AdaptiveGamma(max_gamma=4), 48, 0.0, lambda rows: 0.3, 0.05, random.Random(4))
    assert sum(1 for gamma in chosen if gamma) <= sum(1 for gamma in calm if gamma) + 2, (chosen, calm)
