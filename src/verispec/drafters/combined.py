"""Prompt lookup when it finds a match, a drafter model otherwise.

Copying from the context costs nothing, so it goes first; the model drafts only the rounds the
lookup cannot. Each round's proposal comes whole from one of the two, with that drafter's own
q_draft (None for lookup), so verification stays exact.

A fallback that reads the target's features (EAGLE) is handed every one of them, in order: the
engine hands each feature once, to whichever call comes next, so the features of rounds the
lookup drafted are held here and passed on with the next context the fallback sees.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal, propose_batch
from verispec.drafters.ngram import LookupRule, NgramDrafter
from verispec.sampling import SamplingParams


# What `generate` and `compare` run by default (README, Performance, 2026-12-01): adaptive gamma up
# to this many drafts a round (lookup rounds copy up to all of them), the draft model stopping a
# round once its path probability falls below this. Chosen by replaying the target's greedy answers
# to HumanEval problems 8-31 (not the 8 the benchmark runs) under measured costs (`verispec replay`
# reruns it; README, Performance, 2026-12-02 (later)): a draft costs
# ~24 ms and a verified row ~9 ms against ~75 ms a token, so a draft with less than about even odds
# of being reached and accepted costs more than it returns. Measured against gamma <= 10 without
# the stop, side by side: 2-3% more tokens/s on HumanEval, 7% on Spec-Bench.
STREAM_GAMMA = 16
STREAM_PATH_CONFIDENCE = 0.45


def lookup_then_model(model_drafter: Drafter) -> "CombinedDrafter":
    """``--drafter ngram+draft`` (``ngram+eagle``): prompt lookup on a match of 2+ tokens, ``model_drafter`` otherwise.

    Lookup claims a round only on a 2+ token match, and then drafts all the round allows: on a
    weaker match the model drafts better than a short, capped lookup proposal would. The fastest
    drafter measured on HumanEval here (README, Performance).
    """
    return CombinedDrafter(NgramDrafter(LookupRule(min_ngram=2, match_drafts=())), model_drafter)


class CombinedDrafter:
    def __init__(self, primary: Drafter, fallback: Drafter) -> None:
        if primary.needs_target_features:
            raise ValueError(f"CombinedDrafter: the primary drafter ({primary.name}) must not read target features; only the fallback may")
        self.primary, self.fallback = primary, fallback
        self.needs_target_features = fallback.needs_target_features
        self.name = f"{primary.name}+{fallback.name}"
        self.tokenizer = getattr(fallback, "tokenizer", None)  # checked against the target's

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "CombinedSession":
        return CombinedSession(self.primary.start(prompt_ids, sampling), self.fallback.start(prompt_ids, sampling))


class CombinedSession:
    def __init__(self, primary: DraftSession, fallback: DraftSession) -> None:
        self.primary, self.fallback = primary, fallback
        # Target features of rounds the primary drafted, not yet handed to the fallback.
        self.held: list[torch.Tensor] = []  # each [n, hidden], consecutive positions
        self.held_start = 0  # the position of held[0]'s first row

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        proposal = self.primary.propose(context, max_tokens, generator)
        if proposal.tokens:
            self._hold(context)
            return proposal
        return self.fallback.propose(self._for_fallback(context), max_tokens, generator)

    def _hold(self, context: DraftContext) -> None:
        if context.target_features is None or len(context.target_features) == 0:
            return
        if not self.held:
            self.held_start = context.features_start
        self.held.append(context.target_features)

    def _for_fallback(self, context: DraftContext) -> DraftContext:
        """``context`` with the held features in front of its own (the fallback reads each once)."""
        if not self.held:
            return context
        self._hold(context)
        features = torch.cat(self.held)  # [n, hidden]
        self.held = []
        return DraftContext(context.token_ids, features, self.held_start)

    @staticmethod
    def propose_many(
        sessions: list["CombinedSession"], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]
    ) -> list[Proposal]:
        """:meth:`propose` for several sessions: each tries its primary; the fallbacks of those that
        got nothing draft together where they can (:func:`~verispec.drafters.base.propose_batch`)."""
        proposals = [s.primary.propose(c, m, g) for s, c, m, g in zip(sessions, contexts, max_tokens, generators)]
        empty = []
        for index, proposal in enumerate(proposals):
            if proposal.tokens:
                sessions[index]._hold(contexts[index])  # as propose does: the fallback gets them later
            else:
                empty.append(index)
        fallbacks = propose_batch(
            [sessions[i].fallback for i in empty], [sessions[i]._for_fallback(contexts[i]) for i in empty], [max_tokens[i] for i in empty], [generators[i] for i in empty]
        )
        for index, proposal in zip(empty, fallbacks):
            proposals[index] = proposal
        return proposals

    def close(self) -> None:
        self.held = []
        try:
            self.primary.close()
        finally:
            self.fallback.close()
