"""Replaying greedy decoding from recorded traces: rank drafting settings without re-running the target.

For greedy decoding everything a round depends on can be recorded once per prompt: the target's
answer (its greedy tokens); at every answer position the draft model's greedy token and its
probability given the true prefix (teacher forcing, one token at a time as in decoding); and where
that token is wrong, how the draft continues from it on its own (its next tokens and probabilities,
until their product falls below ``CONTINUATION_FLOOR`` or ``MAX_CONTINUATION`` tokens). A round that
drafts from position t proposes the draft's tokens while they agree with the answer, then its
recorded continuation past the first wrong one: which tokens a draft model drafts depends only on
the true prefix and its own choices, not on where the round started. The lookup session sees
exactly the committed tokens the engine would give it, and the adaptive controller runs unchanged,
fed modelled costs instead of clock readings. Rounds are then exact for lookup and, up to the
continuation's end (path stops at or above the floor, gamma within it), for the draft model; what
is not exact is time: the costs are a model (one pass cost per row count, one draft step cost), so
the replay ranks settings and `verispec bench` measures them. The modelled speed-up is plain
decoding's time (one 1-row pass per token) over the rounds' draft and verification costs; the
target's prefill is left out (the same for every setting), and so is the draft model's (the same for
every setting that uses it; lookup alone does not pay it, ~0.3 s a prompt here).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.bench.methods import lookup_drafter, parse_variant
from verispec.drafters.base import DraftContext, Proposal
from verispec.drafters.combined import lookup_then_model
from verispec.drafters.draft_model import round_stops
from verispec.engine.gamma import AdaptiveGamma, StepCosts
from verispec.sampling import SamplingParams

# Past a wrong draft, its own continuation is recorded until the product of its probabilities
# (the wrong token's included) is below this or it is this long: path stops >= the floor replay exactly.
CONTINUATION_FLOOR = 0.05
MAX_CONTINUATION = 16
TRACE_FORMAT = 2  # traces files of another format are recorded again
REPLAY_BASES = ("draft-model", "draft-model-adaptive", "ngram", "ngram-adaptive", "ngram+draft", "ngram+draft-adaptive")


@dataclass
class DraftTrace:
    """One prompt's greedy answer and the draft model's view of it."""

    prompt_id: str
    prompt_ids: list[int]
    answer_ids: list[int]  # the target's greedy tokens
    draft_tokens: list[int]  # [len(answer)] the draft's greedy token at each answer position, given the true prefix
    draft_probs: list[float]  # [len(answer)] its probability
    # answer position (as a string: JSON keys) where draft_tokens is wrong -> [tokens, probs] the draft
    # drafts next on its own, after its wrong token
    continuations: dict[str, list[list]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.answer_ids:
            raise ValueError(f"trace {self.prompt_id!r}: prompt_ids and answer_ids must not be empty")
        if not len(self.draft_tokens) == len(self.draft_probs) == len(self.answer_ids):
            raise ValueError(f"trace {self.prompt_id!r}: draft_tokens and draft_probs need one entry per answer token")


@dataclass(frozen=True)
class ReplayCosts:
    """Modelled seconds: a target pass over r new tokens (linear between measured row counts, and
    beyond the largest at the last segment's slope), a draft-model step, a lookup proposal (free)."""

    verify_s: dict[int, float]  # rows -> seconds, at least row count 1
    draft_step_s: float

    def __post_init__(self) -> None:
        if 1 not in self.verify_s or any(rows < 1 or seconds <= 0 for rows, seconds in self.verify_s.items()):
            raise ValueError(f"verify_s needs positive seconds for 1 row and any other row counts >= 1, got {self.verify_s}")
        if self.draft_step_s < 0:
            raise ValueError(f"draft_step_s must be >= 0, got {self.draft_step_s}")

    def verify(self, rows: int) -> float:
        counts = sorted(self.verify_s)
        if rows in self.verify_s:
            return self.verify_s[rows]
        below = max((count for count in counts if count < rows), default=counts[0])
        above = min((count for count in counts if count > rows), default=None)
        if above is None:  # past the largest measured count: the last segment's slope (flat with one count)
            below, above = (counts[-2], counts[-1]) if len(counts) > 1 else (counts[0], counts[0])
        if above == below:
            return self.verify_s[below]
        slope = (self.verify_s[above] - self.verify_s[below]) / (above - below)
        return self.verify_s[below] + slope * (rows - below)


@dataclass
class ReplayResult:
    setting: str
    prompt_id: str
    new_tokens: int
    target_calls: int
    drafted: int
    accepted: int
    seconds: float  # modelled drafting + verification
    plain_seconds: float  # modelled plain decoding: one 1-row pass per token
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds


class _TraceSession:
    """A draft model's session played back from a trace, with its stop rules (as :class:`DraftModel`'s)."""

    def __init__(self, trace: DraftTrace, path_confidence: float | None, confidence_threshold: float | None) -> None:
        self.trace, self.path_confidence, self.confidence_threshold = trace, path_confidence, confidence_threshold

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        start = len(context.token_ids) - len(self.trace.prompt_ids)  # the answer position this round drafts first
        tokens: list[int] = []
        path_prob = 1.0
        drafts = self._drafts_from(start)
        for token, token_prob in drafts:
            if len(tokens) == max_tokens:
                break
            tokens.append(token)
            path_prob *= token_prob
            if round_stops(token_prob, path_prob, self.confidence_threshold, self.path_confidence):
                break
        return Proposal(tokens=tokens, probs=None, num_forward_passes=len(tokens))

    def _drafts_from(self, start: int) -> list[tuple[int, float]]:
        """(token, probability) the draft drafts from answer position ``start`` on: the teacher-forced
        tokens while right, then the first wrong one and its recorded continuation (ending there)."""
        trace, drafts = self.trace, []
        for position in range(start, len(trace.answer_ids)):
            drafts.append((trace.draft_tokens[position], trace.draft_probs[position]))
            if trace.draft_tokens[position] != trace.answer_ids[position]:
                tokens, probs = trace.continuations.get(str(position), ([], []))
                return drafts + list(zip(tokens, probs))
        return drafts

    def close(self) -> None:
        pass


class _TraceDrafter:
    """The drafter protocol around one trace's session (what the lookup combination takes)."""

    needs_target_features = False
    name = "draft-model"

    def __init__(self, session: _TraceSession) -> None:
        self.session = session

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> _TraceSession:
        return self.session


def replay(trace: DraftTrace, setting: str, costs: ReplayCosts, gamma: int = 6, shared_costs: StepCosts | None = None) -> ReplayResult:
    """Greedy decoding of ``trace``'s answer under a bench method ``setting`` (one of
    :data:`REPLAY_BASES` with optional ``gamma``, ``path``, ``confidence``, ``tune`` settings),
    modelled with ``costs``. ``shared_costs``: the adaptive controller's cost table, carried from
    prompt to prompt as a benchmark run carries it (default: a fresh one)."""
    variant = parse_variant(setting)
    if variant.base not in REPLAY_BASES:
        raise ValueError(f"replay settings take {', '.join(REPLAY_BASES)}, got {setting!r}")
    gamma = variant.gamma or gamma
    model = _TraceDrafter(_TraceSession(trace, variant.path or None, variant.confidence or None))
    if variant.base.startswith("ngram+"):
        drafter = lookup_then_model(model)  # the engine's combination, as the bench builds it
    elif variant.base.startswith("ngram"):
        drafter = lookup_drafter(variant.tune)
    else:
        drafter = model
    controller = AdaptiveGamma(max_gamma=gamma, costs=shared_costs or StepCosts()) if variant.base.endswith("-adaptive") else None
    session = drafter.start(trace.prompt_ids, SamplingParams())
    answer, committed = trace.answer_ids, list(trace.prompt_ids)
    generator = torch.Generator()
    drafted_per_round: list[int] = []
    accepted_per_round: list[int] = []
    seconds = 0.0
    while len(committed) - len(trace.prompt_ids) < len(answer):
        position = len(committed) - len(trace.prompt_ids)
        wanted = controller.choose() if controller is not None else gamma
        num_draft = min(wanted, len(answer) - position - 1)  # as the engine: never draft what could not be emitted
        proposal = session.propose(DraftContext(list(committed)), num_draft, generator) if num_draft > 0 else Proposal([], None)
        drafts = proposal.tokens[:num_draft]
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == answer[position + num_accepted]:
            num_accepted += 1
        draft_s = proposal.num_forward_passes * costs.draft_step_s
        verify_s = costs.verify(len(drafts) + 1)
        if controller is not None:
            controller.observe(len(drafts), num_accepted, draft_s, verify_s, proposal.num_forward_passes)
        committed += answer[position : position + num_accepted + 1]
        drafted_per_round.append(len(drafts))
        accepted_per_round.append(num_accepted)
        seconds += draft_s + verify_s
    return ReplayResult(
        setting, trace.prompt_id, len(answer), len(drafted_per_round), sum(drafted_per_round), sum(accepted_per_round), seconds,
        len(answer) * costs.verify(1), drafted_per_round, accepted_per_round,
    )  # fmt: skip


def record_trace(prompt_id: str, decoder: Any, drafter: Any, prompt_ids: list[int], max_new_tokens: int) -> DraftTrace:
    """The target's greedy answer to ``prompt_ids`` (from ``decoder``, a greedy :class:`SpeculativeDecoder`:
    the target's own tokens, sooner) and ``drafter``'s (a :class:`DraftModel`) greedy token and
    probability at each answer position, fed one token at a time as decoding feeds it."""
    answer: list[int] = []
    for step in decoder.stream(prompt_ids, max_new_tokens, SamplingParams()):
        answer += step.token_ids
    session = drafter.start(prompt_ids, SamplingParams())
    tokens, probs, continuations = [], [], {}

    def greedy_step(fed: list[int]) -> tuple[int, float]:  # the draft's greedy token after ``fed`` and its probability
        step_probs = torch.softmax(session.lm.extend(session.sync(fed), num_logits=1).logits[0], dim=-1)  # [draft_vocab]
        index = int(step_probs.argmax())
        return (index if session.vocab_ids is None else int(session.vocab_ids[index])), float(step_probs[index])

    try:
        with torch.inference_mode():
            for position in range(len(answer)):
                fed = list(prompt_ids) + answer[:position]
                token, token_prob = greedy_step(fed)
                tokens.append(token)
                probs.append(token_prob)
                if token == answer[position]:
                    continue
                own, own_probs, path_prob = [token], [], token_prob  # on its own from its wrong token
                while path_prob >= CONTINUATION_FLOOR and len(own_probs) < MAX_CONTINUATION:
                    token, token_prob = greedy_step(fed + own)
                    own.append(token)
                    own_probs.append(token_prob)
                    path_prob *= token_prob
                continuations[str(position)] = [own[1:], own_probs]
    finally:
        session.close()
    return DraftTrace(prompt_id, list(prompt_ids), answer, tokens, probs, continuations)


@dataclass
class ReplaySummary:
    setting: str
    median_speedup: float
    mean_speedup: float
    tokens_per_call: float  # tau over all prompts
    acceptance_rate: float  # alpha over all prompts (0 if nothing was drafted)


def summarize_replays(results: Sequence[ReplayResult], settings: Sequence[str]) -> list[ReplaySummary]:
    summaries = []
    for setting in settings:
        rows = [row for row in results if row.setting == setting]
        if not rows:
            continue
        speedups = [row.speedup for row in rows]
        drafted = sum(row.drafted for row in rows)
        summaries.append(ReplaySummary(
            setting, statistics.median(speedups), statistics.fmean(speedups),
            sum(row.new_tokens for row in rows) / sum(row.target_calls for row in rows),
            sum(row.accepted for row in rows) / drafted if drafted else 0.0,
        ))  # fmt: skip
    return summaries
