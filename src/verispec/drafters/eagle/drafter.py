"""The ``eagle`` drafter: drafts with an :class:`EagleHead` on the target's own features.

Positions, for a committed sequence x_0 .. x_{L-1} whose target features f_0 .. f_{L-2} exist
(the verification passes computed them; the last token is not fed to the target yet):

- catch-up: the head reads (f_i, x_{i+1}) for every real feature it has not seen, in one call;
  its last output is f̂_{L-1}, whose logits give the first draft d_1 = x̂_L;
- each further draft: the head reads (f̂_{L-2+k}, d_k) and predicts the next feature.

The head's cache keeps only positions with real features between rounds (drafted positions are
cropped), so EAGLE always conditions on the target's features once they exist.

``far_memory`` (long inputs): every head call of a session, the catch-up over the prompt included,
attends with far memory (:mod:`verispec.drafters.far_memory`); only the drafts change, never the output.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from verispec.drafters.base import DraftContext, Proposal, lockstep_groups, round_catch_ups, unseen_context_rows
from verispec.drafters.draft_model import checked_alternatives, checked_threshold, pick_draft, round_stops
from verispec.drafters.draft_vocab import reduced_lm_head, resolve_head
from verispec.drafters.eagle.checkpoint import load_head
from verispec.drafters.eagle.head import EagleHead
from verispec.drafters.eagle.tree import draft_with_tree
from verispec.drafters.far_memory import FarMemoryConfig, checked_far_memory
from verispec.engine.kv_cache import LayerKVCache
from verispec.sampling import SamplingParams


# What `generate`, `compare` and `serve` pass as ``path_confidence`` (README, Performance, 2026-12-04
# (evening)): chosen on HumanEval problems 100-107 with the bundled head, where a round of up to 8
# drafts stopped at 0.2 ran 1.71x over plain against 1.64x at 0.4 and 1.61x for 3 drafts a round.
EAGLE_PATH_CONFIDENCE = 0.2
# Catch-ups over more rows than this (prompts, not rounds) pass each distinct next token's
# embedding once (EagleHead.forward's ``embed_rows``): a round's few rows gain nothing from it.
DISTINCT_EMBEDS_FROM_ROWS = 64


class EagleDrafter:
    """EAGLE drafting for ``target`` with a trained ``head`` (an :class:`EagleHead` or a checkpoint path).

    ``draft_vocab``: token ids the draft distribution is restricted to (the head's checkpoint
    brings its own); drafting then multiplies by those LM-head rows only. Exact either way:
    verification receives the probabilities actually sampled from, zero outside the subset.
    ``use_draft_vocab=False`` drafts over the full vocabulary with the shared LM head.
    ``quantize=True``: int8 dynamic linears for the head and its LM-head rows (a copy of the head;
    cheaper draft steps, possibly lower acceptance, the output exact either way); where the CPU
    multiplies bfloat16 natively, fc's feature half in bfloat16 too.
    ``far_memory``: how the head attends over long contexts; None (or mode "full") as trained; mode
    "auto" is resolved per request by its prompt's length (:meth:`FarMemoryConfig.for_prompt`).
    ``path_confidence``: stop a round early once the product of the head's probabilities of this
    round's drafts falls below this (the draft model's rule, :func:`round_stops`): long rounds where
    the head is sure, short ones where it is not. Reads only the head's outputs, so still exact.
    ``alternatives``: offer this many runner-up tokens per draft
    (:attr:`Proposal.alternatives`, scored by the head's probability of the path to them), which a
    decoder with ``tree_rows`` verifies beside the chain as a one-level draft tree; 0 (default): none.
    ``expand`` (with ``alternatives``): a session drafting alone also drafts on this many of the
    best-scored runner-up paths each draft step, in the chain's head call, offering their next
    tokens as :attr:`Proposal.continuations` (a deeper draft tree: :mod:`verispec.drafters.eagle.tree`;
    not for a head attending with far memory, whose rounds stay one-level); 0 (default): none.
    """

    needs_target_features = True

    def __init__(
        self,
        target: Any,
        head: EagleHead | str | os.PathLike,
        draft_vocab: torch.Tensor | None = None,  # [draft_vocab] int64
        *,
        use_draft_vocab: bool = True,
        quantize: bool = False,
        far_memory: FarMemoryConfig | None = None,
        path_confidence: float | None = None,
        alternatives: int = 0,
        expand: int = 0,
        name: str = "eagle",
    ) -> None:
        path_confidence = checked_threshold(path_confidence, "path_confidence")
        self.alternatives = checked_alternatives(alternatives)
        if isinstance(expand, bool) or not isinstance(expand, int) or expand < 0:
            raise ValueError(f"expand must be an integer >= 0, got {expand!r}")
        self.expand = expand
        target_model, self.tokenizer, self.head, draft_vocab = resolve_head(target, head, draft_vocab, EagleHead, load_head, "EagleDrafter", quantize=quantize)
        self.far_memory = checked_far_memory(far_memory)
        self.path_confidence = path_confidence or None  # 0 = off
        self.name = name
        self.embed = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings()
        self.vocab_ids, self._lm_head = reduced_lm_head(lm_head, draft_vocab if use_draft_vocab else None, quantize=quantize)  # [draft_vocab] or None
        self.vocab_size = int(lm_head.weight.shape[0])

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary # [n, draft_vocab] for features # [n, hidden]."""
        return self._lm_head(features).float()

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "EagleSession":
        far_memory = self.far_memory.for_prompt(len(prompt_ids)) if self.far_memory is not None else None
        return EagleSession(self, sampling, far_memory)


_NO_PROPOSAL = Proposal(tokens=[], probs=None)


class EagleSession:
    def __init__(self, drafter: EagleDrafter, sampling: SamplingParams, far_memory: FarMemoryConfig | None = None) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.far_memory = far_memory  # this request's attention ("auto" resolved by the prompt's length); None: as trained
        self.cache = LayerKVCache()
        self.num_real = 0  # head positions fed with real target features (0 .. num_real-1)
        self.next_feature: torch.Tensor | None = None  # [hidden]: f̂ at position num_real, from the catch-up

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        return EagleSession.propose_many([self], [context], [max_tokens], [generator])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(sessions: list["EagleSession"], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]) -> list[Proposal]:
        """One proposal per session (batched serving), drafted in lockstep: each step reads every
        drafting session's features through ONE LM-head product and one head call
        (:meth:`EagleHead.advance_many`, each row attending to its own session's cache). Why: alone, a
        session pays the LM head over the draft vocabulary (~50 MB of int8 weights for the 1.5B
        target) and the head's weights per step, and a server round of 8 requests paid that 8 times.
        Each session keeps its own sampling, stop rules, generator and attention (far memory or
        as trained: the products are shared, each row attends over its own cache as its session
        does alone). Drafted alone (as :meth:`propose`): a seeded sampled session, whose text must
        not depend on the traffic (:func:`~verispec.drafters.base.lockstep_groups`)."""
        proposals: list[Proposal] = [_NO_PROPOSAL] * len(sessions)
        for indices in lockstep_groups(sessions, far_memory_together=True):
            drafted = _draft_in_lockstep([sessions[i] for i in indices], [contexts[i] for i in indices], [max_tokens[i] for i in indices], [generators[i] for i in indices])
            for index, proposal in zip(indices, drafted):
                proposals[index] = proposal
        return proposals

    def _catch_up(self, context: DraftContext) -> int:
        """Feed the head every real feature it has not seen; return the number of head calls (0 or 1)."""
        rows = unseen_context_rows(context, self.num_real, "EAGLE")
        if rows is None:
            return 0
        fresh, next_tokens = rows
        skipped = self._never_read(len(fresh))
        if skipped:  # zeros hold their places: positions must stay true, and nothing will attend to them
            head_config = self.drafter.head.config
            keys, values = self.cache.claim(skipped, head_config.num_kv_heads, head_config.head_dim)
            keys[:, -skipped:] = 0
            values[:, -skipped:] = 0
            fresh, next_tokens = fresh[skipped:], next_tokens[skipped:]
        embed_rows = None
        if len(next_tokens) > DISTINCT_EMBEDS_FROM_ROWS:  # a prompt: each distinct token's share of fc computed once
            next_tokens, embed_rows = next_tokens.unique(return_inverse=True)
        embeds = self.drafter.embed(next_tokens[None]).float()  # [1, n or distinct, hidden]
        predicted = self.drafter.head(fresh[None].float(), embeds, start=self.num_real + skipped, cache=self.cache, far_memory=self.far_memory, last_only=True, embed_rows=embed_rows)
        self.num_real += skipped + len(fresh)
        self.next_feature = predicted[0, -1]
        return 1

    def _never_read(self, num_fresh: int) -> int:
        """How many of ``num_fresh`` catch-up rows no later head call can attend to: with a local
        window only (``--draft-attention local``) every query from the catch-up's last row on sees the
        last W positions, so the keys and values of older rows (most of a long prompt: at 16K tokens
        ~0.35 s of head work, 1.1 s before the mixed-precision fc) need not be computed."""
        if self.far_memory is None or self.far_memory.mode != "local":
            return 0
        return max(0, num_fresh - self.far_memory.local_window)

    def close(self) -> None:
        self.cache = LayerKVCache()
        self.num_real, self.next_feature = 0, None


