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
    # Deeper draft trees: (parent, token, score), ``token`` drafted after the runner-up path ending at
    # node ``parent`` — an index into ``alternatives + continuations``, an earlier entry; score as for
    # alternatives (the drafter's probability of the whole path). No path is longer than the chain.
    continuations: list[tuple[int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"Proposal.probs has {self.probs.shape[0]} rows for {len(self.tokens)} tokens")
        if any(not 0 <= index < len(self.tokens) or token == self.tokens[index] for index, token, _ in self.alternatives):
            raise ValueError("Proposal.alternatives must name draft indices in range, each with a token other than the draft's")
        siblings: set[tuple[int, int]] = set()
        for number, (parent, token, _) in enumerate(self.continuations):
            if not 0 <= parent < len(self.alternatives) + number or (parent, token) in siblings:
                raise ValueError("Proposal.continuations must name earlier nodes, one token each, and stay as short as the chain")
            siblings.add((parent, token))
        if any(reach >= len(self.tokens) for reach in self.node_reach()):
            raise ValueError("Proposal.continuations must name earlier nodes, one token each, and stay as short as the chain")

    def node_reach(self) -> list[int]:
        """Per tree node (alternatives, then continuations): the draft index its path ends beside."""
        reach = [index for index, _, _ in self.alternatives]
        for parent, _, _ in self.continuations:
            reach.append(reach[parent] + 1)
        return reach


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


def lockstep_groups(sessions: list, far_memory_together: bool = False) -> list[list[int]]:  # sessions of a feature-reading drafter (EAGLE, parallel)
    """Which of a server round's sessions may draft together (one head call for all): those sharing
    a drafter, whose head attends as trained or — with ``far_memory_together`` (a drafter whose
    batched calls attend each session as its own config says) — with far memory. Alone: a session
    with far memory otherwise, and a seeded sampled one, whose text must not depend on the traffic
    (PyTorch's int8 dynamic linears scale all rows of a product together, so a batched draft may
    differ a little, and so would the random numbers verification then draws)."""
    groups: dict[int, list[int]] = {}
    for index, session in enumerate(sessions):
        together = far_memory_together or session.far_memory is None or not session.far_memory.changes_attention
        together = together and (session.sampling.is_greedy or session.sampling.seed is None)
        groups.setdefault(id(session.drafter) if together else -1 - index, []).append(index)
    return list(groups.values())


def round_catch_ups(
    sessions: list, contexts: list[DraftContext], drafter_name: str, most_rows: int, embed: torch.nn.Module
) -> tuple[list[int], list[int], list[torch.Tensor], list[torch.Tensor]]:
    """A round's catch-ups of feature-reading sessions (what :func:`unseen_context_rows` gives each,
    read from ``num_real``): a prompt, a session with nothing new and a lone few-row session run
    their own ``_catch_up`` here; the sessions with 1..``most_rows`` new rows are left for ONE head
    call for all of them. Returns (each session's head calls so far, the indices of those left,
    their features # each [n_s, hidden] and the embeddings of their next tokens # each [n_s, hidden])."""
    few, alone = [], []
    for index, (session, context) in enumerate(zip(sessions, contexts)):
        rows = unseen_context_rows(context, session.num_real, drafter_name)
        (few if rows is not None and len(rows[0]) <= most_rows else alone).append((index, rows))
    if len(few) == 1:  # alone, as it always drafted
        alone += few
        few = []
    passes = [0] * len(sessions)
    for index, _ in alone:
        passes[index] = sessions[index]._catch_up(contexts[index])
    if not few:
        return passes, [], [], []
    features = [fresh.float() for _, (fresh, _) in few]
    embeds = embed(torch.cat([next_tokens for _, (_, next_tokens) in few])).float().split([len(rows) for rows in features])
    return passes, [index for index, _ in few], features, list(embeds)


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
