"""How many drafts each request gets per round, given how many requests share the round.

One verification pass scores sum_i (k_i + 1) rows. While the batch is small the pass is
memory-bound (the weights are read once whatever the rows), so extra draft rows are nearly free
and speculation pays as it does for one request. As the batch grows the pass becomes
compute-bound: every draft row then costs about as much as a plain decoding row, and rejected
drafts are pure loss, so a busy server must draft less, and from some batch size not at all.
The defaults come from `verispec loadtest` on a 2-core CPU with the built-in pair (2026-11-29,
64 new tokens, HumanEval prompts): the draft model sped a lone request up 1.38x, broke even at 2
concurrent requests (4.87 vs 5.02 tokens/s) and lost at 4 (0.73x) and 8 (0.62x) — each request
drafts alone, so drafting grows with the batch while plain rows share one pass. Hence speculation
only for a lone request, until requests that speculate together drafted together (one draft pass per
step for all of them). With that, full gamma up to 4 requests, tapering to none from 16, served 4 / 8
clients at 1.05x / 1.00x plain batching on the 2-core AMD EPYC (2026-12-02) and 1.45x / 1.09x on the
2-core Xeon (2026-12-03, mean of four paired rounds, 1.24-1.71x / 0.91-1.31x): the defaults since.

Since 2026-12-06 (night) this gamma is a cap: below it :class:`~verispec.serving.batch_plan.BatchPlanner`
chooses each request's drafts from measured costs. With the cap lifted (full gamma to 32 requests)
the planner served 16 and 32 clients with EAGLE within 3-4% of plain decoding, where per-request
control had served 25-30% less, but the draft model once 14% below plain at 16: the defaults stay,
and keep a busy batch from paying for the planner's exploration (README, Performance).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchGammaPolicy:
    """gamma as a function of the running batch size.

    full_until: batches of up to this many requests draft the full gamma.
    off_from: batches of this many requests or more decode plainly (gamma 0).
    In between gamma falls linearly from the full value towards 1.
    """

    full_until: int = 4
    off_from: int = 16

    def __post_init__(self) -> None:
        if self.full_until < 1:
            raise ValueError(f"full_until must be >= 1, got {self.full_until!r}")
        if self.off_from <= self.full_until:
            raise ValueError(f"off_from must be > full_until ({self.full_until}), got {self.off_from!r}")

    def gamma_for(self, batch_size: int, gamma: int) -> int:
        """Drafts per request for a round of ``batch_size`` requests, at most ``gamma``."""
        if batch_size >= self.off_from:
            return 0
        if batch_size <= self.full_until:
            return gamma
        remaining = (self.off_from - batch_size) / (self.off_from - self.full_until)  # in (0, 1)
        return max(1, round(gamma * remaining))