def _draft_in_lockstep(sessions: list[EagleSession], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]) -> list[Proposal]:
    """Proposals of sessions sharing one drafter (see :meth:`EagleSession.propose_many`); a lone
    session's head steps are :meth:`EagleHead.forward` as always (far memory included)."""
    drafter, head = sessions[0].drafter, sessions[0].drafter.head
    passes = _catch_up_many(sessions, contexts)
    lone = sessions[0]
    if len(sessions) == 1 and drafter.expand and drafter.alternatives and max_tokens[0] > 0 and _ready(lone, contexts[0]):
        if lone.far_memory is None or not lone.far_memory.changes_attention:
            return [draft_with_tree(lone, max_tokens[0], generators[0], passes[0])]
    tokens: list[list[int]] = [[] for _ in sessions]
    step_probs: list[list[torch.Tensor]] = [[] for _ in sessions]
    alternatives: list[list[tuple[int, int, float]]] = [[] for _ in sessions]  # (draft index, runner-up, the head's probability of the path to it)
    path_probs = [1.0] * len(sessions)  # the head's probability of each round's drafts so far
    drafting = [i for i, (session, context) in enumerate(zip(sessions, contexts)) if max_tokens[i] > 0 and _ready(session, context)]
    features = torch.stack([sessions[i].next_feature for i in drafting]) if drafting else None  # [drafting, hidden]
    needs_prob = drafter.path_confidence is not None or bool(drafter.alternatives)  # greedy: the stop rule and the runner-ups' path scores read it
    while drafting:
        logits = drafter.draft_logits(features)  # [drafting, draft_vocab]
        still: list[int] = []
        for row, index in enumerate(drafting):
            token, token_prob, probs, runner_up = pick_draft(logits[row], sessions[index].sampling, generators[index], needs_prob, drafter.alternatives, drafter.vocab_ids, drafter.vocab_size)
            alternatives[index] += [(len(tokens[index]), other, path_probs[index] * prob) for other, prob in runner_up]
            if probs is not None:
                step_probs[index].append(probs)
            tokens[index].append(token)
            path_probs[index] *= token_prob
            if len(tokens[index]) < max_tokens[index] and not round_stops(token_prob, path_probs[index], None, drafter.path_confidence):
                still.append(row)
        if not still:
            break
        embeds = drafter.embed(torch.tensor([[tokens[drafting[row]][-1] for row in still]]))[0].float()  # [still, hidden]
        features = features[still]
        drafting = [drafting[row] for row in still]
        if len(drafting) == 1:  # alone: the head's own cached step, far memory included
            session = sessions[drafting[0]]
            features = head(features[None], embeds[None], start=session.cache.length, cache=session.cache, far_memory=session.far_memory)[0]  # [1, hidden]
        else:
            caches, far_memory = [sessions[i].cache for i in drafting], [sessions[i].far_memory for i in drafting]
            features = head.advance_many(list(features[:, None]), list(embeds[:, None]), caches, far_memory)  # [still, hidden]
        for index in drafting:
            passes[index] += 1
    proposals = []
    for index, session in enumerate(sessions):
        session.cache.crop(session.num_real)  # drafted positions go; the next round feeds real features there
        probs = torch.stack(step_probs[index]) if step_probs[index] else None
        proposals.append(Proposal(tokens=tokens[index], probs=probs, num_forward_passes=passes[index], alternatives=alternatives[index]))
    return proposals


