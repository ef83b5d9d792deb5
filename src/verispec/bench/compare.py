"""Speculative vs plain decoding of the same target, prompt by prompt, side by side.

Both methods run on each prompt before the next prompt starts, so machine noise hits them
alike; the reported speed-up is the median over prompts of the per-prompt time ratio.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from verispec.engine import GenerationResult, SpeculativeDecoder
from verispec.sampling import SamplingParams


@dataclass
class PromptComparison:
    prompt_id: str
    prompt_tokens: int
    plain_tokens: int
    speculative_tokens: int
    plain_s: float
    speculative_s: float
    acceptance_rate: float
    tokens_per_call: float
    identical: bool  # speculative output == plain output, token for token

    @property
    def speedup(self) -> float:
        """Ratio of throughputs (tokens/s), robust to outputs of different lengths."""
        plain_rate = self.plain_tokens / self.plain_s
        return (self.speculative_tokens / self.speculative_s) / plain_rate


@dataclass
class ComparisonSummary:
    prompts: int
    median_speedup: float
    mean_speedup: float
    acceptance_rate: float  # over all drafts of all prompts
    tokens_per_call: float  # over all target calls of all prompts
    identical: int

    def line(self) -> str:
        return (
            f"{self.prompts} prompts: median speed-up {self.median_speedup:.2f}x (mean {self.mean_speedup:.2f}x), "
            f"alpha {self.acceptance_rate:.3f}, tau {self.tokens_per_call:.2f}, "
            f"identical to plain {self.identical}/{self.prompts}"
        )


def compare_one(
    plain: SpeculativeDecoder,
    speculative: SpeculativeDecoder,
    prompt_id: str,
    input_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
) -> tuple[PromptComparison, GenerationResult, GenerationResult]:
    plain_result = plain.generate(input_ids, max_new_tokens, sampling)
    spec_result = speculative.generate(input_ids, max_new_tokens, sampling)
    row = PromptComparison(
        prompt_id=prompt_id,
        prompt_tokens=len(input_ids),
        plain_tokens=len(plain_result.token_ids),
        speculative_tokens=len(spec_result.token_ids),
        plain_s=plain_result.stats.total_s,
        speculative_s=spec_result.stats.total_s,
        acceptance_rate=spec_result.stats.acceptance_rate,
        tokens_per_call=spec_result.stats.tokens_per_call,
        identical=plain_result.token_ids == spec_result.token_ids,
    )
    return row, plain_result, spec_result


def summarize(rows: list[PromptComparison], spec_stats: list) -> ComparisonSummary:
    drafted = sum(s.num_drafted for s in spec_stats)
    calls = sum(s.target_calls for s in spec_stats)
    speedups = [row.speedup for row in rows]
    return ComparisonSummary(
        prompts=len(rows),
        median_speedup=statistics.median(speedups),
        mean_speedup=statistics.fmean(speedups),
        acceptance_rate=sum(s.num_accepted for s in spec_stats) / drafted if drafted else 0.0,
        tokens_per_call=sum(s.new_tokens for s in spec_stats) / calls if calls else 0.0,
        identical=sum(row.identical for row in rows),
    )


def rows_to_dicts(rows: list[PromptComparison]) -> list[dict]:
    return [asdict(row) | {"speedup": row.speedup} for row in rows]
