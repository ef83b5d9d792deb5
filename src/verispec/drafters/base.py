"""The drafter protocol: the only thing the engine knows about a drafter.

A :class:`Drafter` is shared and stateless per request; :meth:`Drafter.start` opens a
:class:`DraftSession` that owns whatever per-sequence state the drafter needs (a KV cache,
an n-gram index). Each round the engine hands the session the committed sequence and asks for
up to ``max_tokens`` drafts; the session rolls its own state back to that sequence itself
(drafts it proposed earlier may have been rejected). Adding a drafter never touches the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from verispec.sampling import SamplingParams


@dataclass
class DraftContext:
    """What the engine knows when it asks for drafts."""

    token_ids: list[int]  # the committed sequence: prompt + every token emitted so far
    # Top-layer features of the target for committed positions features_start .. len(token_ids)-2
    # that this session has not been handed before (every position exactly once, in order, from the
    # passes already run: no extra target call). None unless the drafter asks for features.
    target_features: torch.Tensor | None = None  # [num_positions, hidden]
    features_start: int = 0


@dataclass
class Proposal:
    """Draft tokens for one round (possibly fewer than asked, possibly none)."""

    tokens: list[int]
    # q_draft: the distribution each draft token was sampled from, after the same sampling transform
    # as the target's. None for a deterministic draft (and for greedy, where verification is argmax).
    probs: torch.Tensor | None  # [len(tokens), vocab]
    num_forward_passes: int = 0  # drafter model calls spent on this proposal
    # Runner-up tokens for greedy draft trees: (index i, token, score), ``token`` an alternative to
    # tokens[i] after tokens[:i]; score = the drafter's probability that the target takes exactly
    # tokens[:i] + [token] (the engine verifies the best-scored ones in spare rows of its pass).
    alternatives: list[tuple[int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"Proposal.probs has {self.probs.shape[0]} rows for {len(self.tokens)} tokens")
        if any(not 0 <= index < len(self.tokens) or token == self.tokens[index] for index, token, _ in self.alternatives):
            raise ValueError("Proposal.alternatives must name draft indices in range, each with a token other than the draft's")


def unseen_context_rows(context: DraftContext, num_seen: int, drafter_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a feature-reading session has not read yet: (f_i # [n, hidden], x_{i+1} # [n] long) for
    positions i = num_seen .. num_seen+n-1, or None when nothing is new. A gap (features the
    session was never handed) is a RuntimeError naming ``drafter_name``.
    """
    features = context.target_features  # [m, hidden] for positions features_start ..
    if features is None or len(features) == 0:
        return None
    start = context.features_start
    if start > num_seen:
        raise RuntimeError(f"{drafter_name} session missed target features for positions {num_seen}..{start - 1}")
    fresh = features[num_seen - start :]
    if len(fresh) == 0:
        return None
    return fresh, torch.tensor(context.token_ids[num_seen + 1 : num_seen + 1 + len(fresh)])


class DraftSession(Protocol):
    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        """Up to ``max_tokens`` (>= 1) drafts continuing ``context.token_ids``."""
        ...

    def close(self) -> None:
        """Free per-sequence state; called in ``finally`` even when a stream is abandoned."""
        ...


class Drafter(Protocol):
    name: str
    needs_target_features: bool  # True: the engine fills DraftContext.target_features

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> DraftSession:
        ...


def propose_batch(sessions: list[DraftSession], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]) -> list[Proposal]:
    """One proposal per session (batched serving). Sessions of a class with a static
    ``propose_many(sessions, contexts, max_tokens, generators)`` draft together (a draft model's
    sessions: one pass per step for all of them); the others, and sessions asked for no drafts, alone."""
    proposals: list[Proposal | None] = [None] * len(sessions)
    together: dict[object, list[int]] = {}
    for index, session in enumerate(sessions):
        many = getattr(type(session), "propose_many", None)
        if max_tokens[index] <= 0:
            proposals[index] = Proposal([], None)
        elif many is None:
            proposals[index] = session.propose(contexts[index], max_tokens[index], generators[index])
        else:
            together.setdefault(many, []).append(index)
    for many, indices in together.items():
        batch = many([sessions[i] for i in indices], [contexts[i] for i in indices], [max_tokens[i] for i in indices], [generators[i] for i in indices])
        for index, proposal in zip(indices, batch):
            proposals[index] = proposal
    return proposals  # type: ignore[return-value]
