"""How many tokens each request of a batch drafts this round: the plan with the most tokens per second.

A round of a batch of B requests is one drafting phase and ONE target pass over
R = sum_i (k_i + 1) rows, where request i drafts k_i tokens. It emits, in expectation,

    E[tokens] = sum_i E_i(k_i),   E_i(k) = 1 + sum_{j=1..k} reach_i(j),   reach_i(j) = prod_{l<=j} h_{i,l}

(h_{i,l}: request i's estimated acceptance of its l-th draft, :class:`~verispec.engine.gamma.AdaptiveGamma`),
and costs pass(R) + draft(K) seconds, K = sum_i k_i. The planner picks the k_i that maximise

    rate = E[tokens] / (pass(R) + draft(K))

and decodes plainly (every k_i = 0) unless the best rate beats plain decoding's B / pass(B) by the
hurdle. Why a plan for the whole batch: each request's own controller saw the shared pass's time as
the price of its own rows, so in a batch of 8 a plain step looked as dear as a speculative one and
every request kept drafting while the batch served 20-35% fewer tokens per second than plain
decoding (README, Performance, 2026-12-06 (evening)). Here a pass is priced by its total rows, as
the target computes it.

For a fixed K the best choice takes the K largest reach_i(j) over all requests (each request's
reaches fall with j, so the K largest are a prefix of every request's drafts) and R = B + K, so the
best plan is found by adding drafts in order of reach and keeping the best prefix.

**No request pays for the others' drafts** beyond ``max_slowdown``: every planned request must expect
at least a plain round's rate over (1 + max_slowdown),

    E_i(k_i) / T(K) >= 1 / ((1 + max_slowdown) T(0))   <=>   E_i(k_i) >= need(K) = T(K) / ((1 + max_slowdown) T(0)).

Why: the rate above counts tokens, not whose they are. It lets the requests that draft well speed
up while a request whose text drafts badly (E ~ 1) rides every longer round: in a burst of 8
HumanEval requests on the EAGLE server the median latency was plain decoding's while the p90 was
26% longer (README, Performance, 2026-12-06 (late night)), and a user whose text defeats the drafter
should get plain decoding's speed, not less. While need(K) <= 1 the bound holds for every plan (E >= 1). Above it each request
needs r_i drafts, the fewest with E_i(r_i) >= need(K) (none enough: no plan of K drafts is allowed),
and the best plan of K drafts gives each its r_i and the K - sum r_i largest remaining reaches
(again a prefix of each request's remaining drafts: exact).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from verispec.engine.gamma import StepCosts, clipped_mix

_SLACK = 1e-12  # sums of the same reaches in another order may differ in the last bit


@dataclass
class PassCosts:
    """Seconds of a batched target pass by its total rows, measured; counts between measured ones
    are interpolated linearly, counts above the largest cost what it costs (an optimistic guess, so
    larger passes get tried), counts below the smallest what the smallest costs (a bound: fewer rows
    are never dearer). No count costs more than any larger measured one."""

    smoothing: float = 0.2  # weight of the newest pass of a row count
    seconds: dict[int, float] = field(default_factory=dict)  # rows -> moving average

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.seconds[rows] = clipped_mix(self.seconds.get(rows), seconds, self.smoothing)

    def measured(self) -> bool:
        return bool(self.seconds)

    def cost(self, rows: int) -> float:
        return self.costs(rows, rows)[0]

    def costs(self, first: int, last: int) -> list[float]:
        """The cost of every row count from ``first`` to ``last``, in one sweep over the measured
        counts (a plan prices every count it considers: one lookup each cost ~4 ms a round at 32
        requests)."""
        if not self.seconds:
            raise ValueError("no pass measured yet")
        counts = sorted(self.seconds)
        # cheapest_from[i]: the cheapest measured count among counts[i:] (inf past the end).
        cheapest_from = [float("inf")] * (len(counts) + 1)
        for index in reversed(range(len(counts))):
            cheapest_from[index] = min(self.seconds[counts[index]], cheapest_from[index + 1])
        out, place = [], bisect_left(counts, first)
        for rows in range(first, last + 1):
            while place < len(counts) and counts[place] < rows:
                place += 1
            if place == len(counts):
                out.append(self.seconds[counts[-1]])
                continue
            exact = counts[place] == rows
            if exact or place == 0:
                estimate = self.seconds[counts[place]]
            else:
                low, high = counts[place - 1], counts[place]
                estimate = self.seconds[low] + (rows - low) / (high - low) * (self.seconds[high] - self.seconds[low])
            # Capped by every larger measured count, a measured one included: a warm-up spike in the
            # first plain pass must not price plain decoding above passes with drafts, for good (a
            # count the plan stops choosing is never measured again).
            out.append(min(estimate, cheapest_from[place + 1 if exact else place]))
        return out


@dataclass(frozen=True)
class PlanRow:
    """One request as the planner sees it: its acceptance reaches reach(1..cap) (nonincreasing), or a
    fixed number of drafts (a seeded request, or one without a controller: ``reaches`` None)."""

    reaches: tuple[float, ...] | None
    fixed_drafts: int = 0


@dataclass
class BatchPlanner:
    """Chooses each request's drafts for a round from measured pass and drafting costs (see module doc)."""

    hurdle: float = 1.05  # speculation must promise this much more than plain decoding (untimed overheads)
    # A pass may exceed the largest measured one by this much at most: max(2x, + explore_rows) rows.
    # Unmeasured counts are priced optimistically, so without a bound a batch of 16 would first try
    # all its drafts at once (96 rows at gamma 5: ~6 plain passes' time, and every drafter's
    # catch-up) to learn that a busy server must not draft; bounded, it tries one draft a request.
    explore_rows: int = 8
    # No planned request's expected rate may fall more than this below a plain round's (module doc);
    # None: the batch's rate alone decides.
    max_slowdown: float | None = 0.1
    pass_costs: PassCosts = field(default_factory=PassCosts)
    draft_costs: StepCosts = field(default_factory=StepCosts)  # only its drafting line is used

    def __post_init__(self) -> None:
        slowdown = self.max_slowdown
        if slowdown is not None and (isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown >= 0):
            raise ValueError(f"max_slowdown must be a number >= 0 (or None: no bound), got {slowdown!r}")

    def plan(self, rows: list[PlanRow]) -> list[int]:
        """Drafts per row; fixed rows keep theirs. Plain (0 for every planned row) until a pass is measured."""
        planned = [0 if row.reaches is not None else row.fixed_drafts for row in rows]
        if not self.pass_costs.measured():
            return planned  # measure what a pass costs here first
        fixed_drafts = sum(row.fixed_drafts for row in rows if row.reaches is None)
        base_rows = len(rows) + fixed_drafts
        # Fixed rows count one token each: their acceptance is not tracked, and the plan only
        # compares choices for the other rows, whose tokens are counted in full.
        base_tokens = float(len(rows))
        increments = sorted(((reach, index) for index, row in enumerate(rows) if row.reaches is not None for reach in row.reaches), reverse=True)
        largest = max(self.pass_costs.seconds)
        increments = increments[: max(max(2 * largest, largest + self.explore_rows) - base_rows, 0)]
        pass_s = self.pass_costs.costs(base_rows, base_rows + len(increments))  # [count] -> a pass with count more rows
        round_s = [pass_s[count] + self.draft_costs.draft_cost(fixed_drafts + count) for count in range(len(increments) + 1)]
        plain_rate = base_tokens / round_s[0]
        # The longest round that keeps a request expecting one token within the bound.
        longest_s = round_s[0] * (1 + self.max_slowdown) if self.max_slowdown is not None else float("inf")
        # The most tokens the weakest planned text can expect: a round needing more is out for every plan.
        weakest = min((1.0 + sum(row.reaches) for row in rows if row.reaches is not None), default=float("inf"))
        prefix_expected = {index: 1.0 for index, row in enumerate(rows) if row.reaches is not None}  # E_i along the prefix
        best_rate, best_plan, tokens = plain_rate, None, base_tokens
        for count, (reach, index) in enumerate(increments, start=1):
            tokens += reach
            prefix_expected[index] += reach
            need = round_s[count] / longest_s
            if need <= 1.0 or min(prefix_expected.values()) + _SLACK >= need:
                rate, plan = tokens / round_s[count], count  # the prefix of ``count`` likeliest drafts
            else:
                lifted = _lift_to(rows, count, need) if need <= weakest + _SLACK else None
                if lifted is None:
                    continue
                rate, plan = (base_tokens + lifted[1]) / round_s[count], lifted[0]
            if rate > best_rate:
                best_rate, best_plan = rate, plan
        if best_plan is None or best_rate < self.hurdle * plain_rate:
            return planned
        if isinstance(best_plan, int):
            for _, index in increments[:best_plan]:
                planned[index] += 1
            return planned
        return best_plan

    def could_pay(self, rows: list[PlanRow]) -> bool:
        """Whether drafting could pay for these rows at all: the plan if every draft were sure to be
        accepted. False in a batch whose every extra row costs what a plain row does: probing a
        text's acceptance there only costs (a draft model's probe also prefills its prompt)."""
        sure = [PlanRow((1.0,) * len(row.reaches)) if row.reaches is not None else row for row in rows]
        return any(drafts for drafts, row in zip(self.plan(sure), rows) if row.reaches is not None)

    def observe(self, rows: int, pass_s: float, draft_s: float, drafted: int) -> None:
        """One round: a pass over ``rows`` rows took ``pass_s``; ``drafted`` drafts took ``draft_s``
        (``drafted`` 0: nothing to learn about drafting, e.g. a round that paid a drafter's prefill)."""
        self.pass_costs.observe(rows, pass_s)
        if drafted > 0:
            self.draft_costs.observe_drafting(drafted, draft_s)


def _lift_to(rows: list[PlanRow], count: int, need: float) -> tuple[list[int], float] | None:
    """The plan of ``count`` drafts with the most expected tokens in which every planned row expects
    at least ``need`` tokens (its drafts, and the tokens they add), or None if there is none."""
    drafts = [row.fixed_drafts if row.reaches is None else 0 for row in rows]
    added, rest = 0.0, []
    for index, row in enumerate(rows):
        if row.reaches is None:
            continue
        expected = 1.0
        for reach in row.reaches:
            if expected + _SLACK >= need:
                break
            expected += reach
            drafts[index] += 1
        if expected + _SLACK < need:
            return None  # this text cannot expect enough tokens to pay for a round this long
        added += expected - 1.0
        rest.extend((reach, index) for reach in row.reaches[drafts[index] :])
    spare = count - sum(drafts[index] for index, row in enumerate(rows) if row.reaches is not None)
    if spare < 0 or spare > len(rest):
        return None
    for reach, index in sorted(rest, reverse=True)[:spare]:
        drafts[index] += 1
        added += reach
    return drafts, added
