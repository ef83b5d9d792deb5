"""The batch planner: drafts per request from acceptance and measured pass costs, against brute force,
and wired into the scheduler (exact answers; a batch whose rows are dear decodes plainly)."""

import itertools
import random

import pytest

from scheduling import serve_all
from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.serving import BatchGammaPolicy, BatchPlanner, PassCosts, PlanRow, Scheduler, SchedulerConfig


def _planner(pass_s: dict[int, float], draft_base_s: float = 0.0, draft_step_s: float | None = None, max_slowdown: float | None = None) -> BatchPlanner:
    planner = BatchPlanner(pass_costs=PassCosts(seconds=dict(pass_s)), max_slowdown=max_slowdown)
    planner.draft_costs.draft_base_s, planner.draft_costs.draft_step_s = draft_base_s, draft_step_s
    return planner


def _seconds(planner: BatchPlanner, rows: list[PlanRow], drafts: list[int]) -> float:
    return planner.pass_costs.cost(len(rows) + sum(drafts)) + planner.draft_costs.draft_cost(sum(drafts))


def _rate(planner: BatchPlanner, rows: list[PlanRow], drafts: list[int]) -> float:
    """E[tokens] / seconds of a round drafting ``drafts`` (the module docstring's equation)."""
    tokens = sum(1 + (sum(row.reaches[:k]) if row.reaches is not None else 0) for row, k in zip(rows, drafts))
    return tokens / _seconds(planner, rows, drafts)


def _fair(planner: BatchPlanner, rows: list[PlanRow], drafts: list[int]) -> bool:
    """Whether every planned row expects at least a plain round's rate / (1 + max_slowdown)."""
    if planner.max_slowdown is None:
        return True
    plain_s = _seconds(planner, rows, [0 if row.reaches is not None else row.fixed_drafts for row in rows])
    seconds = _seconds(planner, rows, drafts)
    return all(
        (1 + sum(row.reaches[:k])) * (1 + planner.max_slowdown) * plain_s >= seconds - 1e-12 for row, k in zip(rows, drafts) if row.reaches is not None
    )


def _reaches(rng: random.Random, cap: int) -> tuple[float, ...]:
    reach, out = 1.0, []
    for _ in range(cap):
        reach *= rng.uniform(0.2, 0.95)
        out.append(reach)
    return tuple(out)


@pytest.mark.parametrize("max_slowdown", [None, 0.0, 0.1])
def test_the_plan_is_the_brute_force_best_and_plain_below_the_hurdle(max_slowdown):
    rng = random.Random(0)
    planned_some = planned_none = bound_binds = 0
    for _ in range(300):
        rows = [PlanRow(_reaches(rng, rng.randint(0, 3))) for _ in range(rng.randint(1, 3))]
        # a pass: flat (memory-bound) up to a knee, then a cost per row; passes measured at a few counts
        knee, per_row, plain = rng.randint(1, 8), rng.uniform(0.0, 0.05), 0.1
        counts = sorted(rng.sample(range(1, 14), 4))
        planner = _planner({count: plain + per_row * max(0, count - knee) for count in counts}, rng.uniform(0, 0.01), rng.uniform(0, 0.02), max_slowdown)
        plan = planner.plan(rows)
        choices = list(itertools.product(*[range(len(row.reaches) + 1) for row in rows]))
        best = max((drafts for drafts in choices if _fair(planner, rows, list(drafts))), key=lambda drafts: _rate(planner, rows, list(drafts)))
        unbounded = max(choices, key=lambda drafts: _rate(planner, rows, list(drafts)))
        bound_binds += _rate(planner, rows, list(best)) < _rate(planner, rows, list(unbounded)) - 1e-9
        plain_rate = _rate(planner, rows, [0] * len(rows))
        if _rate(planner, rows, list(best)) >= planner.hurdle * plain_rate and any(best):
            assert _rate(planner, rows, plan) == pytest.approx(_rate(planner, rows, list(best)))
            assert _fair(planner, rows, plan)
            planned_some += 1
        else:
            assert plan == [0] * len(rows)
            planned_none += 1
    assert planned_some > 50 and planned_none > 20  # both branches were exercised
    assert (bound_binds > 20) == (max_slowdown is not None)  # and the bound changed plans where it is on


