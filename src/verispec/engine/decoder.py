"""The speculative decoding loop: draft -> verify (one target pass) -> accept -> roll back.

Invariant between rounds: the target's cache holds the committed sequence minus its last
token; that token is fed at the start of the next pass together with the drafts, so one pass
scores it and all drafts, and every pass emits between 1 and gamma+1 tokens. With no drafter
(or gamma 0) the same loop is plain autoregressive decoding, our baseline.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.engine.cached_lm import Branch
from verispec.engine.lean_lm import prefix_reuse_unsupported_reason, target_lm
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.gamma import AdaptiveGamma
from verispec.engine.monitor import AcceptanceMonitor, AcceptanceSnapshot
from verispec.engine.stats import GenerationStats
from verispec.engine.stopping import StopCondition
from verispec.modelref import unwrap_model
from verispec.rejection import accept_drafts, greedy_verify, rejection_sample, sample_through_candidates
from verispec.sampling import SamplingParams, logits_to_probs, sample_from

_NO_DRAFT = Proposal(tokens=[], probs=None)
DEFAULT_TREE_ROWS = 0  # off: measured no faster on HumanEval (README, Performance, "one-level draft trees")
# tree_max_context for 8-row trees where rows are nearly free (what `--tree-rows auto` uses): trees
# decoded in 12% / 5% / 3% less time than chains at 2K / 4K / 8K tokens and in 7% / 6% more at 12K /
# 16K (README, Performance, 2026-12-06 (early morning)); the limit sits between 8K and 12K.
LONG_CONTEXT_TREE_LIMIT = 10240


@dataclass
class StepResult:
    """One verification round, as streamed."""

    token_ids: list[int]  # tokens this round emitted (accepted drafts + recovered/bonus), after stop cuts
    num_drafted: int
    num_accepted: int
    finish_reason: str | None  # None while running, then "stop" or "length"
    stats: GenerationStats  # running totals for the whole generation
    rolling: AcceptanceSnapshot | None = None  # this generation's recent rounds, when a monitor watches


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    finish_reason: str  # "stop" (a stop token/string) or "length" (max_new_tokens reached)
    stats: GenerationStats
    text: str | None = None  # decoded new tokens (stop strings trimmed), when a tokenizer is known


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with ``drafter`` proposing ``gamma`` tokens a round.

    ``target`` is a transformers causal LM or a ``LoadedModel``; ``drafter`` is any object
    implementing the :class:`~verispec.drafters.base.Drafter` protocol, or None for plain decoding.
    ``adaptive_gamma``: choose 0..gamma drafts each round from measured costs and acceptance
    (:class:`~verispec.engine.gamma.AdaptiveGamma`) instead of always drafting gamma; pass an
    ``AdaptiveGamma`` to set its priors or share its cost table (``costs``) between decoders.
    ``monitor``: an :class:`~verispec.engine.monitor.AcceptanceMonitor` that every round is reported
    to, in the scopes ``"global"`` and ``"generation:<n>"`` (forgotten when the generation ends);
    each step then carries the generation's rolling snapshot.
    ``screen_lm_head``: greedy passes take the target LM head's argmax through an int8 screen where
    the target runs our float32 panel kernels (:mod:`verispec.models.screened_head`): the same tokens,
    ~20 ms less per pass of the 1.5B target here; False computes every logit in float32.
    ``tree_rows``: passes fill up to this many rows (the chain's included) with the drafter's
    runner-up tokens (:attr:`Proposal.alternatives`, e.g. ``DraftModel(alternatives=2)``,
    ``EagleDrafter(alternatives=2)``; a drafter that offers none drafts chains as before; a
    feature-reading drafter is handed a kept branch row's feature where the rejected draft's
    stood), best-scored first, where the target runs the
    fused lean stack: a one-level draft tree. When the chain is rejected at a position where a
    runner-up is the target's token, that token and the target's next one are emitted too (exact:
    each branch row is computed bit for bit as that token fed in the chain; when sampling, the
    recovered token is drawn through the runner-ups standing there, still exactly from the
    residual: :func:`~verispec.rejection.sample_through_candidates`). 0: chains only.
    ``tree_max_context``: draft trees only while the sequence is shorter than this many tokens, chains
    from there (None: no limit). Why: every spare row attends over the whole context, so its cost
    grows with the length while its gain (a kept runner-up, ~1 row in 10) does not: on a Zen 4 EPYC
    trees decoded 12% faster than chains at 2K tokens and 6% slower at 16K (README, Performance,
    2026-12-06 (early morning)).
    ``prefix_cache``: a :class:`~verispec.engine.prefix_cache.PrefixCache` for the target (where it
    runs the fused lean stack): a prompt starts from the longest prefix of an earlier sequence
    (a shared system prompt, a chat's earlier turns) and only the rest is prefilled; the tokens are
    the same as without it (every pass then runs row-exact). None: every prompt is prefilled whole.
    """

    def __init__(
        self,
        target: Any,
        drafter: Drafter | None = None,
        gamma: int = 4,
        tokenizer: Any | None = None,
        adaptive_gamma: bool | AdaptiveGamma = False,
        monitor: AcceptanceMonitor | None = None,
        screen_lm_head: bool = True,
        tree_rows: int = DEFAULT_TREE_ROWS,
        prefix_cache: PrefixCache | None = None,
        tree_max_context: int | None = None,
    ) -> None:
        self.target, target_tokenizer = unwrap_model(target, argument="target")
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a PrefixCache or None, got {type(prefix_cache).__name__}")
        if prefix_cache is not None and (reason := prefix_reuse_unsupported_reason(self.target)) is not None:
            raise ValueError(f"prefix_cache cannot serve this target: {reason}")
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer if tokenizer is not None else target_tokenizer
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        self.drafter = drafter
        self.gamma = gamma
        self.monitor = monitor
        if screen_lm_head not in (True, False):
            raise ValueError(f"screen_lm_head must be True or False, got {screen_lm_head!r}")
        self.screen_lm_head = screen_lm_head
        if isinstance(tree_rows, bool) or not isinstance(tree_rows, int) or tree_rows < 0:
            raise ValueError(f"tree_rows must be an integer >= 0, got {tree_rows!r}")
        self.tree_rows = tree_rows
        if tree_max_context is not None and (isinstance(tree_max_context, bool) or not isinstance(tree_max_context, int) or tree_max_context < 1):
            raise ValueError(f"tree_max_context must be an integer >= 1 or None, got {tree_max_context!r}")
        self.tree_max_context = tree_max_context
        self._generations = 0  # numbers the monitor's per-generation scopes
        # One controller per decoder: the measured costs (draft step, verify per row count) are
        # properties of the models and machine, so they carry over from one generation to the next.
        if isinstance(adaptive_gamma, AdaptiveGamma) and adaptive_gamma.max_gamma != gamma:
            raise ValueError(f"adaptive_gamma.max_gamma ({adaptive_gamma.max_gamma}) must equal gamma ({gamma})")
        controller = adaptive_gamma if isinstance(adaptive_gamma, AdaptiveGamma) else AdaptiveGamma(gamma)
        self._gamma_controller = controller if adaptive_gamma is not False and drafter is not None else None
        draft_tokenizer = getattr(drafter, "tokenizer", None)
        if self.tokenizer is not None and draft_tokenizer is not None:
            from verispec.models import check_same_tokenizer

            check_same_tokenizer(draft_tokenizer, self.tokenizer, names=("draft", "target"))

    def default_stop(self) -> list[int]:
        """The target's end-of-sequence ids (from its generation config)."""
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[int | str] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` new tokens after ``input_ids``.

        ``stop``: token ids and/or strings that end generation (the stop token is kept, a stop
        string is trimmed from ``text``); None means the target's EOS ids, ``[]`` never stops early.
        """
        token_ids: list[int] = []
        step = None
        for step in self.stream(input_ids, max_new_tokens, sampling, stop):
            token_ids.extend(step.token_ids)
        assert step is not None and step.finish_reason is not None
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            text = self._stop_condition(stop).trim_text(text)
        return GenerationResult(token_ids=token_ids, finish_reason=step.finish_reason, stats=step.stats, text=text)

    def stream(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[int | str] | None = None,
    ) -> Iterator[StepResult]:
        """Yield one :class:`StepResult` per target call, as soon as its tokens are accepted."""
        prompt = validate_prompt(input_ids, self.target.get_output_embeddings().out_features)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampling = sampling if sampling is not None else SamplingParams()
        stopper = self._stop_condition(stop)
        return self._rounds(prompt, max_new_tokens, sampling, stopper)

    def _stop_condition(self, stop: Sequence[int | str] | None) -> StopCondition:
        return StopCondition(self.default_stop() if stop is None else stop, self.tokenizer)

    def _rounds(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, stopper: StopCondition) -> Iterator[StepResult]:
        generator = sampling.make_generator()
        stats = GenerationStats(prompt_tokens=len(prompt))
        target = target_lm(self.target, screen_lm_head=self.screen_lm_head, prefixes=self.prefix_cache)
        wants_features = bool(self.drafter is not None and self.drafter.needs_target_features)
        tree_rows = min(self.tree_rows, target.max_branch_rows())
        session = self.drafter.start(prompt, sampling) if self.drafter is not None else None
        tokens = list(prompt)
        controller = self._gamma_controller
        if controller is not None:
            controller.start_sequence()
        self._generations += 1
        scopes = ("global", f"generation:{self._generations}")
        resumed = time.perf_counter()  # total_s counts our work, not the time a consumer holds a step
        try:
            # Target features the drafter has not been handed yet (rounds without drafting included).
            unseen_features: list[torch.Tensor] = []  # each [n, hidden]
            with _timed(stats, "prefill_s"):
                if len(prompt) > 1:
                    prefill = target.extend(prompt[:-1], num_logits=0)
                    stats.reused_prompt_tokens = getattr(target, "reused_tokens", 0)
                    if wants_features:
                        unseen_features.append(prefill.features)
            while True:
                budget = max_new_tokens - stats.new_tokens
                wanted = controller.choose() if controller is not None else self.gamma
                num_draft = min(wanted, budget - 1)  # never draft what we could not emit
                proposal, draft_elapsed = _NO_DRAFT, 0.0
                if session is not None and num_draft > 0:
                    context = draft_context(tokens, unseen_features, len(target))
                    with _timed(stats, "draft_s") as draft_clock:
                        proposal = session.propose(context, num_draft, generator)
                    draft_elapsed = draft_clock.elapsed
                    proposal = checked_proposal(proposal, num_draft, target.vocab_size, self.drafter.name)
                with _timed(stats, "verify_s") as verify_clock:
                    drafts = proposal.tokens
                    short_enough = self.tree_max_context is None or len(tokens) < self.tree_max_context
                    branches = pick_branches(proposal, tree_rows - len(drafts) - 1) if short_enough else []
                    if branches:
                        forward = target.extend_branches([tokens[-1]] + drafts, branches, argmax_only=sampling.is_greedy)
                        output, num_accepted, kept = verify_tree(drafts, proposal.probs, forward.logits, branches, sampling, generator)
                        stats.branches_verified += len(branches)
                        fed_rows = list(range(num_accepted + 1))  # rows of the pass whose tokens are now committed
                        for depth, number in enumerate(kept):  # a runner-up path was taken: its tokens and the one after were emitted
                            target.keep_branch(len(tokens) + len(drafts) + number, len(tokens) + num_accepted + depth)
                            fed_rows.append(len(drafts) + 1 + number)  # the branch row stands where the rejected draft's stood
                        num_accepted += len(kept)
                        stats.branches_accepted += len(kept)
                        kept_features = forward.features[fed_rows] if wants_features else None
                    else:
                        forward = target.extend([tokens[-1]] + drafts, num_logits=len(drafts) + 1, argmax_only=sampling.is_greedy)
                        output, num_accepted = verify_drafts(drafts, proposal.probs, forward.logits, sampling, generator)
                        kept_features = forward.features[: num_accepted + 1] if wants_features else None
                    # Keep the cache at committed-minus-last: drop the rejected drafts' keys/values.
                    target.crop(len(tokens) + num_accepted)
                    if kept_features is not None:
                        unseen_features.append(kept_features)
                new_tokens, stopped = stopper.cut(output[: num_accepted + 1])
                tokens.extend(new_tokens)
                stats.record_round(len(drafts), num_accepted, len(new_tokens), proposal.num_forward_passes)
                if controller is not None:
                    controller.observe(len(drafts), num_accepted, draft_elapsed, verify_clock.elapsed, proposal.num_forward_passes)
                finish = "stop" if stopped else "length" if stats.new_tokens >= max_new_tokens else None
                stats.total_s += time.perf_counter() - resumed
                rolling = None
                if self.monitor is not None:
                    self.monitor.record(scopes, len(drafts), num_accepted, len(new_tokens), draft_elapsed + verify_clock.elapsed)
                    rolling = self.monitor.snapshot(scopes[1])
                yield StepResult(new_tokens, len(drafts), num_accepted, finish, stats, rolling)
                if finish is not None:
                    return
                resumed = time.perf_counter()
        finally:
            # Runs on normal exit, on error, and when a consumer abandons the stream (generator close).
            if session is not None:
                session.close()
            target.release()
            if self.monitor is not None:
                self.monitor.forget(scopes[1])


def pick_branches(proposal: Proposal, spare_rows: int) -> list[Branch]:
    """The tree nodes to verify beside the chain, best-first: the best-scored of the proposal's
    alternatives and of the continuations of nodes already picked, ``spare_rows`` of them, as
    :data:`~verispec.engine.cached_lm.Branch` (row index in the pass, token, parent branch): the
    alternative to draft i is fed at row i + 1 (row 0 is the last committed token), a continuation
    beside its parent's row (its parent the picked branch's number). A node comes only with its parent."""
    if spare_rows <= 0 or not proposal.alternatives:
        return []
    nodes = [(index + 1, token, -1, score) for index, token, score in proposal.alternatives]
    nodes += [(None, token, parent, score) for parent, token, score in proposal.continuations]
    children: dict[int, list[int]] = {}
    for number, (_, _, parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(number)
    frontier = [(-nodes[number][3], number) for number in children.get(-1, [])]
    heapq.heapify(frontier)
    picked: dict[int, int] = {}  # node number -> branch number
    branches: list[Branch] = []
    while frontier and len(branches) < spare_rows:
        _, number = heapq.heappop(frontier)
        row, token, parent, _ = nodes[number]
        parent_branch = -1 if parent < 0 else picked[parent]
        picked[number] = len(branches)
        branches.append((row if parent < 0 else branches[parent_branch][0], token, parent_branch))
        for child in children.get(number, []):
            heapq.heappush(frontier, (-nodes[child][3], child))
    return branches


def verify_tree(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab_draft] or None
    target_logits: torch.Tensor,  # [k+1+m, vocab]: the chain's rows, then one per branch
    branches: list[Branch],  # m (row, token, parent), as pick_branches gives them
    sampling: SamplingParams,
    generator: torch.Generator,
) -> tuple[list[int], int, list[int]]:
    """Verify a draft tree: ``(emitted tokens, chain drafts accepted, kept branches)``.

    The chain is verified as :func:`verify_drafts` does. At its first rejected draft the branches
    standing there compete for the recovered token: greedy, the one equal to the target's argmax;
    sampling, :func:`~verispec.rejection.sample_through_candidates` draws the recovered token from
    the residual through them, best-scored first. A taken branch's own row then gives the next
    token the same way, through that branch's children (drawn from p_target of that row: every
    token on a kept path is deterministic, so each draw is exact as it stands), until a token is no
    child's. ``kept`` lists the taken branches in order (their indices in ``branches``), so the
    tokens end ``[..accepted drafts, kept branch tokens.., next]``.
    (Every row's logits come from the pass's one LM-head call: a second call for a taken branch's
    row alone would read the head's weights again; on the Zen 4 EPYC the 1.5B target's head took
    21-31 ms a call whether it computed 1 or 13 rows: README, Performance, 2026-12-06 (morning).)"""
    k = len(draft_tokens)

    def standing(parent: int) -> list[int]:  # the branches to offer after the chain's rejection / after branch `parent`
        return [number for number, (row, _, up) in enumerate(branches) if up == parent and (parent >= 0 or row == num_accepted + 1)]

    if sampling.is_greedy:
        output, num_accepted = verify_drafts(draft_tokens, None, target_logits[: k + 1], sampling, generator)
        kept: list[int] = []
        candidates = standing(-1) if num_accepted < k else []
        while (taken := next((number for number in candidates if branches[number][1] == output[-1]), None)) is not None:
            kept.append(taken)
            output.append(int(target_logits[k + 1 + taken].argmax()))
            candidates = standing(taken)
        return output, num_accepted, kept
    target_probs = logits_to_probs(target_logits[: k + 1], sampling)  # [k+1, vocab]
    if draft_probs is not None:
        draft_probs = _match_vocab(draft_probs, target_probs.shape[-1])[None]
    accepted, p_next = accept_drafts(torch.tensor([draft_tokens], dtype=torch.long), draft_probs, target_probs[None], generator)
    num_accepted = int(accepted[0])
    output, kept, law = draft_tokens[:num_accepted], [], p_next[0]  # law # [vocab]: what the next token is drawn from
    candidates = standing(-1) if num_accepted < k else []
    while True:
        if not candidates and kept:  # a leaf's next token: p_target of its row
            output.append(int(sample_from(law[None], generator)[0]))
            return output, num_accepted, kept
        token, taken = sample_through_candidates(law, torch.tensor([branches[number][1] for number in candidates], dtype=torch.long), generator)
        output.append(token)
        if taken is None:
            return output, num_accepted, kept
        kept.append(candidates[taken])
        law = logits_to_probs(target_logits[k + 1 + kept[-1]], sampling)
        candidates = standing(kept[-1])


def draft_context(tokens: list[int], unseen_features: list[torch.Tensor], target_length: int) -> DraftContext:
    """Hand the drafter the committed tokens and the features it has not seen (then forget them)."""
    if not unseen_features:
        return DraftContext(tokens)
    features = torch.cat(unseen_features) if len(unseen_features) > 1 else unseen_features[0]  # [n, hidden]
    unseen_features.clear()
    return DraftContext(tokens, features, target_length - len(features))


def verify_drafts(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab_draft] or None
    target_logits: torch.Tensor,  # [k+1, vocab]
    sampling: SamplingParams,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Verify one sequence's drafts; return (emitted tokens, number of accepted drafts)."""
    drafts = torch.tensor([draft_tokens], dtype=torch.long)  # [1, k]
    if sampling.is_greedy:
        output, num_accepted = greedy_verify(drafts, target_logits.unsqueeze(0))
    else:
        target_probs = logits_to_probs(target_logits, sampling).unsqueeze(0)  # [1, k+1, vocab]
        if draft_probs is not None:
            draft_probs = _match_vocab(draft_probs, target_probs.shape[-1]).unsqueeze(0)
        output, num_accepted = rejection_sample(drafts, draft_probs, target_probs, generator)
    accepted = int(num_accepted[0])
    return output[0, : accepted + 1].tolist(), accepted


def checked_proposal(proposal: Proposal, max_tokens: int, vocab_size: int, drafter_name: str) -> Proposal:
    """Refuse oversized proposals; cut one at the first token the target's vocabulary lacks.

    Cutting is exact: the verifier then samples that position from p_target itself.
    """
    if len(proposal.tokens) > max_tokens:
        raise RuntimeError(f"drafter {drafter_name!r} proposed {len(proposal.tokens)} tokens, asked for at most {max_tokens}")
    in_vocab = [0 <= token < vocab_size for token in proposal.tokens]
    keep = in_vocab.index(False) if not all(in_vocab) else len(in_vocab)
    # Tree nodes stay while their token is the target's, their parent stays and their path is no
    # longer than the kept chain (a node's reach: the draft index its path ends beside).
    reach = proposal.node_reach()
    renumbered: dict[int, int] = {}
    for number, (index, token, _) in enumerate(proposal.alternatives):
        if index < keep and 0 <= token < vocab_size:
            renumbered[number] = len(renumbered)
    alternatives = [proposal.alternatives[number] for number in renumbered]
    continuations = []
    for number, (parent, token, score) in enumerate(proposal.continuations, start=len(proposal.alternatives)):
        if parent in renumbered and reach[number] < keep and 0 <= token < vocab_size:
            renumbered[number] = len(renumbered)
            continuations.append((renumbered[parent], token, score))
    if keep == len(in_vocab) and len(renumbered) == len(reach):
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:keep]
    return Proposal(proposal.tokens[:keep], probs, proposal.num_forward_passes, alternatives, continuations)


def _match_vocab(draft_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Align a drafter's vocabulary width with the target's.

    Exact either way: padding adds zero-probability columns; dropping columns the target does
    not have only removes tokens that p_target gives zero mass, which never enter the residual.
    """
    width = draft_probs.shape[-1]
    if width < vocab:
        return torch.nn.functional.pad(draft_probs, (0, vocab - width))
    return draft_probs[..., :vocab]


def validate_prompt(input_ids: Sequence[int], vocab_size: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.reshape(-1).tolist()
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("input_ids must not be empty: the model needs at least one token to continue")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size})")
    return prompt


@dataclass
class _Clock:
    elapsed: float = 0.0


@contextmanager
def _timed(stats: GenerationStats, field_name: str) -> Iterator[_Clock]:
    """Time a block, add it to ``stats.<field_name>`` and expose it as ``clock.elapsed``."""
    clock = _Clock()
    start = time.perf_counter()
    try:
        yield clock
    finally:
        clock.elapsed = time.perf_counter() - start
        setattr(stats, field_name, getattr(stats, field_name) + clock.elapsed)
