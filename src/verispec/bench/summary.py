"""From per-run rows to per-method numbers: speed-ups, alpha, tau, identical outputs, per category.

Speed-up is a ratio of throughputs (new tokens / second) taken *per prompt* against a baseline
run on the same prompt, then summarized by median and mean over prompts: ratios of
side-by-side runs cancel what the prompts do to absolute speed, and throughput (not time)
keeps outputs of different lengths comparable. alpha, tau and acceptance by position pool
all rounds of all prompts, so long generations weigh more, as they do in wall-clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from verispec.bench.methods import REFERENCE_METHODS
from verispec.bench.runner import Row
from verispec.engine.stats import acceptance_by_position


@dataclass
class SpeedUp:
    median: float
    mean: float
    prompts: int  # prompt turns where both the method and the baseline ran


@dataclass
class Identical:
    reference: str  # the method whose greedy output the others are compared with
    count: int
    compared: int
    differences: list[dict] = field(default_factory=list)  # {"prompt": label, "first_difference": token index}


@dataclass
class CategorySummary:
    runs: int
    tokens_per_second: float
    speedup: dict[str, SpeedUp]  # baseline method -> speed-up over the category's prompts
    acceptance_rate: float | None = None  # alpha within the category (None: nothing drafted / not observable)
    tokens_per_call: float | None = None  # tau within the category
    # Speed-up of the decoding after the prompt's prefill (ours only): on long prompts the prefill,
    # the same for every method, dominates the wall-clock and hides what drafting changes.
    decode_speedup: dict[str, SpeedUp] = field(default_factory=dict)


@dataclass
class MethodSummary:
    method: str
    runs: int
    new_tokens: int
    seconds: float
    tokens_per_second: float  # all new tokens / all seconds
    speedup: dict[str, SpeedUp]  # baseline method ("plain", "hf-plain") -> speed-up, for baselines in the run
    acceptance_rate: float | None  # alpha; None: nothing drafted, or not observable (Hugging Face)
    tokens_per_call: float | None  # tau: new tokens / target calls that emitted them
    acceptance_by_position: list[float] | None
    identical: Identical | None  # None: sampling, no reference in the run, or this is the reference
    peak_rss: int | None  # bytes, the whole process (models included)
    by_category: dict[str, CategorySummary]
    # Where the wall-clock went (ours only; None for Hugging Face): seconds over all runs.
    time_split: TimeSplit | None = None


@dataclass
class TimeSplit:
    """A method's seconds over all its runs, by what the engine was doing (its own timers)."""

    prefill: float  # the target's pass over the prompt
    draft: float  # the drafter's proposals (its own pass over the prompt and catch-ups on committed tokens included)
    verify: float  # target passes over drafts, acceptance and cache crops
    other: float  # the rest: stop checks, bookkeeping
    target_calls: int
    draft_calls: int
    branches_verified: int = 0  # runner-up tokens verified beside the chain (one-level draft trees)
    branches_accepted: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # restored from the method's prefix cache, not prefilled

    @property
    def total(self) -> float:
        return self.prefill + self.draft + self.verify + self.other


def time_split(rows: Sequence[Row]) -> TimeSplit | None:
    """Sum the engine's timers over ``rows``; None if any row lacks them (Hugging Face's)."""
    if not rows or any(row.prefill_seconds is None or row.draft_seconds is None or row.verify_seconds is None for row in rows):
        return None
    prefill = sum(row.prefill_seconds for row in rows)
    draft = sum(row.draft_seconds for row in rows)
    verify = sum(row.verify_seconds for row in rows)
    other = max(0.0, sum(row.seconds for row in rows) - prefill - draft - verify)
    calls = sum(row.target_calls for row in rows)
    return TimeSplit(
        prefill, draft, verify, other, calls, sum(row.draft_calls or 0 for row in rows),
        sum(row.branches_verified for row in rows), sum(row.branches_accepted for row in rows),
        sum(row.prompt_tokens for row in rows), sum(row.reused_prompt_tokens for row in rows),
    )


