"""The adaptive gamma controller on simulated rounds, and adaptive decoding staying exact."""

import functools
import random
import statistics

import pytest

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.drafters import CombinedDrafter, NgramDrafter
from verispec.engine.gamma import AdaptiveGamma, StepCosts


def _simulate(controller, rounds, acceptance, verify_cost, draft_cost, rng):
    """Feed the controller simulated rounds; return the chosen gammas.

    acceptance: a per-draft probability (i.i.d.) or a function (gamma, rng) -> accepted drafts;
    draft_cost: seconds per draft, or a function gamma -> seconds of a round's drafting.
    """
    accepted_drafts = acceptance if callable(acceptance) else functools.partial(_iid_accepted, acceptance)
    drafting = draft_cost if callable(draft_cost) else (lambda gamma: gamma * draft_cost)
    chosen = []
    for _ in range(rounds):
        gamma = controller.choose()
        accepted = min(accepted_drafts(gamma, rng), gamma)
        controller.observe(gamma, accepted, drafting(gamma), verify_cost(gamma + 1), gamma)
        chosen.append(gamma)
    return chosen


def _iid_accepted(rate, gamma, rng):
    accepted = 0
    while accepted < gamma and rng.random() < rate:
        accepted += 1
    return accepted


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


def measured_verify(rows):
    """The built-in 1.5B target here (seconds per pass over ``rows`` new tokens, 2 threads)."""
    return {1: 0.350, 2: 0.351, 3: 0.403, 4: 0.456, 5: 0.467, 6: 0.485}.get(rows, 0.53)


def test_bursty_acceptance_keeps_drafting_long():
    """Code-like text: a round's first draft is the risk; once it is accepted the line usually is.

    Here drafting 6 pays ~15% more than drafting 2 (4.6 vs 2.3 tokens a round). A controller with
    one i.i.d. acceptance rate reads every rejection as "all drafts are 0.88-likely" and keeps
    choosing 2-3; per-position estimates see that only draft 1 is uncertain.
    """

    def bursty(gamma, rng):
        if gamma == 0 or rng.random() >= 0.65:  # the first draft: the risk
            return 0
        return 1 + _iid_accepted(0.97, gamma - 1, rng)  # a predictable stretch

    chosen = _simulate(AdaptiveGamma(max_gamma=6), 300, bursty, measured_verify, 0.072, random.Random(5))
    drafting = [gamma for gamma in chosen[-150:] if gamma]  # (plain stretches: h_1 = 0.65 dips now and then)
    assert sum(gamma >= 5 for gamma in drafting) >= 0.75 * len(drafting), drafting


def test_draft_cost_fit_separates_the_per_round_cost_from_the_per_draft_cost():
    costs = StepCosts()
    rng = random.Random(6)
    for _ in range(60):
        drafted = rng.randint(1, 6)  # what a controller's varying gamma produces
        costs.observe(drafted + 1, 0.3, 0.06 + 0.05 * drafted + rng.uniform(-0.002, 0.002), drafted)
    assert costs.draft_base_s == pytest.approx(0.06, abs=0.01) and costs.draft_step_s == pytest.approx(0.05, abs=0.003)
    assert costs.draft_cost(0) == 0.0 and costs.draft_cost(4) == pytest.approx(0.26, abs=0.01)
    same = StepCosts()
    for _ in range(10):  # one gamma only: slope and intercept are not separable, charge per draft
        same.observe(5, 0.3, 0.3, 4)
    assert same.draft_base_s == pytest.approx(0.0) and same.draft_step_s == pytest.approx(0.075)
    block = StepCosts()
    for drafted in [1, 5, 3, 5, 2, 4] * 5:  # a block drafter: one pass whatever gamma
        block.observe(drafted + 1, 0.3, 0.02, drafted)
    assert block.draft_step_s == pytest.approx(0.0, abs=1e-9) and block.draft_base_s == pytest.approx(0.02)


def test_per_round_draft_cost_favours_longer_rounds():
    """The same acceptance and mean cost per draft, but most of it paid once per round: draft longer."""
    chosen = {}
    for base in (0.0, 0.15):
        drafting = functools.partial(lambda base, gamma: base + 0.06 * gamma if gamma else 0.0, base)
        gammas = _simulate(AdaptiveGamma(max_gamma=6), 400, 0.75, measured_verify, drafting, random.Random(7))
        chosen[base] = statistics.median(gamma for gamma in gammas[-200:] if gamma)
    # Best by the true costs at acceptance 0.75: gamma 2 without a per-round cost, 4 with it.
    assert chosen[0.0] <= 2 and chosen[0.15] >= 4, chosen


