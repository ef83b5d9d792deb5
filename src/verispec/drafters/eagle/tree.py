"""Deeper draft trees for the EAGLE head: runner-up paths drafted on beside the chain.

A round's chain feeds draft d_s to the head at position P+s-1 (P: the rows with real features).
A runner-up r offered beside d_s stands at that same position: fed there (d_s's input feature, its
own token), seeing the real rows, the chain's drafts before d_s and itself, the head predicts the
feature after r, whose logits give r's continuations, and so on down the path. Each chain step the
``expand`` best-scored nodes not drafted on yet ride in the chain's head call
(:meth:`EagleHead.tree_steps`: the head's weights read once for all rows) and their logits come
with the chain's next ones from one LM-head product: the chain's cost, a few rows wider. Their
best continuations become :attr:`Proposal.continuations`, scored by the head's probability of the
whole path, and the decoder verifies the best-scored nodes beside the chain
(:func:`~verispec.engine.decoder.pick_branches`).

A node's children sit one position deeper, and nodes are drafted on only while the chain takes
another step, so no path is longer than the chain: a pass still emits 1..γ+1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import Proposal
from verispec.drafters.draft_model import pick_draft, round_stops, runner_ups
from verispec.sampling import SamplingParams, logits_to_probs

if TYPE_CHECKING:  # the drafter imports this module
    from verispec.drafters.eagle.drafter import EagleSession


@dataclass
class _Node:
    """A tree node not drafted on yet (a runner-up beside the chain, or a continuation of one)."""

    ref: int  # its entry: index into the round's alternatives (>= 0) or -1 - index into its continuations
    leave: int  # the chain draft it stands beside (or its path does): it sees the drafts before that one
    depth: int  # 0 for a runner-up, one more per continuation
    ancestors: list[int]  # slots (in RunnerUpPaths' keys/values) of the tree rows on its path, root first
    feature: torch.Tensor  # [hidden]: the feature it is fed with (its parent's prediction)
    token: int
    score: float  # the head's probability of the whole path to it


class RunnerUpPaths:
    """One round's tree beside the chain: the frontier of nodes, the keys/values of the tree rows fed
    so far (what their descendants attend to) and the continuations found."""

    def __init__(self, expand: int, children: int) -> None:
        self.expand, self.children = expand, children
        self.frontier: list[_Node] = []
        self.keys: list[torch.Tensor] = []  # per fed tree row # [kv_heads, head_dim], rotated
        self.values: list[torch.Tensor] = []
        self.continuations: list[tuple[int, int, float]] = []  # (parent ref, token, score)

    def offer(self, ref: int, leave: int, feature: torch.Tensor, token: int, score: float) -> None:
        """A runner-up beside chain draft ``leave`` (alternatives entry ``ref``), fed with ``feature`` # [hidden]."""
        self.frontier.append(_Node(ref, leave, 0, [], feature, token, score))

    def take(self) -> list[_Node]:
        """The best-scored ``expand`` frontier nodes, to feed in the next head call."""
        self.frontier.sort(key=lambda node: -node.score)
        taken, self.frontier = self.frontier[: self.expand], self.frontier[self.expand :]
        return taken

    def fed(self, nodes: list[_Node], keys: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Keep fed rows' keys/values # [n, kv_heads, head_dim]; return their slots."""
        slots = list(range(len(self.keys), len(self.keys) + len(nodes)))
        self.keys += list(keys)
        self.values += list(values)
        return slots

    def grow(self, nodes: list[_Node], slots: list[int], features: torch.Tensor, logits: torch.Tensor, sampling: SamplingParams, vocab_ids: torch.Tensor | None) -> None:
        """Each fed node's best ``children`` next tokens (features, logits # [n, hidden], [n, draft_vocab]:
        the head's predictions after the nodes) become continuations and frontier nodes."""
        for node, slot, feature, row_logits in zip(nodes, slots, features, logits):
            probs = torch.softmax(row_logits, -1) if sampling.is_greedy else logits_to_probs(row_logits, sampling)  # [draft_vocab]
            for token, prob in runner_ups(probs, -1, self.children, vocab_ids, sampled=not sampling.is_greedy):
                self.continuations.append((node.ref, token, node.score * prob))
                child = _Node(-len(self.continuations), node.leave, node.depth + 1, node.ancestors + [slot], feature, token, node.score * prob)
                self.frontier.append(child)

    def tree_context(self, nodes: list[_Node]) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """The fed tree rows' keys/values # [1, kv_heads, S, head_dim] and which of them each node sees # [n, S]."""
        if not self.keys:
            return None, None
        keys, values = (torch.stack(parts, dim=1)[None] for parts in (self.keys, self.values))
        visible = torch.zeros(len(nodes), len(self.keys), dtype=torch.bool)
        for row, node in enumerate(nodes):
            visible[row, node.ancestors] = True
        return (keys, values), visible

    def resolved(self, num_alternatives: int) -> list[tuple[int, int, float]]:
        """:attr:`Proposal.continuations`: parents as indices into alternatives + continuations."""
        return [(ref if ref >= 0 else num_alternatives - 1 - ref, token, score) for ref, token, score in self.continuations]


@torch.inference_mode()
def draft_with_tree(session: "EagleSession", max_tokens: int, generator: torch.Generator, passes: int) -> Proposal:
    """A lone session's round (its catch-up done, ``passes`` head calls so far) as
    ``_draft_in_lockstep`` drafts it — the same chain rule, runner-ups and stop rule — with each
    chain step's head call also drafting on the best runner-up paths (module docstring)."""
    drafter, sampling, cache = session.drafter, session.sampling, session.cache
    real = session.num_real
    tree = RunnerUpPaths(drafter.expand, drafter.alternatives)
    tokens: list[int] = []
    step_probs: list[torch.Tensor] = []
    alternatives: list[tuple[int, int, float]] = []
    path_prob = 1.0
    outputs = session.next_feature[None]  # [1 + fed nodes, hidden]: the chain's next feature, then the fed nodes' predictions
    fed: list[_Node] = []
    slots: list[int] = []
    while True:
        logits = drafter.draft_logits(outputs)  # [1 + fed nodes, draft_vocab]: one LM-head product for the chain and the tree
        tree.grow(fed, slots, outputs[1:], logits[1:], sampling, drafter.vocab_ids)
        chain_feature = outputs[0]
        token, token_prob, probs, runner_up = pick_draft(logits[0], sampling, generator, True, drafter.alternatives, drafter.vocab_ids, drafter.vocab_size)
        for other, prob in runner_up:
            tree.offer(len(alternatives), len(tokens), chain_feature, other, path_prob * prob)
            alternatives.append((len(tokens), other, path_prob * prob))
        if probs is not None:
            step_probs.append(probs)
        tokens.append(token)
        path_prob *= token_prob
        if len(tokens) >= max_tokens or round_stops(token_prob, path_prob, None, drafter.path_confidence):
            break
        fed = tree.take()
        features = torch.stack([chain_feature] + [node.feature for node in fed])  # [1 + n, hidden]
        embeds = drafter.embed(torch.tensor([token] + [node.token for node in fed])).float()  # [1 + n, hidden]
        positions = torch.tensor([cache.length] + [real + node.leave + node.depth for node in fed])
        visible = torch.arange(cache.length)[None, :] < torch.tensor([cache.length] + [real + node.leave for node in fed])[:, None]  # [1 + n, cache]
        ancestors, ancestors_visible = tree.tree_context(fed)
        if ancestors_visible is not None:
            ancestors_visible = torch.cat((torch.zeros(1, ancestors_visible.shape[1], dtype=torch.bool), ancestors_visible))  # the chain row sees none
        outputs, (keys, values) = drafter.head.tree_steps(
            features, embeds, positions, (cache.keys[None, :, : cache.length], cache.values[None, :, : cache.length]), visible, ancestors, ancestors_visible
        )
        cache.append(keys[0][:, None], values[0][:, None])  # the chain draft's row, as a cached step leaves it
        slots = tree.fed(fed, keys[1:], values[1:])
        passes += 1
    cache.crop(real)  # drafted positions go; the next round feeds real features there
    probs = torch.stack(step_probs) if step_probs else None
    return Proposal(tokens, probs, passes, alternatives, tree.resolved(len(alternatives)))