def speedup(rows: Sequence[Row], method: str, baseline: str, decode_only: bool = False) -> SpeedUp | None:
    """Per-prompt ratio of tokens/s (method over baseline), then median and mean; None without pairs.

    ``decode_only``: throughput after the prompt's prefill (rows that lack it are left out).
    """

    def rate(row: Row) -> float:
        return row.decode_tokens_per_second if decode_only else row.tokens_per_second

    base = {row.key: rate(row) for row in rows if row.method == baseline}
    ratios = [rate(row) / base[row.key] for row in rows if row.method == method and base.get(row.key, 0) > 0 and rate(row) > 0]
    if not ratios:
        return None
    return SpeedUp(median=statistics.median(ratios), mean=statistics.fmean(ratios), prompts=len(ratios))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_method(methods: Sequence[str]) -> str | None:
    """The identical-output reference: our plain decoding, else Hugging Face's."""
    return next((name for name in REFERENCE_METHODS if name in methods), None)


def summarize(rows: Sequence[Row], methods: Sequence[str], greedy: bool, peak_rss: dict[str, int] | None = None) -> list[MethodSummary]:
    """One summary per method in ``methods`` order (methods without rows are left out)."""
    peak_rss = peak_rss or {}
    present = [m for m in methods if any(row.method == m for row in rows)]
    baselines = [b for b in REFERENCE_METHODS if b in present]
    reference = reference_method(present) if greedy else None
    summaries = []
    for method in present:
        own = [row for row in rows if row.method == method]
        summaries.append(
            MethodSummary(
                method=method,
                runs=len(own),
                new_tokens=sum(row.new_tokens for row in own),
                seconds=sum(row.seconds for row in own),
                tokens_per_second=_throughput(own),
                speedup=_speedups(rows, method, baselines),
                acceptance_rate=_acceptance_rate(own),
                tokens_per_call=_tokens_per_call(own),
                acceptance_by_position=_pooled_acceptance_by_position(own),
                identical=_identical(rows, method, reference) if reference not in (None, method) else None,
                peak_rss=peak_rss.get(method),
                by_category=_by_category(rows, method, baselines),
                time_split=time_split(own),
            )
        )
    return summaries


def _speedups(rows: Sequence[Row], method: str, baselines: Sequence[str], decode_only: bool = False) -> dict[str, SpeedUp]:
    found = {baseline: speedup(rows, method, baseline, decode_only) for baseline in baselines}
    return {baseline: value for baseline, value in found.items() if value is not None}


def _throughput(rows: Sequence[Row]) -> float:
    seconds = sum(row.seconds for row in rows)
    return sum(row.new_tokens for row in rows) / seconds if seconds > 0 else 0.0


def _acceptance_rate(rows: Sequence[Row]) -> float | None:
    if any(row.drafted_per_round is None for row in rows):
        return None
    drafted = sum(sum(row.drafted_per_round) for row in rows)
    return sum(sum(row.accepted_per_round) for row in rows) / drafted if drafted else None


def _tokens_per_call(rows: Sequence[Row]) -> float | None:
    calls = sum(row.target_calls for row in rows)
    return sum(row.new_tokens for row in rows) / calls if calls else None


def _pooled_acceptance_by_position(rows: Sequence[Row]) -> list[float] | None:
    if any(row.drafted_per_round is None for row in rows):
        return None
    drafted = [n for row in rows for n in row.drafted_per_round]
    accepted = [n for row in rows for n in row.accepted_per_round]
    return acceptance_by_position(drafted, accepted) or None


def _identical(rows: Sequence[Row], method: str, reference: str) -> Identical | None:
    expected = {row.key: row.token_ids for row in rows if row.method == reference}
    result = Identical(reference=reference, count=0, compared=0)
    for row in rows:
        if row.method != method or row.key not in expected:
            continue
        result.compared += 1
        position = first_difference(row.token_ids, expected[row.key])
        if position is None:
            result.count += 1
        else:
            result.differences.append({"prompt": row.label, "first_difference": position})
    return result if result.compared else None


def _by_category(rows: Sequence[Row], method: str, baselines: Sequence[str]) -> dict[str, CategorySummary]:
    categories = list(dict.fromkeys(row.category for row in rows if row.method == method))
    result = {}
    for category in categories:
        in_category = [row for row in rows if row.category == category]
        own = [row for row in in_category if row.method == method]
        result[category] = CategorySummary(
            runs=len(own),
            tokens_per_second=_throughput(own),
            speedup=_speedups(in_category, method, baselines),
            acceptance_rate=_acceptance_rate(own),
            tokens_per_call=_tokens_per_call(own),
            decode_speedup=_speedups(in_category, method, baselines, decode_only=True),
        )
    return result