def test_no_request_pays_for_the_others_drafts_beyond_the_bound():
    # Rows cost 10% of a plain pass each: the two texts that draft well would take 3 drafts each,
    # a round 60% longer, while the third text, which drafts badly, would be 60% slower than plain.
    rows = [PlanRow((0.95, 0.9, 0.85)), PlanRow((0.95, 0.9, 0.85)), PlanRow((0.05, 0.01, 0.0))]
    costs = {count: 0.1 + 0.01 * (count - 3) for count in (3, 6, 12)}
    assert _planner(costs, max_slowdown=None).plan(rows) == [3, 3, 0]
    # Bounded, the round may be at most 10% longer than plain for the third: one draft in all.
    assert _planner(costs, max_slowdown=0.1).plan(rows) == [1, 0, 0] or _planner(costs, max_slowdown=0.1).plan(rows) == [0, 1, 0]
    # A request that expects enough tokens itself may be planned into a longer round: here every
    # text drafts well, so the bound lets them all draft (each is then faster than plain).
    strong = rows[:2] + [PlanRow((0.9, 0.8, 0.7))]
    assert _planner(costs, max_slowdown=0.1).plan(strong) == [3, 3, 3]
    assert _planner(costs, max_slowdown=0.0).plan(strong) == [3, 3, 3]
    # A lone request is never bounded by anyone but itself.
    assert _planner(costs, max_slowdown=0.0).plan(rows[:1]) == [3]
    for bad in (-0.1, True, "0.1"):
        with pytest.raises(ValueError, match="max_slowdown must be a number >= 0"):
            BatchPlanner(max_slowdown=bad)


def test_cheap_rows_draft_the_cap_dear_rows_decode_plainly_and_fixed_rows_keep_theirs():
    rows = [PlanRow((0.8, 0.6, 0.45)), PlanRow((0.7, 0.5)), PlanRow(None, fixed_drafts=2)]
    flat = _planner({4: 0.1, 40: 0.1})  # memory-bound: every row costs the same
    assert flat.plan(rows) == [3, 2, 2]
    # Every row as dear as a plain step's rows (a compute-bound batch): drafts that are accepted
    # less than always only slow the batch down.
    linear = _planner({count: 0.05 * count for count in (2, 5, 10, 20)})
    assert linear.plan(rows[:2]) == [0, 0]
    assert linear.plan([PlanRow((1.0, 1.0)), PlanRow((1.0,))]) == [0, 0]  # even sure drafts only break even
    # In between the best plan takes the likeliest drafts first, across requests.
    knee = _planner({5: 0.1, 6: 0.1, 7: 0.13, 12: 0.28})
    assert knee.plan(rows) == [1, 0, 2]
    assert BatchPlanner().plan(rows) == [0, 0, 2]  # nothing measured: a plain round measures the pass first
    # Whether probing a text's acceptance can pay: not where even sure drafts only break even.
    assert flat.could_pay(rows) and knee.could_pay(rows[:2])
    assert not linear.could_pay(rows[:2]) and not BatchPlanner().could_pay(rows)


def test_exploration_doubles_the_largest_measured_pass_at_most():
    rows = [PlanRow((0.9, 0.8, 0.7, 0.6, 0.5))] * 16
    planner = _planner({16: 0.2})  # a busy server's first plain pass; larger ones are priced as it
    assert planner.plan(rows) == [1] * 16  # 32 rows: one draft each, not all 96 rows at once
    planner.pass_costs.observe(32, 0.21)
    assert sum(planner.plan(rows)) == 48  # then up to 64 rows
    small = _planner({1: 0.1})
    assert small.plan(rows[:1]) == [5]  # a lone request: up to 1 + explore_rows rows at once


