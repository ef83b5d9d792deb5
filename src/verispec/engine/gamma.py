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
class AdaptiveGamma:
    max_gamma: int
    alpha_prior: float = 0.8  # optimistic: the first rounds must draft to learn anything
    smoothing: float = 0.15  # weight of the newest observation in the moving averages
    first_probe_interval: int = 4  # plain rounds before drafting again, doubling while it keeps losing
    max_probe_interval: int = 64
    alpha: float = field(init=False)
    draft_step_s: float | None = field(init=False, default=None)
    verify_s: dict[int, float] = field(init=False, default_factory=dict)  # rows -> seconds
    _plain_rounds: int = field(init=False, default=0)
    _probe_interval: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)

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

    def expected_tokens(self, gamma: int) -> float:
        alpha = min(self.alpha, 0.999)
        return (1 - alpha ** (gamma + 1)) / (1 - alpha)

    def expected_cost(self, gamma: int) -> float:
        return gamma * (self.draft_step_s or 0.0) + self._verify_cost(gamma + 1)

    def _verify_cost(self, rows: int) -> float:
        """Measured cost of ``rows``; unmeasured counts borrow the nearest smaller measured one.

        Borrowing from below is optimistic, so every affordable row count gets tried once.
        """
        for candidate in range(rows, 0, -1):
            if candidate in self.verify_s:
                return self.verify_s[candidate]
        return min(self.verify_s.values(), default=1.0)

    def choose(self) -> int:
        """The number of drafts for the next round (0 = a plain decoding step)."""
        best = max(range(self.max_gamma + 1), key=lambda g: self.expected_tokens(g) / self.expected_cost(g))
        if best > 0:
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
        rows = num_drafted + 1
        self.verify_s[rows] = self._mix(self.verify_s.get(rows), verify_s)
        if draft_passes > 0:
            self.draft_step_s = self._mix(self.draft_step_s, draft_s / draft_passes)
        if num_drafted > 0:
            # A round is a run of successes ended by one failure unless every draft was accepted.
            failures = 1 if num_accepted < num_drafted else 0
            round_alpha = num_accepted / (num_accepted + failures)
            # A probe after a stretch of plain rounds is the only fresh evidence: it replaces the
            # stale estimate, so recovered text is noticed at the first successful probe.
            weight = 1.0 if self._probing else self.smoothing * min(1.0, (num_accepted + failures) / 2)
            self._probing = False
            self.alpha += weight * (round_alpha - self.alpha)
            if self.expected_tokens(num_drafted) / self.expected_cost(num_drafted) > 1 / self._verify_cost(1):
                self._probe_interval = self.first_probe_interval  # speculation pays again

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
