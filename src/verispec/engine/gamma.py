"""How many tokens to draft next round: fixed, or chosen from measured costs and acceptance.

A round with gamma drafts emits its accepted prefix plus one token, on average

    E[tokens](gamma) = 1 + sum_{k=1..gamma} prod_{j=1..k} h_j

where h_j = P(draft j accepted | drafts 1..j-1 accepted) is estimated per draft position. With one
i.i.d. acceptance rate alpha this is Leviathan et al.'s (1 - alpha^(gamma+1)) / (1 - alpha), but
real acceptance is bursty: once a few drafts of a code line are accepted the rest usually are
(measured here: h_1 0.61, then 0.74-0.86), so one rejection at draft 2 must not make the controller
expect every later draft to fail. A round costs draft(gamma) + verify(gamma + 1): drafting is
fitted as base + gamma * step (:class:`StepCosts`), and verify(r), the target's time for a pass over
r new tokens, is measured per row count rather than assumed, because on CPUs it is far from flat
(small-row matrix products switch kernels). The controller picks the gamma that maximises E[tokens] / cost; gamma = 0 is plain decoding, left now and then to re-measure
acceptance, with the probe interval doubling while speculation keeps not paying.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Measured seconds of drafting and of a target pass per row count (moving averages).

    Drafting gamma tokens costs ``draft_base_s + gamma * draft_step_s``, fitted by a moving
    least-squares line through the rounds' (drafts, seconds): a round's first draft pass also
    feeds the tokens the last round committed (and a block drafter pays one pass for any gamma),
    so short rounds cost more per draft than long ones. Measured here (int8 0.5B draft, HumanEval):
    77 ms a draft in rounds of mostly 2 drafts against 58 ms in rounds of 6; pricing every draft
    alike made short rounds look cheap and kept the controller below fixed gamma's speed.

    One table can serve many controllers (a server's requests share one target and one drafter):
    costs are properties of the machine and models, acceptance is a property of each text.
    """

    smoothing: float = 0.15  # weight of the newest observation
    draft_step_s: float | None = None  # seconds per drafted token (the line's slope)
    draft_base_s: float = 0.0  # seconds per drafting round whatever its length (the intercept)
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds
    # A row count not passed for this many rounds counts as unmeasured again (see verify_cost).
    stale_rounds: int = 32
    # Moving means of (drafts, seconds, drafts^2, drafts * seconds) over timed drafting rounds.
    _draft_moments: list[float] | None = field(default=None, init=False, repr=False)
    _rounds: int = field(default=0, init=False, repr=False)
    _last_seen: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # rows -> round of its last pass
    _passes: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # rows -> passes timed (absent: given, trusted)

    def observe(self, rows: int, verify_s: float, draft_s: float, drafted: int) -> None:
        """One round: a target pass over ``rows`` tokens; ``drafted`` tokens drafted in ``draft_s``
        (``drafted`` 0: no drafting time to learn from, e.g. a round that also paid the drafter's prefill)."""
        self._rounds += 1
        # The staler the stored figure, the more this pass counts: a count forgotten for stale_rounds
        # (or new) takes this pass's time outright. A stored spike is cut to the split bound first.
        staleness = min(1.0, self._age(rows) / self.stale_rounds)
        previous = min(self.verify_s.get(rows, verify_s), self._split_bound(rows))
        passes = 0 if rows not in self.verify_s else self._passes.get(rows, 2)  # (a count given to the constructor: trusted)
        if passes == 1:  # the second pass confirms or corrects the first: first passes are often warm-up spikes
            self.verify_s[rows] = min(previous, verify_s)
        else:
            self.verify_s[rows] = clipped_mix(previous, verify_s, max(self.smoothing, staleness))
        self._passes[rows] = passes + 1
        self._last_seen[rows] = self._rounds
        if drafted > 0:
            self.observe_drafting(drafted, draft_s)

    def draft_cost(self, gamma: int) -> float:
        if gamma == 0 or self.draft_step_s is None:
            return 0.0
        return self.draft_base_s + gamma * self.draft_step_s

    def observe_drafting(self, drafted: int, seconds: float) -> None:
        """``drafted`` tokens were drafted in ``seconds`` (one round): refit the drafting line."""
        if self.draft_step_s is not None:
            seconds = min(seconds, 2 * self.draft_cost(drafted))  # one outlier counts at most 2x (see clipped_mix)
        observation = (float(drafted), seconds, float(drafted * drafted), drafted * seconds)
        if self._draft_moments is None:
            self._draft_moments = list(observation)
        else:
            for index, value in enumerate(observation):
                self._draft_moments[index] += self.smoothing * (value - self._draft_moments[index])
        mean_drafts, mean_seconds, mean_squares, mean_products = self._draft_moments
        per_draft = mean_seconds / mean_drafts
        spread = mean_squares - mean_drafts**2  # variance of the round lengths seen lately
        # Too little spread (always the same gamma) cannot separate slope from intercept: charge
        # per draft, which is exact at that gamma. The slope stays in [0, per_draft]: base >= 0.
        slope = (mean_products - mean_drafts * mean_seconds) / spread if spread > 0.25 else per_draft
        self.draft_step_s = min(max(slope, 0.0), per_draft)
        self.draft_base_s = mean_seconds - self.draft_step_s * mean_drafts

    def verify_cost(self, rows: int) -> float:
        """Measured cost of ``rows``; unmeasured counts borrow the nearest smaller measured one.

        Borrowing from below is optimistic, so every affordable row count gets tried. One spike in
        a count's time (a page fault in a warm-up pass, another process) must not price that count
        off for good: a count never chosen again is never re-measured (seen on a 2-core EPYC: one
        slow first pass over 3 rows, and a whole 8-prompt benchmark drafted one token a round).
        Hence three guards. A pass over more rows is never cheaper, so no count costs more than
        any larger measured one (plain decoding's 1 row above all). r rows could run as
        ceil(r / r') passes of r' rows, so no count costs more than that (:meth:`_split_bound`).
        And a count not passed for a while slides back to the optimistic guess, reaching it after
        ``stale_rounds`` rounds: it gets tried again, and that pass replaces the old figure.
        """
        measured = [count for count in self.verify_s if count <= rows]
        cost = self._current(max(measured)) if measured else min(self.verify_s.values(), default=1.0)
        larger = [self._current(count) for count in self.verify_s if count > rows]
        return min(cost, self._split_bound(rows), *larger)

    def _age(self, rows: int) -> float:
        """Rounds since the last pass over ``rows`` (infinite if none)."""
        if rows not in self.verify_s:
            return float("inf")
        return self._rounds - self._last_seen.get(rows, 0)  # (a count given to the constructor: seen at round 0)

    def _current(self, rows: int) -> float:
        """A measured count's cost, slid toward the next smaller measured count's as it goes stale.

        A count passed only once is priced as if fully stale: one slow first pass (a warm-up page
        fault, measured here at 2-3x the steady cost) would otherwise hold the controller below that
        count for dozens of rounds (seen: the first prompt of a benchmark drafting one token a round
        for 23 rounds). Priced optimistically, it is chosen again, and its second pass decides.
        """
        smaller = [count for count in self.verify_s if count < rows]
        if not smaller:
            return self.verify_s[rows]
        optimistic = min(self.verify_s[max(smaller)], self.verify_s[rows])
        unconfirmed = self._passes.get(rows, 2) < 2
        staleness = 1.0 if unconfirmed else min(1.0, self._age(rows) / self.stale_rounds)
        return self.verify_s[rows] + staleness * (optimistic - self.verify_s[rows])

    def _split_bound(self, rows: int) -> float:
        """The cheapest way to score ``rows`` in several passes of a smaller measured row count."""
        splits = [-(-rows // count) * seconds for count, seconds in self.verify_s.items() if count < rows]  # ceil(rows / count) passes
        return min(splits, default=float("inf"))


@dataclass
class AdaptiveGamma:
    max_gamma: int
    alpha_prior: float = 0.8  # optimistic: the first rounds must draft to learn anything
    # Weight of each newest observation of a draft position: 0.25 forgets a wrong prior within ~6
    # rejected first drafts (0.15 took ~10, which on a short answer to adversarial text cost ~20%).
    smoothing: float = 0.25
    # A position no round reached drifts this much a round toward the estimate of the position
    # before it: untested positions are assumed no worse than the deepest tested one (acceptance
    # rarely falls with depth once a stretch is predictable), so gamma can grow again, and a fixed
    # prior cannot hold it short on text that is more predictable than the prior.
    drift: float = 0.1
    # Drafting must promise this much more than plain decoding: the cost model leaves out per-round
    # overheads it does not time, so a break-even forecast is a small loss in practice.
    hurdle: float = 1.05
    # Slow start: a sequence's first round drafts at most this many tokens, and the limit doubles
    # each time a round's drafts are all accepted. Until a text has shown it can be drafted, a
    # rejected round costs little (here 2 rejected drafts cost ~0.4 of a plain step, 6 cost ~1.5):
    # on a short answer to adversarial text the optimistic prior otherwise costs most of the budget.
    first_max_drafts: int = 2
    first_probe_interval: int = 4  # plain rounds before drafting again, doubling while it keeps losing
    max_probe_interval: int = 64
    costs: StepCosts = field(default_factory=StepCosts)  # pass a shared table to pool cost measurements
    # accept_rate[k-1] = h_k: P(draft k accepted | drafts 1..k-1 accepted), a moving average per position.
    accept_rate: list[float] = field(init=False)
    _max_drafts: int = field(init=False, default=0)  # this sequence's slow-start limit
    _plain_rounds: int = field(init=False, default=0)
    _probe_interval: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)
    _drafted: bool = field(init=False, default=False)  # this sequence's drafter has run (its prompt prefill is paid)

    def __post_init__(self) -> None:
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        if self.first_max_drafts < 1:
            raise ValueError(f"first_max_drafts must be >= 1, got {self.first_max_drafts}")
        self.start_sequence()

    def start_sequence(self) -> None:
        """A new text: acceptance starts from the prior again; measured costs carry over."""
        self.accept_rate = [self.alpha_prior] * self.max_gamma
        self._max_drafts = self.first_max_drafts
        self._plain_rounds = 0
        self._probe_interval = self.first_probe_interval
        self._probing = False
        self._drafted = False

    @property
    def alpha(self) -> float:
        """Estimated acceptance of the first draft of a round (h_1)."""
        return self.accept_rate[0]

    def expected_tokens(self, gamma: int) -> float:
        return 1.0 + sum(self.reaches(gamma))

    def reaches(self, count: int) -> list[float]:
        """P(drafts 1..k all accepted) for k = 1..count: what the k-th draft adds to E[tokens]."""
        reach, out = 1.0, []
        for rate in self.accept_rate[:count]:
            reach *= rate
            out.append(reach)
        return out

    def expected_cost(self, gamma: int) -> float:
        return self.costs.draft_cost(gamma) + self.costs.verify_cost(gamma + 1)

    def choose(self) -> int:
        """The number of drafts for the next round (0 = a plain decoding step)."""
        if 1 not in self.costs.verify_s:
            return 0  # measure the baseline once (per cost table): what a plain step costs here
        rate = {g: self.expected_tokens(g) / self.expected_cost(g) for g in range(self.draft_limit + 1)}
        best = max(rate, key=rate.get)
        if best > 0 and rate[best] >= self.hurdle * rate[0]:
            self._plain_rounds = 0
            return best
        return self.plain_round()

    @property
    def draft_limit(self) -> int:
        """The most drafts this sequence may take next round (slow start: see ``first_max_drafts``)."""
        return min(self.max_gamma, self._max_drafts)

    def plain_round(self) -> int:
        """Speculation does not pay this round: 0 drafts, or 1 when a probe is due.

        A text is re-tested now and then (one cheap draft), since acceptance is only learnt from
        drafts; the interval doubles until a probe shows speculation paying again.
        """
        self._plain_rounds += 1
        if self._plain_rounds >= self._probe_interval:
            self._plain_rounds = 0
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_interval)
            self._probing = True
            return 1
        return 0

    def speculation_paid(self) -> None:
        """Drafting paid this round (by whatever cost model judged it): probe soon again if it stops."""
        self._plain_rounds = 0
        self._probe_interval = self.first_probe_interval

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float, draft_passes: int) -> None:
        """Fold one round's outcome and timings into the estimates."""
        # A sequence's first drafting round also pays the drafter's prompt prefill: its time says
        # nothing about drafting's cost.
        timed_drafts = num_drafted if self._drafted else 0
        self.costs.observe(num_drafted + 1, verify_s, draft_s, timed_drafts)
        self.observe_acceptance(num_drafted, num_accepted, draft_passes)
        if num_drafted and self.expected_tokens(num_drafted) / self.expected_cost(num_drafted) > 1 / self.costs.verify_cost(1):
            self._probe_interval = self.first_probe_interval  # speculation pays again

    def observe_acceptance(self, num_drafted: int, num_accepted: int, draft_passes: int = 1) -> None:
        """Fold one round's accepted prefix into the per-position acceptance estimates (no costs)."""
        self._drafted = self._drafted or draft_passes > 0
        if num_drafted == 0:
            return
        # Positions 1..num_accepted were accepted; the next one, if drafted, was rejected; later ones
        # were not tested this round. A probe after a stretch of plain rounds is the only fresh
        # evidence about draft 1: it replaces the stale estimate, so recovered text is noticed at once.
        rejected = num_accepted < num_drafted
        if not rejected:
            self._max_drafts = max(self._max_drafts, 2 * num_drafted)
        for index in range(self.max_gamma):
            if index < num_accepted + rejected:
                outcome = 1.0 if index < num_accepted else 0.0
                weight = 1.0 if self._probing and index == 0 else self.smoothing
            else:
                outcome, weight = max(self.alpha_prior, self.accept_rate[index - 1]), self.drift
            self.accept_rate[index] += weight * (outcome - self.accept_rate[index])
        self._probing = False


def clipped_mix(old: float | None, new: float, smoothing: float) -> float:
    """Moving average; one outlier (a GC pause, another thread holding the GIL) counts at most 2x.

    Unclipped, a single 100x spike in a pass's time would keep that row count looking expensive
    for dozens of rounds, long enough to keep drafting on text that rejects every draft.
    """
    if old is None:
        return new
    return old + smoothing * (min(new, 2 * old) - old)
