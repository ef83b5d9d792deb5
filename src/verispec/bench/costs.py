"""Forward-pass cost by number of new tokens: the numbers that decide gamma on a machine.

A verification pass scores gamma+1 new tokens against a KV cache; whether that costs about one
plain step or several decides whether speculation pays. This measures it directly, through the
engine's own CachedLM, for each kernel setting, as medians of repeated passes on one cache.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from verispec.engine.cached_lm import CachedLM
from verispec.engine.lean_lm import LeanDecoder, LeanLM, target_lm
from verispec.models.panel_linear import panel_or_same


CONTEXT_FILLS = ("prefill", "random")


class ContextFillUnsupported(ValueError):
    """A setting that cannot time passes after a random context (``verispec costs`` skips it)."""


@dataclass
class ForwardCost:
    new_tokens: int
    median_s: float


def forward_costs(  # noqa: ANN201 - list[ForwardCost]
    model,  # noqa: ANN001 - a transformers causal LM
    context_tokens: int,
    new_token_counts: list[int],
    repeats: int = 5,
    lm_head=None,  # noqa: ANN001 - an output layer
    lean: bool = False,
    panel_kernels: bool = False,
    transformers_forward: bool = False,
    text_ids: list[int] | None = None,
    argmax_only: bool = False,
    context_fill: str = "prefill",
) -> list[ForwardCost]:
    """Median seconds of one pass over ``n`` new tokens after a ``context_tokens`` cache, per n.

    The cache is cropped back after every pass, so each one sees the same context length.
    ``lm_head``: an output layer replacing the model's (a drafter's reduced-vocabulary rows).
    ``lean``: through our lean forward (what draft models run) instead of the model's own.
    ``panel_kernels``: the lean forward's products and the output layer through our panel kernels
    (what draft models run by default). Otherwise the model runs as the engine runs a target
    (:func:`~verispec.engine.lean_lm.target_lm`: lean if it was switched to the panel kernels), or
    with ``transformers_forward`` always through the model's own forward.

    ``text_ids``: real text for the cache and the new tokens (its first ``context_tokens`` ids, then
    the ids that follow), instead of arbitrary fixed ids. The cost of a greedy pass through the
    screened LM head (``argmax_only``) depends on how sure the model is, so it needs real text.

    ``context_fill``: "prefill" runs the model over the context; "random" fills our lean forward's
    caches with random keys and values instead (:meth:`LeanLM.fill_for_timing`: seconds instead of
    minutes at 16K tokens, the same attention work); :class:`ContextFillUnsupported` for any other forward.
    """
    if context_tokens < 1 or repeats < 1 or not new_token_counts or min(new_token_counts) < 1:
        raise ValueError("context_tokens, repeats and every new-token count must be >= 1")
    if context_fill not in CONTEXT_FILLS:
        raise ValueError(f"context_fill must be one of {', '.join(CONTEXT_FILLS)}, got {context_fill!r}")
    if context_fill == "random" and text_ids is not None:
        raise ContextFillUnsupported("real text (text_ids) needs a prefilled context")
    if text_ids is not None and len(text_ids) < context_tokens + max(new_token_counts):
        raise ValueError(f"text_ids holds {len(text_ids)} tokens; context_tokens + the largest count need {context_tokens + max(new_token_counts)}")
    if panel_kernels:
        lm_head = panel_or_same(lm_head if lm_head is not None else model.get_output_embeddings())
    if lean:
        lm: CachedLM = LeanLM(model, LeanDecoder.shared(model, panel_kernels), lm_head=lm_head)
    else:
        lm = target_lm(model) if lm_head is None and not transformers_forward else CachedLM(model, lm_head=lm_head)
    vocab = lm.vocab_size
    if context_fill == "random":
        if not isinstance(lm, LeanLM):
            raise ContextFillUnsupported("a random context fills our lean forward's caches only")
        lm.fill_for_timing(context_tokens, torch.Generator().manual_seed(0))
    else:
        # Arbitrary but fixed token ids: the full head's cost does not depend on which tokens they are.
        context = text_ids[:context_tokens] if text_ids is not None else [(7 * i + 11) % vocab for i in range(context_tokens)]
        lm.extend(context, num_logits=0)
    lm.extend(text_ids[context_tokens : context_tokens + 1] if text_ids is not None else [1], num_logits=1, argmax_only=argmax_only)  # warm-up
    lm.crop(context_tokens)
    costs = []
    for count in new_token_counts:
        fed = text_ids[context_tokens : context_tokens + count] if text_ids is not None else [(13 * i + 5) % vocab for i in range(count)]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            lm.extend(fed, num_logits=count, argmax_only=argmax_only)
            times.append(time.perf_counter() - started)
            lm.crop(context_tokens)
        costs.append(ForwardCost(count, statistics.median(times)))
    lm.release()
    return costs


class CostTable:
    """`verispec costs`' rows, one per setting, each announced on ``stream`` (stderr) before it is
    timed and printed as soon as it is: every setting fills a cache of ``context`` first, which on
    a long one takes minutes (at 8,192 tokens on 2 cores the command ran for over 12 minutes
    without a line), and a table printed only at the end looked like a hang and lost every
    setting timed so far to Ctrl-C."""

    def __init__(self, context: str, stream: TextIO | None = None, context_fill: str = "prefill") -> None:
        """``context_fill``: passed to every :func:`forward_costs` setting; one that cannot time
        after a "random" context is skipped with a line saying so."""
        self.context = context
        self.stream = stream if stream is not None else sys.stderr
        self.context_fill = context_fill
        self.rows: dict[str, list[ForwardCost]] = {}

    def add(self, name: str, measure: Callable[..., list[ForwardCost]], *args: Any, **kwargs: Any) -> None:
        """Time one setting: ``measure(*args, **kwargs)`` (:func:`forward_costs`, :func:`eagle_costs`)."""
        if measure is forward_costs:  # (eagle_costs' context is random features anyway)
            kwargs = {**kwargs, "context_fill": self.context_fill}
        print(f"costs: timing {name} ({self.context}) ...", file=self.stream, flush=True)
        started = time.perf_counter()
        try:
            costs = measure(*args, **kwargs)
        except ContextFillUnsupported as reason:
            return self._skip(name, str(reason))
        self.rows[name] = costs
        passes = ", ".join(f"{cost.new_tokens}: {cost.median_s * 1000:.0f} ms" for cost in costs)
        print(f"costs: {name}: {passes} ({time.perf_counter() - started:.0f} s)", file=self.stream, flush=True)

    def _skip(self, name: str, reason: str) -> None:
        print(f"costs: {name}: skipped (--context-fill {self.context_fill}: {reason})", file=self.stream, flush=True)


def stdlib_text_ids(tokenizer, count: int) -> list[int]:  # noqa: ANN001 - a Hugging Face tokenizer
    """At least ``count`` token ids of real code: Python standard-library sources, a fixed order
    (present on every machine). ValueError if they do not hold that many."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])  # where the EAGLE corpus and long-context prompts read it too
    ids: list[int] = []
    for name in ("argparse.py", "json/decoder.py", "textwrap.py", "dataclasses.py", "typing.py"):
        ids += tokenizer((root / name).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        if len(ids) >= count:
            return ids
    raise ValueError(f"the standard-library texts hold {len(ids)} tokens, fewer than the {count} needed (--context too large)")


def format_costs(rows: dict[str, list[ForwardCost]]) -> str:
    """A table: one row per setting, ms per pass and the ratio to a 1-token pass."""
    counts = [cost.new_tokens for cost in next(iter(rows.values()))]
    width = max(24, *(len(name) + 2 for name in rows))
    lines = ["setting".ljust(width) + "".join(f"{n:>14}" for n in counts)]
    for name, costs in rows.items():
        base = costs[0].median_s if costs[0].new_tokens == 1 else None
        cells = [f"{c.median_s * 1000:7.0f}ms" + (f" {c.median_s / base:4.2f}x" if base else "") for c in costs]
        lines.append(name.ljust(width) + "".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)


def eagle_costs(drafter, context_tokens: int, new_token_counts: list[int], repeats: int = 5) -> list[ForwardCost]:  # noqa: ANN001 - an EagleDrafter
    """Median seconds of one EAGLE head call over ``n`` positions plus the draft logits of the last one.

    n = 1 is one draft step; larger n is the catch-up call after a round accepted n - 1 drafts
    (as the drafter makes it: keys/values of every position, a prediction for the last only),
    attending as the drafter's sessions would over a ``context_tokens`` prompt (its far memory).
    Features are random: the cost does not depend on their values.
    """
    from verispec.engine.kv_cache import LayerKVCache

    if context_tokens < 1 or repeats < 1 or not new_token_counts or min(new_token_counts) < 1:
        raise ValueError("context_tokens, repeats and every new-token count must be >= 1")
    head, hidden = drafter.head, drafter.head.config.hidden_size
    far_memory = drafter.far_memory.for_prompt(context_tokens) if drafter.far_memory is not None else None
    generator = torch.Generator().manual_seed(0)
    cache = LayerKVCache()
    costs = []
    with torch.inference_mode():
        head(torch.randn(1, context_tokens, hidden, generator=generator), torch.randn(1, context_tokens, hidden, generator=generator), 0, cache, far_memory=far_memory, last_only=True)
        for count in new_token_counts:
            features = torch.randn(1, count, hidden, generator=generator)
            ids = torch.arange(count)[None] % drafter.vocab_size
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                started = time.perf_counter()
                predicted = head(features, drafter.embed(ids).float(), context_tokens, cache, far_memory=far_memory, last_only=True)
                drafter.draft_logits(predicted[0, -1:]).argmax()
                times.append(time.perf_counter() - started)
                cache.crop(context_tokens)
            costs.append(ForwardCost(count, statistics.median(times[1:])))
    return costs


def catch_up_cost(drafter, token_ids: list[int], repeats: int = 3) -> float:  # noqa: ANN001 - a Drafter that needs target features
    """Median seconds of a fresh session's first proposal (one draft) over ``token_ids``: what a
    feature-reading drafter pays once a request to read the prompt (the EAGLE head's catch-up).
    Features are random (the cost does not depend on their values); the tokens should be real
    text, since the head computes each distinct token's share of its input layer once."""
    from verispec.drafters.base import DraftContext
    from verispec.sampling import SamplingParams

    if len(token_ids) < 2 or repeats < 1:
        raise ValueError("catch_up_cost needs at least 2 tokens and repeats >= 1")
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(len(token_ids) - 1, drafter.embed.weight.shape[1], generator=generator)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        session = drafter.start(token_ids, SamplingParams())
        started = time.perf_counter()
        session.propose(DraftContext(token_ids, features, 0), 1, generator)
        times.append(time.perf_counter() - started)
        session.close()
    return statistics.median(times[1:])


def stand_in_text(drafter, length: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001 - a feature-reading Drafter
    """``length`` token ids of a fixed pattern and a random target feature for each # [length, hidden]:
    what drafting costs are timed on (the head's work does not depend on the values)."""
    vocab, hidden = drafter.embed.weight.shape
    return [(7 * i + 11) % vocab for i in range(length)], torch.randn(length, hidden, generator=generator)


def proposal_cost(drafter, context_tokens: int, num_drafts: int, repeats: int = 5) -> float:  # noqa: ANN001 - a Drafter that needs target features
    """Median seconds per PROPOSED token of one round's drafting, any feature-reading drafter.

    The session first reads ``context_tokens`` random features (the catch-up, untimed); each timed
    ``propose`` then drafts ``num_drafts`` tokens with nothing new to read: EAGLE's num_drafts - 1
    sequential head steps, or the parallel head's one block pass (+ its correction pass).
    """
    from verispec.drafters.base import DraftContext
    from verispec.sampling import SamplingParams

    if context_tokens < 1 or num_drafts < 1 or repeats < 1:
        raise ValueError("context_tokens, num_drafts and repeats must be >= 1")
    generator = torch.Generator().manual_seed(0)
    tokens, features = stand_in_text(drafter, context_tokens + 1, generator)
    session = drafter.start(tokens, SamplingParams())
    session.propose(DraftContext(tokens, features[:context_tokens], 0), num_drafts, generator)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        proposal = session.propose(DraftContext(tokens), num_drafts, generator)
        times.append((time.perf_counter() - started) / max(1, len(proposal.tokens)))
    session.close()
    return statistics.median(times[1:])


def served_round_cost(drafter, context_tokens: int, requests: int, num_drafts: int, repeats: int = 5) -> tuple[float, float]:  # noqa: ANN001 - a Drafter that needs target features
    """Median seconds of one server round's drafting for ``requests`` sessions, each alone and all
    together (:func:`~verispec.drafters.base.propose_batch`: one call per step for all where the
    session class offers ``propose_many``). Each session has read a ``context_tokens`` prompt (a
    different length each, untimed) and the timed round hands it 2 new features, as after a
    round that accepted one draft; it then drafts ``num_drafts`` tokens. Features are random."""
    from verispec.drafters.base import DraftContext, propose_batch
    from verispec.sampling import SamplingParams

    if context_tokens < 1 or requests < 1 or num_drafts < 1 or repeats < 1:
        raise ValueError("context_tokens, requests, num_drafts and repeats must be >= 1")
    generator = torch.Generator().manual_seed(0)
    tokens, features = stand_in_text(drafter, context_tokens + requests + 2, generator)
    medians = []
    for together in (False, True):
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sessions, rounds = [], []
            for index in range(requests):
                length = context_tokens + index  # each request at its own position
                session = drafter.start(tokens[:length], SamplingParams())
                session.propose(DraftContext(tokens[:length], features[: length - 1], 0), 1, generator)
                sessions.append(session)
                rounds.append(DraftContext(tokens[: length + 2], features[length - 1 : length + 1], length - 1))
            generators = [torch.Generator().manual_seed(index) for index in range(requests)]
            started = time.perf_counter()
            if together:
                propose_batch(sessions, rounds, [num_drafts] * requests, generators)
            else:
                for session, context, row_generator in zip(sessions, rounds, generators):
                    session.propose(context, num_drafts, row_generator)
            times.append(time.perf_counter() - started)
            for session in sessions:
                session.close()
        medians.append(statistics.median(times[1:]))
    return medians[0], medians[1]
