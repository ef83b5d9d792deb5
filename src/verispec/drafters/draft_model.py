"""Classic speculative sampling's drafter: an independent small causal LM of the same tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verispec.drafters.base import DraftContext, Proposal
from verispec.drafters.draft_vocab import full_vocab_probs, leading_token_ids, reduced_lm_head
from verispec.engine.cached_lm import CachedLM
from verispec.engine.lean_lm import LeanDecoder, LeanLM, lean_product, lean_unsupported_reason, next_logits_many
from verispec.engine.prefix_cache import PrefixCache, prefix_cache_of_mb
from verispec.modelref import unwrap_model
from verispec.models.int4_screen import Int4ScreenedHead, screenable
from verispec.models.panel_linear import panel_or_same
from verispec.models.quantize import is_quantized
from verispec.sampling import SamplingParams, logits_to_probs, sample_from

TREE_ALTERNATIVES = 2  # runner-ups per draft position offered where a decoder verifies draft trees


class DraftModel:
    """Drafts autoregressively with a small LM, sampling with the target's own transform.

    ``confidence_threshold``: stop a round early once the draft gives its own latest token less
    than this probability. Long drafts then cost steps only where the draft is sure, which is
    where they get accepted. The stopping rule looks only at the draft's randomness, so the
    verifier still sees a valid draft and the output stays exact.

    ``path_confidence``: stop a round early once the product of the draft's probabilities of this
    round's tokens falls below this: the draft's own estimate that the whole draft so far is
    accepted (EAGLE-2 ranks draft paths by the same product). One unsure token ends a round as the
    per-token threshold does, and so do several fairly sure ones in a row. Exact for the same
    reason: the rule reads only the draft's own outputs.

    ``draft_vocab``: restrict the draft distribution to these token ids (a tensor), or to the
    first N ids plus the special ones (an int, see :func:`leading_token_ids`): each draft step
    then multiplies by those LM-head rows only, the costliest matrix of a small model. Exact
    either way: verification receives the probabilities actually sampled from, zero outside.

    ``lean``: run the draft through :class:`~verispec.engine.lean_lm.LeanDecoder` (our own forward
    over the model's modules with an in-place KV cache; a third less time per draft step on this
    CPU) instead of the model's transformers forward. None (default): when the model supports it
    (Llama/Qwen2/Mistral, float32 or int8 linears); True: required (ValueError naming the reason);
    False: never. Build the drafter after quantising the model: the lean forward keeps its modules.

    ``panel_kernels``: the lean forward's products and the output layer through our few-row kernels
    (:mod:`verispec.models.panel_linear`) where they run here (default); False: PyTorch's kernels.

    ``greedy_head``: ``"screened"`` (default): greedy sessions of an int8 draft on the panel kernels
    (VNNI) read the LM head through its 4-bit screen (:class:`~verispec.models.int4_screen.Int4ScreenedHead`:
    half the head's bytes, the top candidates recomputed in int8; ~3 ms of a ~30 ms draft step here);
    ``"full"``: the int8 head. Sampling sessions always use the full head (they need every probability).

    ``alternatives``: offer this many runner-up tokens per draft position
    (:attr:`Proposal.alternatives`, scored by the draft's probability of the path to them), which a
    decoder with ``tree_rows`` verifies as a one-level tree; 0 (default): none, and no work spent
    on them. Measured on HumanEval with the 0.5B draft: its second choice is the target's token at
    59% of the positions where its first is not.

    ``context_window``: the draft sees only the last N tokens of the prompt (and everything after
    it), as if the text began there; None (default): the whole prompt. Its prompt pass is what a
    long input costs the draft: the 0.5B draft's pass over a 4,096-token prompt took most of a
    64-token answer's drafting time here. Exact whatever the draft sees (verification decides).
    With a ``prefix_cache`` the window's start follows :func:`window_start`: a conversation's next
    turn keeps the start of its earlier turns (reusing their stored prefix) while the text from there
    is at most 2N tokens, instead of prefilling N tokens again every turn.
    """

    needs_target_features = False

    def __init__(
        self,
        model: Any,
        name: str = "draft-model",
        confidence_threshold: float | None = None,
        draft_vocab: int | torch.Tensor | None = None,  # [draft_vocab] int64 ids, or a count
        lean: bool | None = None,
        panel_kernels: bool = True,
        path_confidence: float | None = None,
        alternatives: int = 0,
        greedy_head: str = "screened",
        prefix_cache: PrefixCache | None = None,
        context_window: int | None = None,
    ) -> None:
        self.model, self.tokenizer = unwrap_model(model, argument="DraftModel(model)")
        if context_window is not None and (isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 1):
            raise ValueError(f"context_window must be an integer >= 1 or None, got {context_window!r}")
        self.context_window = context_window
        if greedy_head not in ("screened", "full"):
            raise ValueError(f"greedy_head must be 'screened' or 'full', got {greedy_head!r}")
        self.alternatives = checked_alternatives(alternatives)
        self.name = name
        self.confidence_threshold = checked_threshold(confidence_threshold, "confidence_threshold")
        self.path_confidence = checked_threshold(path_confidence, "path_confidence")
        lm_head = self.model.get_output_embeddings()
        self.vocab_size = int(lm_head.out_features)
        if isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool):
            draft_vocab = leading_token_ids(self.vocab_size, draft_vocab, self._special_ids())
        elif draft_vocab is not None and not isinstance(draft_vocab, torch.Tensor):
            raise ValueError(f"draft_vocab must be a token count, a tensor of token ids or None, got {type(draft_vocab).__name__}")
        # None: the model's own head; else one copy of the chosen rows, int8 if the model's head is.
        self.vocab_ids, self.lm_head = reduced_lm_head(lm_head, draft_vocab, quantize=is_quantized(lm_head))
        if lean not in (None, True, False):
            raise ValueError(f"lean must be True, False or None, got {lean!r}")
        if panel_kernels not in (True, False):
            raise ValueError(f"panel_kernels must be True or False, got {panel_kernels!r}")
        use_lean = lean if lean is not None else lean_unsupported_reason(self.model) is None
        # raises naming the reason if lean=True cannot work
        self.lean_decoder = LeanDecoder.shared(self.model, panel_kernels) if use_lean else None
        if self.lean_decoder is not None:  # the head reads the lean forward's features: its products' rule
            self.lm_head = lean_product(self.lm_head, panel_kernels)
        elif panel_kernels:
            self.lm_head = panel_or_same(self.lm_head)
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a PrefixCache or None, got {type(prefix_cache).__name__}")
        if prefix_cache is not None and self.lean_decoder is None:
            raise ValueError("prefix_cache needs the draft on the lean forward")
        # Sessions start from (and store) prefixes of earlier prompts and answers: the draft's own
        # prompt pass is what a short answer after a long prompt cannot earn back. Not row-exact:
        # the draft's logits never reach the output, only what it proposes.
        self.prefix_cache = prefix_cache
        # What greedy sessions multiply by: the 4-bit screen where the head is int8 on the VNNI kernels.
        self.greedy_head = Int4ScreenedHead(self.lm_head) if greedy_head == "screened" and screenable(self.lm_head) else self.lm_head

    def _special_ids(self) -> list[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        return ids + list(getattr(self.tokenizer, "all_special_ids", None) or [])

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "DraftModelSession":
        # The model's own head unless a draft vocabulary is set; greedy sessions its screen if any.
        head = self.greedy_head if sampling.is_greedy else self.lm_head
        if self.lean_decoder is not None:
            lm: CachedLM = LeanLM(self.model, self.lean_decoder, lm_head=head, prefixes=self.prefix_cache, row_exact=False)
        else:
            lm = CachedLM(self.model, lm_head=head)
        first = window_start(prompt_ids, self.context_window, self.prefix_cache)
        return DraftModelSession(lm, sampling, self.confidence_threshold, self.vocab_ids, self.vocab_size, self.path_confidence, self.alternatives, first)


@dataclass(frozen=True)
class DraftModelSettings:
    """The :class:`DraftModel` options a run sets once for every drafter it builds (the CLI's
    ``--draft-*`` options, a bench method's ``:key=value`` overrides); see :class:`DraftModel`."""

    confidence_threshold: float | None = None
    path_confidence: float | None = None
    draft_vocab: int | None = None  # a token count (the first N ids + the special ones)
    lean: bool | None = None
    panel_kernels: bool = True
    alternatives: int = 0  # runner-ups per draft position for draft trees (TREE_ALTERNATIVES where tree_rows > 0)
    greedy_head: str = "screened"  # or "full"
    prefix_cache_mb: int = 0  # each built drafter's own PrefixCache of this size where the draft runs the lean forward; 0: none
    context_window: int | None = None  # the draft sees the last N prompt tokens only; None: the whole prompt

    def build(self, model: Any, name: str = "draft-model") -> DraftModel:
        prefixes = prefix_cache_of_mb(self.prefix_cache_mb)
        drafter = DraftModel(
            model, name=name, confidence_threshold=self.confidence_threshold, draft_vocab=self.draft_vocab, lean=self.lean,
            panel_kernels=self.panel_kernels, path_confidence=self.path_confidence, alternatives=self.alternatives, greedy_head=self.greedy_head,
            context_window=self.context_window,
        )
        if drafter.lean_decoder is not None:
            drafter.prefix_cache = prefixes
        return drafter


WINDOW_STEPS = 4  # with a prefix cache, a window's start moves in steps of a quarter window


def window_start(prompt_ids: list[int], context_window: int | None, prefixes: PrefixCache | None = None) -> int:
    """Where the draft's text begins for a prompt: the draft sees ``prompt_ids[start:]``.

    No window, or a prompt no longer than it: 0. Without a prefix cache: the last ``context_window``
    tokens, exactly. With one, starts lie on a grid of ``context_window // WINDOW_STEPS`` positions,
    so that the turns of a conversation (each prompt the previous one plus an answer and a follow-up)
    can start where the earlier ones did and reuse what they stored. Of the grid starts from the
    first one leaving at most a window of text back to the last one leaving at most two, the one
    with the fewest tokens left to compute after its longest stored prefix wins, the latest among
    equals. A cold prompt thus gets the draft seeing 3/4 to 1 window; a conversation's draft
    prefills a window again only when its text from the kept start outgrows two windows, not every
    turn once it outgrows one.
    """
    if context_window is None or len(prompt_ids) <= context_window:
        return 0
    latest = len(prompt_ids) - context_window
    if prefixes is None:
        return latest
    step = max(1, context_window // WINDOW_STEPS)
    newest = -(-latest // step) * step  # the first grid start at or after latest: at most a window to see
    oldest = max(0, latest - context_window)  # at most two windows to see
    def to_compute(start: int) -> int:  # the draft's text from start, less what its cache restores
        return len(prompt_ids) - start - prefixes.longest_match(prompt_ids[start:])

    return min(range(newest, oldest - 1, -step), key=lambda start: (to_compute(start), -start))


def round_stops(token_prob: float, path_prob: float, confidence_threshold: float | None, path_confidence: float | None) -> bool:
    """Whether a draft-model round ends after a token of probability ``token_prob`` (``path_prob``:
    the round's tokens' so far): :class:`DraftModel`'s two stop rules (None: that rule is off)."""
    if confidence_threshold is not None and token_prob < confidence_threshold:
        return True
    return path_confidence is not None and path_prob < path_confidence


def checked_threshold(value: float | None, argument: str) -> float | None:
    """A drafter's stop threshold (``path_confidence``, ``confidence_threshold``): None or a
    number in [0, 1), ValueError naming ``argument`` otherwise (a bool is not a threshold)."""
    if value is not None and (isinstance(value, bool) or not 0.0 <= value < 1.0):
        raise ValueError(f"{argument} must be in [0, 1) or None, got {value!r}")
    return value


def checked_alternatives(alternatives: int) -> int:
    """A drafter's ``alternatives`` argument (runner-ups offered per draft), ValueError unless an integer >= 0."""
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise ValueError(f"alternatives must be an integer >= 0, got {alternatives!r}")
    return alternatives


def tree_alternatives(tree_rows: int) -> int:
    """Runner-ups per draft position a drafter should offer: TREE_ALTERNATIVES where the decoder
    verifies draft trees (``tree_rows`` > 0), none otherwise (no softmax spent on them)."""
    return TREE_ALTERNATIVES if tree_rows else 0


def pick_draft(
    logits: torch.Tensor,  # [draft_vocab]: one draft step's logits
    sampling: SamplingParams,
    generator: torch.Generator,
    needs_prob: bool,  # greedy: whether the caller reads the token's probability (stop rules, path scores)
    alternatives: int,  # runner-ups wanted
    vocab_ids: torch.Tensor | None,  # [draft_vocab] int64 token id of each entry; None: entry i is token i
    vocab_size: int,  # the target's vocabulary (width of q_draft when sampling)
) -> tuple[int, float, torch.Tensor | None, list[tuple[int, float]]]:
    """One draft step's choice, for every drafter that reads logits: (token id, its probability —
    1.0 when greedy and not ``needs_prob`` —, when sampling q_draft # [vocab_size] over the full
    vocabulary, the runner-ups as :func:`runner_ups` gives them). One softmax serves the token's
    probability and the runner-ups; greedy without either needs none."""
    if sampling.is_greedy:
        index = int(logits.argmax())
        token = index if vocab_ids is None else int(vocab_ids[index])
        if not needs_prob and not alternatives:
            return token, 1.0, None, []
        probs = torch.softmax(logits, -1)  # [draft_vocab]
        return token, (float(probs[index]) if needs_prob else 1.0), None, runner_ups(probs, index, alternatives, vocab_ids)
    probs = logits_to_probs(logits, sampling)  # [draft_vocab]
    index = int(sample_from(probs, generator))
    token = index if vocab_ids is None else int(vocab_ids[index])
    return token, float(probs[index]), full_vocab_probs(probs, vocab_ids, vocab_size), runner_ups(probs, index, alternatives, vocab_ids, sampled=True)


def runner_ups(
    probs: torch.Tensor,  # [draft_vocab]: one draft step's distribution (q_draft when sampling)
    index: int,  # the drafted entry (the argmax, or the sampled one)
    count: int,  # runner-ups wanted
    vocab_ids: torch.Tensor | None,  # [draft_vocab] int64 token id of each entry; None: entry i is token i
    sampled: bool = False,
) -> list[tuple[int, float]]:
    """(token id, probability) of the ``count`` most probable entries other than the drafted ``index``
    (excluded by index, not by rank: under a tie topk may rank another entry first): the
    alternatives a drafter offers for draft trees (:attr:`Proposal.alternatives`). ``sampled``:
    entries q_draft gives no mass (cut by top-k / top-p) are not offered, and none when the draft
    vocabulary is too small to have others."""
    count = min(count, probs.shape[-1] - 1)
    if count <= 0:
        return []
    ranked = [other for other in probs.topk(count + 1).indices.tolist() if other != index and not (sampled and probs[other] <= 0)]
    return [(other if vocab_ids is None else int(vocab_ids[other]), float(probs[other])) for other in ranked[:count]]


class DraftModelSession:
    def __init__(
        self,
        lm: CachedLM,
        sampling: SamplingParams,
        confidence_threshold: float | None,
        vocab_ids: torch.Tensor | None = None,  # [draft_vocab] int64: what logit index i means; None = i itself
        vocab_size: int | None = None,  # the full vocabulary q_draft is reported over
        path_confidence: float | None = None,
        alternatives: int = 0,
        first_token: int = 0,  # the draft's text starts at this position of the sequence (DraftModel's context_window)
    ) -> None:
        self.lm = lm
        self.first_token = first_token
        self.alternatives = alternatives
        self.sampling = sampling
        self.confidence_threshold = confidence_threshold
        self.path_confidence = path_confidence
        self.vocab_ids = vocab_ids
        self.vocab_size = vocab_size

    def sync(self, token_ids: list[int]) -> list[int]:
        """Roll the draft's cache back to its longest common prefix with the sequence ``token_ids``
        (from its window's start on) and return the ids it still has to feed (:meth:`CachedLM.sync`)."""
        return self.lm.sync(token_ids[self.first_token :])

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        return DraftModelSession.propose_many([self], [context], [max_tokens], [generator])[0]

    @staticmethod
    def propose_many(
        sessions: list["DraftModelSession"], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]
    ) -> list[Proposal]:
        """One proposal per session, drafted in lockstep: each step feeds every session still drafting
        in one pass where their LMs share a fused lean decoder (:func:`next_logits_many`; batched
        serving), else one pass each. Each session keeps its own stop rules, sampling and generator,
        so its proposal is the one :meth:`propose` alone makes."""
        # Rollback and catch-up in one step: drop rejected drafts, feed what the target committed.
        pending = [session.sync(context.token_ids) for session, context in zip(sessions, contexts)]
        tokens: list[list[int]] = [[] for _ in sessions]
        step_probs: list[list[torch.Tensor]] = [[] for _ in sessions]
        runner_ups: list[list[tuple[int, int, float]]] = [[] for _ in sessions]
        path_probs = [1.0] * len(sessions)  # each draft's probability of its round's tokens so far
        drafting = [index for index, count in enumerate(max_tokens) if count > 0]
        while drafting:
            logits = next_logits_many([sessions[i].lm for i in drafting], [pending[i] for i in drafting])  # each [draft_vocab]
            still = []
            for index, row in zip(drafting, logits):
                session = sessions[index]
                token, token_prob, probs, alternatives = session._pick(row, generators[index])
                # (position, token, the draft's probability of the path to it), best first
                runner_ups[index] += [(len(tokens[index]), alternative, path_probs[index] * prob) for alternative, prob in alternatives]
                tokens[index].append(token)
                if probs is not None:
                    step_probs[index].append(probs)
                pending[index] = [token]
                path_probs[index] *= token_prob
                if len(tokens[index]) < max_tokens[index] and not session._stops(token_prob, path_probs[index]):
                    still.append(index)
            drafting = still
        return [
            Proposal(tokens=drafted, probs=torch.stack(probs) if probs else None, num_forward_passes=len(drafted), alternatives=alternatives)
            for drafted, probs, alternatives in zip(tokens, step_probs, runner_ups)
        ]

    def _pick(self, logits: torch.Tensor, generator: torch.Generator) -> tuple[int, float, torch.Tensor | None, list[tuple[int, float]]]:
        """:func:`pick_draft` with this session's sampling, runner-ups and vocabulary; the token's
        probability is needed by the stop rules only."""
        stop_rules = self.confidence_threshold is not None or self.path_confidence is not None
        return pick_draft(logits, self.sampling, generator, stop_rules, self.alternatives, self.vocab_ids, self.vocab_size)

    def _stops(self, token_prob: float, path_prob: float) -> bool:
        return round_stops(token_prob, path_prob, self.confidence_threshold, self.path_confidence)

    def close(self) -> None:
        self.lm.release()