def _ready(session: EagleSession, context: DraftContext) -> bool:
    """Whether a session can draft: once the head has read every real feature (not yet: a 1-token prompt)."""
    return session.next_feature is not None and session.num_real == len(context.token_ids) - 1


def _catch_up_many(sessions: list[EagleSession], contexts: list[DraftContext]) -> list[int]:
    """Every session reads the real features it has not seen (:meth:`EagleSession._catch_up`); a
    round's few rows per session in one head call for all (:meth:`EagleHead.advance_many`), a
    prompt (or a lone session) in its own call. Returns each session's head calls (0 or 1). Each
    session attends as it does alone; a local-window session computes the few rows' keys and
    values that its lone catch-up might skip (:meth:`EagleSession._never_read`: rows no later query
    attends to, so the drafts are the same)."""
    drafter = sessions[0].drafter
    passes, few, features, embeds = round_catch_ups(sessions, contexts, "EAGLE", DISTINCT_EMBEDS_FROM_ROWS, drafter.embed)
    if few:
        caches, far_memory = [sessions[index].cache for index in few], [sessions[index].far_memory for index in few]
        predicted = drafter.head.advance_many(features, embeds, caches, far_memory)  # [len(few), hidden]
        for index, rows, feature in zip(few, features, predicted):
            sessions[index].num_real += len(rows)
            sessions[index].next_feature = feature
            passes[index] = 1
    return passes
