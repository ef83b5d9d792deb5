"""Per-generation statistics: what speculation bought and where the time went."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt positions the target's cache restored from a stored prefix (not computed)
    new_tokens: int = 0
    target_calls: int = 0  # verification passes (prefill not counted)
    draft_calls: int = 0  # drafter forward passes
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)  # tokens the round added (after stop/length cuts)
    branches_verified: int = 0  # runner-up tokens verified beside the chain (draft trees)
    branches_accepted: int = 0  # rounds that kept one (counted in accepted_per_round too)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    def record_round(self, num_drafted: int, num_accepted: int, num_emitted: int, num_draft_calls: int) -> None:
        self.target_calls += 1
        self.draft_calls += num_draft_calls
        self.drafted_per_round.append(num_drafted)
        self.accepted_per_round.append(num_accepted)
        self.emitted_per_round.append(num_emitted)
        self.new_tokens += num_emitted

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted_per_round)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted draft tokens / proposed draft tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def tokens_per_call(self) -> float:
        """tau: emitted tokens per target verification call, the bonus/recovered token included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of rounds that accepted draft position i, among rounds that proposed position i."""
        return acceptance_by_position(self.drafted_per_round, self.accepted_per_round)

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_second:.2f} tok/s) | "
            f"target calls {self.target_calls}, tau {self.tokens_per_call:.2f}, alpha {self.acceptance_rate:.2f} | "
            f"prefill {self.prefill_s:.2f}s draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s other {self.other_s:.2f}s"
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_call": self.tokens_per_call,
            "acceptance_by_position": self.acceptance_by_position,
            "accepted_per_round": list(self.accepted_per_round),
            "drafted_per_round": list(self.drafted_per_round),
            "branches_verified": self.branches_verified,
            "branches_accepted": self.branches_accepted,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "other_s": self.other_s,
            "total_s": self.total_s,
            "tokens_per_second": self.tokens_per_second,
        }


def acceptance_by_position(drafted_per_round: Sequence[int], accepted_per_round: Sequence[int]) -> list[float]:
    """Share of rounds that accepted draft position i, among rounds that proposed position i.

    Rounds pair up index by index; pooling several generations is concatenating their lists.
    """
    rates = []
    for position in range(max(drafted_per_round, default=0)):
        proposed = sum(1 for drafted in drafted_per_round if drafted > position)
        accepted = sum(1 for taken in accepted_per_round if taken > position)
        rates.append(accepted / proposed)
    return rates
