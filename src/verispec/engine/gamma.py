"""How many tokens to draft next round: fixed, or chosen from measured costs and acceptance.

With per-draft acceptance probability alpha, a round with gamma drafts emits on average

    E[tokens](gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)        (Leviathan et al., eq. 1)

and costs gamma * draft_step + verify(gamma + 1), where verify(r) is the target's time for a
pass over r new tokens. On CPUs verify(r) is far from flat (small-row matrix products switch
kernels), so it is measured per row count rather than assumed. The controller picks the gamma
that maximises E[tokens] / cost; gamma = 0 is plain decoding, left now and then to re-measure
acceptance, with the probe interval doubling while speculation keeps not paying.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Measured seconds of a draft step and of a target pass per row count (moving averages).

    One table can serve many controllers (a server's requests share one target and one drafter):
    costs are properties of the machine and models, acceptance is a property of each text.
    """

    smoothing: float = 0.15  # weight of the newest observation
    draft_step_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds

    def observe(self, rows: int, verify_s: float, draft_s: float, draft_passes: int) -> None:
        self.verify_s[rows] = _mix(self.verify_s.get(rows), verify_s, self.smoothing)
        if draft_passes > 0:
            self.draft_step_s = _mix(self.draft_step_s, draft_s / draft_passes, self.smoothing)

    def verify_cost(self, rows: int) -> float:
        """Measured cost of ``rows``; unmeasured counts borrow the nearest smaller measured one.

        Borrowing from below is optimistic, so every affordable row count gets tried once. A pass
        over more rows is never cheaper, so no count costs more than any larger measured one: a
        spike in one count's time cannot make it (plain decoding's 1 row above all) look dearer
        than its neighbours for long.
        """
        cost = min(self.verify_s.values(), default=1.0)
        for candidate in range(rows, 0, -1):
            if candidate in self.verify_s:
                cost = self.verify_s[candidate]
                break
        larger = [seconds for count, seconds in self.verify_s.items() if count > rows]
        return min(cost, *larger) if larger else cost


@dataclass
class AdaptiveGamma:
    max_gamma: int
    alpha_prior: float = 0.8  # optimistic: the first rounds must draft to learn anything
    # Weight of each newest acceptance observation: 0.25 forgets a wrong prior within ~6 rejected
    # drafts (0.15 took ~10, which on a short answer to adversarial text cost ~20% against plain).
    smoothing: float = 0.25
    # Drafting must promise this much more than plain decoding: the cost model leaves out per-round
    # overheads it does not time, so a break-even forecast is a small loss in practice.
    hurdle: float = 1.05
    first_probe_interval: int = 4  # plain rounds before drafting again, doubling while it keeps losing
    max_probe_interval: int = 64
    costs: StepCosts = field(default_factory=StepCosts)  # pass a shared table to pool cost measurements
    alpha: float = field(init=False)
    _plain_rounds: int = field(init=False, default=0)
    _probe_interval: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)
    _drafted: bool = field(init=False, default=False)  # this sequence's drafter has run (its prompt prefill is paid)

    def __post_init__(self) -> None:
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        self.start_sequence()

    def start_sequence(self) -> None:
        """A new text: acceptance starts from the prior again; measured costs carry over."""
        self.alpha = self.alpha_prior
        self._plain_rounds = 0
        self._probe_interval = self.first_probe_interval
        self._probing = False
        self._drafted = False

    def expected_tokens(self, gamma: int) -> float:
        alpha = min(self.alpha, 0.999)
        return (1 - alpha ** (gamma + 1)) / (1 - alpha)

    def expected_cost(self, gamma: int) -> float:
        return gamma * (self.costs.draft_step_s or 0.0) + self.costs.verify_cost(gamma + 1)

    def choose(self) -> int:
        """The number of drafts for the next round (0 = a plain decoding step)."""
        if 1 not in self.costs.verify_s:
            return 0  # measure the baseline once (per cost table): what a plain step costs here
        rate = {g: self.expected_tokens(g) / self.expected_cost(g) for g in range(self.max_gamma + 1)}
        best = max(rate, key=rate.get)
        if best > 0 and rate[best] >= self.hurdle * rate[0]:
            self._plain_rounds = 0
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self._probe_interval:  # speculation looked unprofitable: check again
            # One cheap draft; the interval doubles until a probe shows speculation paying again.
            self._plain_rounds = 0
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_interval)
            self._probing = True
            return 1
        return 0

    def observe(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float, draft_passes: int) -> None:
        """Fold one round's outcome and timings into the estimates."""
        # A sequence's first drafting round also pays the drafter's prompt prefill: it times no draft step.
        timed_passes = draft_passes if self._drafted else 0
        self._drafted = self._drafted or draft_passes > 0
        self.costs.observe(num_drafted + 1, verify_s, draft_s, timed_passes)
        if num_drafted > 0:
            # A round is a run of successes ended by one failure unless every draft was accepted.
            failures = 1 if num_accepted < num_drafted else 0
            round_alpha = num_accepted / (num_accepted + failures)
            # A probe after a stretch of plain rounds is the only fresh evidence: it replaces the
            # stale estimate, so recovered text is noticed at the first successful probe.
            # Otherwise each draft verified counts as one observation of the moving average.
            weight = 1.0 if self._probing else 1 - (1 - self.smoothing) ** (num_accepted + failures)
            self._probing = False
            self.alpha += weight * (round_alpha - self.alpha)
            if self.expected_tokens(num_drafted) / self.expected_cost(num_drafted) > 1 / self.costs.verify_cost(1):
                self._probe_interval = self.first_probe_interval  # speculation pays again


def _mix(old: float | None, new: float, smoothing: float) -> float:
    """Moving average; one outlier (a GC pause, another thread holding the GIL) counts at most 2x.

    Unclipped, a single 100x spike in a pass's time would keep that row count looking expensive
    for dozens of rounds, long enough to keep drafting on text that rejects every draft.
    """
    if old is None:
        return new
    return old + smoothing * (min(new, 2 * old) - old)