def test_pass_costs_interpolate_bound_and_refuse_bad_counts():
    costs = PassCosts(seconds={4: 0.1, 8: 0.2, 12: 0.18})
    assert costs.cost(4) == 0.1 and costs.cost(6) == pytest.approx(0.15)
    assert costs.cost(2) == 0.1  # below the smallest: what it costs (fewer rows are never dearer)
    assert costs.cost(40) == 0.18  # above the largest: optimistic, so larger passes get tried
    assert costs.cost(8) == 0.18 and costs.cost(10) == pytest.approx(0.18)  # never above a larger measured count
    # One sweep over a range prices each count as a lone lookup does (the sweep carries its place along).
    assert costs.costs(1, 14) == [costs.cost(rows) for rows in range(1, 15)]
    spiked = PassCosts(seconds={1: 1.33, 2: 0.97, 3: 1.05})  # a warm-up spike in the first, plain, pass
    assert spiked.cost(1) == 0.97 and spiked.cost(3) == 1.05
    costs.observe(4, 10.0)  # a spike moves the average at most as a doubling would
    assert costs.cost(4) == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    with pytest.raises(ValueError, match="rows must be >= 1"):
        costs.observe(0, 0.1)
    with pytest.raises(ValueError, match="no pass measured"):
        PassCosts().cost(3)


class _FrozenPlanner(BatchPlanner):
    """Costs given, not learnt (whatever the tiny model's timings); every round's batch size and
    pass rows recorded."""

    def plan(self, rows):
        self.batch_size = len(rows)
        return super().plan(rows)

    def observe(self, rows, pass_s, draft_s, drafted):
        self.rounds.append((self.batch_size, rows))


def test_the_scheduler_drafts_what_the_planner_plans_and_stays_exact():
    target = tiny_target(seed=0)
    drafter = DraftModel(noisy_copy(target, noise=0.05))  # its drafts are mostly accepted
    # A pass is flat up to 5 rows, then each row costs what a plain step's row does: a lone
    # request's 4 drafts are free, a batch of 5 has no free row.
    planner = _FrozenPlanner(pass_costs=PassCosts(seconds={1: 0.1, 5: 0.1, 6: 0.2, 25: 2.1}))
    planner.rounds = []
    config = SchedulerConfig(gamma=4, gamma_policy=BatchGammaPolicy(full_until=8, off_from=40))
    bounded = Scheduler(target, drafter, None, SchedulerConfig(max_slowdown=0.25))
    try:  # without an injected planner the config's bound is the planner's
        assert bounded._planner.max_slowdown == 0.25
    finally:
        bounded.stop()
    scheduler = Scheduler(target, drafter, None, config, planner=planner)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23], [30, 31], [40, 41, 42]]
    try:
        alone = [(tokens, step.stats) for tokens, step in serve_all(scheduler, prompts[:1], 24)]
        lone_rounds = list(planner.rounds)
        together = [(tokens, step.stats) for tokens, step in serve_all(scheduler, prompts, 24)]
    finally:
        scheduler.stop()
    reference = SpeculativeDecoder(target)
    for prompt, (tokens, _) in zip(prompts, together):
        assert tokens == reference.generate(prompt, 24, stop=[]).token_ids
    assert alone[0][0] == together[0][0]
    # Alone the request drafts; in the full batch nobody does, not even a probe (no text could pay).
    assert sum(alone[0][1].drafted_per_round) > 10
    assert sum(rows - 1 for _, rows in lone_rounds) == sum(alone[0][1].drafted_per_round)
    full_batch = [rows for size, rows in planner.rounds[len(lone_rounds):] if size == len(prompts)]
    assert len(full_batch) > 10 and set(full_batch) == {len(prompts)}
