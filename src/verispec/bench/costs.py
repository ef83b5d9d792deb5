"""Forward-pass cost by number of new tokens: the numbers that decide gamma on a machine.

A verification pass scores gamma+1 new tokens against a KV cache; whether that costs about one
plain step or several decides whether speculation pays. This measures it directly, through the
engine's own CachedLM, for each kernel setting, as medians of repeated passes on one cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from verispec.engine.cached_lm import CachedLM


@dataclass
class ForwardCost:
    new_tokens: int
    median_s: float


def forward_costs(model, context_tokens: int, new_token_counts: list[int], repeats: int = 5) -> list[ForwardCost]:  # noqa: ANN001
    """Median seconds of one pass over ``n`` new tokens after a ``context_tokens`` cache, per n.

    The cache is cropped back after every pass, so each one sees the same context length.
    """
    if context_tokens < 1 or repeats < 1 or not new_token_counts or min(new_token_counts) < 1:
        raise ValueError("context_tokens, repeats and every new-token count must be >= 1")
    lm = CachedLM(model)
    vocab = lm.vocab_size
    # Arbitrary but fixed token ids: cost does not depend on which tokens they are.
    lm.extend([(7 * i + 11) % vocab for i in range(context_tokens)], num_logits=0)
    lm.extend([1], num_logits=1)  # warm-up pass (allocations, kernel selection)
    lm.crop(context_tokens)
    costs = []
    for count in new_token_counts:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            lm.extend([(13 * i + 5) % vocab for i in range(count)], num_logits=count)
            times.append(time.perf_counter() - started)
            lm.crop(context_tokens)
        costs.append(ForwardCost(count, statistics.median(times)))
    lm.release()
    return costs


def format_costs(rows: dict[str, list[ForwardCost]]) -> str:
    """A table: one row per setting, ms per pass and the ratio to a 1-token pass."""
    counts = [cost.new_tokens for cost in next(iter(rows.values()))]
    lines = ["setting".ljust(24) + "".join(f"{n:>14}" for n in counts)]
    for name, costs in rows.items():
        base = costs[0].median_s if costs[0].new_tokens == 1 else None
        cells = [f"{c.median_s * 1000:7.0f}ms" + (f" {c.median_s / base:4.2f}x" if base else "") for c in costs]
        lines.append(name.ljust(24) + "".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)