def test_slow_start_risks_few_drafts_until_the_text_has_been_drafted():
    costs = StepCosts(draft_step_s=0.05, verify_s={1: 0.3})
    controller = AdaptiveGamma(max_gamma=6, costs=costs)
    assert controller.choose() == 2  # the optimistic prior alone would pick more (checked below)
    assert AdaptiveGamma(max_gamma=6, costs=costs, first_max_drafts=6).choose() > 2
    controller.observe(2, 2, 0.1, 0.3, 2)  # all accepted: the limit doubles
    assert controller.choose() == 4
    controller.observe(4, 4, 0.2, 0.3, 4)
    assert controller.choose() > 4  # the limit (8) is past max_gamma: the cost model decides
    controller.start_sequence()  # a new text starts small again
    assert controller.choose() == 2
    rejecting = AdaptiveGamma(max_gamma=6, costs=StepCosts(draft_step_s=0.05, verify_s={1: 0.3}))
    drafted = _simulate(rejecting, 20, 0.0, measured_verify, 0.05, random.Random(8))
    assert max(drafted) <= 2 and sum(drafted) <= 8, drafted  # adversarial text: few drafts wasted
    with pytest.raises(ValueError, match="first_max_drafts"):
        AdaptiveGamma(max_gamma=4, first_max_drafts=0)


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


def test_one_slow_pass_does_not_price_longer_rounds_off_for_good():
    """A spike on the first pass over some row count (a warm-up page fault) must not stop the
    controller from ever drafting past it: never chosen again, that count would never be re-measured."""
    costs = StepCosts(draft_step_s=0.02, verify_s={1: 0.15, 2: 0.16})
    costs.observe(3, 3.0, 0.04, 2)  # 20x the real cost of 3 rows, on the count's first pass
    assert costs.verify_cost(3) == pytest.approx(0.16)  # passed once: unconfirmed, priced as 2 rows
    costs.observe(3, 0.17, 0.04, 2)  # the second pass decides: the smaller of the two
    assert costs.verify_cost(3) == pytest.approx(0.17)
    costs.observe(3, 3.0, 0.04, 2)  # a later spike: cut to the split bound, then one moving-average step
    assert costs.verify_cost(3) == pytest.approx(0.17 + 0.15 * (2 * 0.17 - 0.17))
    costs.observe(4, 3.0, 0.04, 2)
    costs.observe(4, 2.0, 0.04, 2)  # confirmed dear ...
    assert costs.verify_cost(4) == pytest.approx(2 * 0.16)  # ... yet no dearer than two passes of 2 rows
    assert costs.verify_cost(5) == pytest.approx(2 * 0.16)  # (unmeasured: borrows 4 rows' cost)
    controller = AdaptiveGamma(max_gamma=8, costs=StepCosts(verify_s={1: 0.15, 2: 0.16, 3: 3.0}))
    flat = lambda rows: 0.15 + 0.005 * rows  # noqa: E731 - the real costs: nearly flat
    chosen = _simulate(controller, 100, 0.9, flat, 0.02, random.Random(9))
    assert max(chosen[:30]) == 1  # the spike holds it back while it is fresh ...
    assert statistics.median(chosen[-60:]) >= 5, chosen  # ... then long rounds, as without the spike
    warm_up = AdaptiveGamma(max_gamma=16, costs=StepCosts(verify_s={1: 0.16}))
    passed = set()

    def first_pass_spikes(rows):  # the first pass over 3 rows costs 3.5x (a page fault); seen on the EPYC
        spike = 3.5 if rows == 3 and rows not in passed else 1
        passed.add(rows)
        return spike * (0.16 + 0.012 * rows)

    chosen = _simulate(warm_up, 40, 0.9, first_pass_spikes, 0.018, random.Random(0))
    # Before passes were confirmed (a first pass trusted outright): 2, then 1 a round for 23 rounds.
    assert chosen.count(1) <= 3 and statistics.median(chosen[5:]) >= 4, chosen
    costs = StepCosts(verify_s={1: 0.15})
    for round_number in range(40):  # a count that is truly dear stays dear: re-tried, re-measured
        costs.observe(2 if round_number % 10 else 4, 0.16 if round_number % 10 else 0.3, 0.0, 0)
    assert costs.verify_cost(4) > 0.25 and costs.verify_cost(3) == pytest.approx(0.16)  # (drifting down since its last pass)
