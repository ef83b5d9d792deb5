"""The ``parallel`` drafter: a block of K drafts from one head pass, optionally contextually corrected.

For a committed sequence x_0 .. x_L with target features f_0 .. f_{L-1} (from the verification
passes already run), one round is:

1. catch-up: the head encodes every real feature it has not seen, in one call (cached);
2. block pass: K mask slots after the context give, per position i, the top-m candidates and
   their log-probabilities ``unary[i, c] = log q_draft_i(cand[i, c])`` (``num_forward_passes`` 1);
   with ``first_from_anchor`` position 0 is read from the anchor (the catch-up's last output);
3. correction (optional): ONE batched pass of (K-1)·m blocks, row (i, c) giving slot i as the
   known token cand[i, c]; slot i+1 of that row scores the m candidates at i+1:

       pair[i, c, c'] = log softmax_{c'}( W_{cand[i+1, c']} · ĥ_{i+1} | slot i = cand[i, c] )

   (normalised over the m candidates: a fit score, read from m LM-head rows only), and the
   drafted path is the lattice's best (:func:`~verispec.drafters.parallel.lattice.best_path`);
   with ``first_from_anchor`` the path keeps the anchor's first draft (the fit picks what follows),
   so position 0 needs the row of that draft only: (K-2)·m + 1 rows. With an EAGLE corrector the
   rows are EAGLE steps (:func:`_successor_fit`), and ``path_rule="successor"`` (the default there)
   reads each row's next-token distribution over the block's likeliest tokens instead: each draft
   after the first is the corrector's most likely token after the path's token before it
   (:func:`_successor_paths`).

With ``path_confidence`` the path ends at the first position where the product of its drafts'
block probabilities, prod_{j<=i} q_draft_j(path_j), falls below the threshold (that position
included, as the EAGLE head's rule): a block's later slots are drafted blind and seldom accepted,
and each verified row costs the target a share of a pass. Correction then scores only the
positions the stop could keep (those where the top-1 path has not yet fallen below it).

The path is a deterministic draft (``Proposal.probs`` None, also when sampling): the verifier
accepts x with probability p_target(x) and otherwise samples from p_target without x, so the
output distribution stays exactly the target's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from verispec.drafters.base import DraftContext, Proposal, lockstep_groups, round_catch_ups, unseen_context_rows
from verispec.drafters.draft_model import checked_alternatives, checked_threshold
from verispec.drafters.draft_vocab import reduced_lm_head, resolve_head
from verispec.drafters.eagle.checkpoint import load_head
from verispec.drafters.eagle.drafter import DISTINCT_EMBEDS_FROM_ROWS
from verispec.drafters.eagle.head import EagleHead
from verispec.drafters.far_memory import FarMemoryConfig, checked_far_memory
from verispec.drafters.parallel.checkpoint import load_parallel_head
from verispec.drafters.parallel.head import ParallelHead, cached
from verispec.drafters.shared_prefix import KeysValues, SequencePrefixes, for_rows
from verispec.drafters.parallel.lattice import best_path
from verispec.engine.kv_cache import LayerKVCache
from verispec.sampling import SamplingParams


# What `generate`, `compare` and `serve` pass as ``path_confidence`` (README, Performance,
# 2026-12-05 (mid-morning)): on Spec-Bench ×5 it cut the EAGLE-fit drafter's verified drafts from 4.8 to
# 1.6 a round at τ 1.32 against 1.33 (each verified row costs the target ~7% of a pass on the Zen 1 EPYC).
PARALLEL_PATH_CONFIDENCE = 0.2
# Candidates kept per position for contextual correction (m), the default of the drafter, the
# command line and the bench's corrected methods.
PARALLEL_CANDIDATES = 3
# How a corrected drafter with an EAGLE corrector picks its path (ParallelDrafter(path_rule=...)).
PATH_RULES = ("lattice", "successor")
# How a drafter with an EAGLE corrector picks its path unless told (ParallelDrafter(path_rule=None), `generate`,
# `compare`, `serve`, the bench's parallel-corrected-eagle): τ up in replays and timed runs (README, Performance, 2026-12-08 (small hours)).
PARALLEL_PATH_RULE = "successor"
# The block's likeliest tokens at a position among which the successor rule picks (_successor_paths).
SUCCESSOR_CANDIDATES = 16


class ParallelDrafter:
    """Block drafting for ``target`` with a trained ``head`` (a :class:`ParallelHead` or a checkpoint path).

    ``block_size``: drafts per round at most (default and maximum: the head's K); ``candidates``:
    m, kept per position; ``correction``: pick the path by pair fit (False: top-1 per position,
    one head pass). ``draft_vocab``: token ids the LM head is restricted to (a checkpoint brings its own).
    ``quantize=True``: int8 dynamic linears for a copy of the head and for its LM-head rows, as the
    EAGLE drafter offers (cheaper block passes; the drafts may differ, the output stays exact).
    ``alternatives``: offer this many runner-up candidates per position
    (:attr:`Proposal.alternatives`, scored by q_draft of the drafted path before them times their
    own), which a decoder with ``tree_rows`` verifies beside the path as a one-level draft tree.
    ``corrector``: an EAGLE head (or its checkpoint) that scores the pair fit instead of the
    parallel head's known-slot pass: one EAGLE step per (position, candidate), reading slot i's
    drafted feature with the candidate as the token one step ahead (:func:`_successor_fit`).
    ``far_memory``: how the head (and the corrector) attend over long contexts
    (:mod:`verispec.drafters.far_memory`); None (or mode "full") as trained; "auto" resolved per
    request by its prompt's length. Only drafts change.
    ``path_confidence``: end a round's path where the product of its block probabilities falls
    below this, in [0, 1) (that draft kept, as :class:`~verispec.drafters.eagle.EagleDrafter`'s
    rule); None or 0: every slot of the block is drafted.
    ``path_rule``: "lattice" — the best path through the K×m lattice (:func:`draft_paths`);
    "successor" (needs a corrector) — each draft after the first is the corrector's most likely next
    token after the one before it (:func:`_successor_paths`); None (default): ``PARALLEL_PATH_RULE``
    with a corrector, else "lattice".
    """

    needs_target_features = True

    def __init__(
        self,
        target: Any,
        head: ParallelHead | str | os.PathLike,
        draft_vocab: torch.Tensor | None = None,  # [draft_vocab] int64
        *,
        block_size: int | None = None,
        candidates: int = PARALLEL_CANDIDATES,
        correction: bool = True,
        quantize: bool = False,
        alternatives: int = 0,
        corrector: EagleHead | str | os.PathLike | None = None,
        far_memory: FarMemoryConfig | None = None,
        path_confidence: float | None = None,
        path_rule: str | None = None,
        name: str = "parallel",
    ) -> None:
        target_model, self.tokenizer, head, draft_vocab = resolve_head(target, head, draft_vocab, ParallelHead, load_parallel_head, "ParallelDrafter", quantize=quantize)
        if corrector is not None and not correction:
            raise ValueError("corrector scores contextual correction: it needs correction=True")
        path_rule = (PARALLEL_PATH_RULE if corrector is not None else "lattice") if path_rule is None else path_rule
        if path_rule not in PATH_RULES:
            raise ValueError(f"path_rule must be one of {', '.join(PATH_RULES)} (or None), got {path_rule!r}")
        if path_rule == "successor" and corrector is None:
            raise ValueError("path_rule 'successor' drafts the corrector's own next tokens: it needs an EAGLE corrector (corrector=...)")
        # The EAGLE head's own draft vocabulary is not used: the fit reads the m candidates' LM-head rows.
        self.corrector = None if corrector is None else resolve_head(target, corrector, None, EagleHead, load_head, "ParallelDrafter(corrector)", quantize=quantize)[2]
        block_size = head.config.block_size if block_size is None else block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= head.config.block_size:
            raise ValueError(f"block_size must be an integer in [1, {head.config.block_size}] (the head's K), got {block_size!r}")
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")
        self.path_confidence = checked_threshold(path_confidence, "path_confidence") or None  # 0 = off
        self.far_memory = checked_far_memory(far_memory)
        self.head = head
        self.block_size, self.candidates, self.correction, self.name = block_size, candidates, correction, name
        self.path_rule = path_rule
        self.alternatives = checked_alternatives(alternatives)
        self.embed = target_model.get_input_embeddings()
        target_lm_head = target_model.get_output_embeddings()
        self.vocab_ids, self.lm_head = reduced_lm_head(target_lm_head, draft_vocab, quantize=quantize)
        # The pair fit reads only the m candidates' rows: taken (float32) from the target's own LM
        # head, shared, whatever precision the drafting head runs in.
        self.lm_head_rows = target_lm_head.weight  # [vocab, hidden]
        draft_vocab_size = int(target_lm_head.weight.shape[0] if self.vocab_ids is None else len(self.vocab_ids))
        if max(candidates, alternatives + 1) > draft_vocab_size:
            raise ValueError(f"candidates ({candidates}) or alternatives + 1 ({alternatives + 1}) exceeds the draft vocabulary ({draft_vocab_size} tokens)")

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "ParallelSession":
        far_memory = self.far_memory.for_prompt(len(prompt_ids)) if self.far_memory is not None else None
        return ParallelSession(self, self.alternatives, far_memory, sampling)


@dataclass
class BlockDrafts:
    """What :func:`draft_paths` drafted for B rows, and the lattice it chose from."""

    tokens: torch.Tensor  # [B, count] long: the drafted path's token ids (a row's first ``lengths[b]`` are drafted)
    lengths: torch.Tensor  # [B] long: drafts each row keeps (``count``, or fewer where the path stop ends it)
    passes: int  # head passes run: 1, or 2 with correction
    row_passes: torch.Tensor  # [B] long: the passes each row's drafts took (1, or 2 where its path was corrected)
    log_probs: torch.Tensor  # [B, count, width]: log q_draft of each position's candidates, best first
    candidates: torch.Tensor  # [B, count, width] long: their token ids
    choice: torch.Tensor  # [B, count] long: the drafted candidate's rank at each position


def draft_paths(
    drafter: ParallelDrafter,
    encoded: list,  # per layer (keys, values) # [1, kv_heads, P, head_dim]: the context, shared by every row; or SequencePrefixes: row b's own
    anchors: torch.Tensor,  # [B, hidden]: h of each row's last visible context position
    starts: torch.Tensor,  # [B] long: each row's block position (its context length L)
    count: int,  # drafts per row, 1 .. the head's K
    visible: torch.Tensor | None = None,  # [B, P] bool: context positions each row sees (None: all)
    width: int | None = None,  # candidates ranked per position (default: the drafter's m; more for runner-ups)
    corrector_context: KeysValues | SequencePrefixes | None = None,  # [1, kv_heads, P, head_dim]: the corrector's cached context (with a corrector)
    far_memory: FarMemoryConfig | None = None,  # the setting the context was encoded with (a session's, "auto" resolved); None: as trained
    row_counts: torch.Tensor | None = None,  # [B] long: each row's most drafts, <= count (None: count each)
) -> BlockDrafts:
    """The drafted path of each of B rows (the lattice of the drafter's m best per position).

    B rows drafted at once: a round of decoding (B = 1), every start of a recorded text
    (:mod:`verispec.drafters.parallel.acceptance`) or a server round's requests, each with its own
    context (``encoded`` and ``corrector_context`` as :class:`SequencePrefixes`) and its own
    ``row_counts``; a row's path is the one it gets drafted alone with ``count`` its own (a block's
    slots see each other whatever ``count`` is, and the lattice of a row ends at its own count).
    """
    head = drafter.head
    hidden = head.draft_block(encoded, anchors, starts, context_visible=visible, far_memory=far_memory)[:, :count]  # [B, count, hidden]
    if head.config.first_from_anchor:  # the first draft as EAGLE makes it (see ParallelConfig)
        hidden = torch.cat((head.norm(anchors)[:, None], hidden[:, 1:]), dim=1)
    log_probs = drafter.lm_head(hidden).float().log_softmax(-1)  # [B, count, draft_vocab]
    if drafter.correction and drafter.path_rule == "successor" and count > 1 and drafter.candidates > 1:
        return _successor_paths(drafter, corrector_context, hidden, log_probs, starts, visible, far_memory, row_counts, max(drafter.candidates, width or 0))
    ranked, index = log_probs.topk(max(drafter.candidates, width or 0), dim=-1)  # [B, count, width]: best first
    unary, lattice = ranked[..., : drafter.candidates], index[..., : drafter.candidates]  # [B, count, m]
    choice = torch.zeros(index.shape[:2], dtype=torch.long)  # [B, count]: top-1 per position
    passes, row_passes = 1, torch.ones(len(index), dtype=torch.long)
    # No path is likelier than the top-1 one, so the path stop keeps at most as many drafts of any
    # path as of the top-1 path (its first below the threshold included): correcting positions past
    # those would choose drafts nobody verifies. Each row's lattice ends there; the pair fit runs to
    # the longest row's end.
    reach = path_lengths(ranked[..., 0].cumsum(-1), drafter.path_confidence, row_counts)  # [B]
    corrected = int(reach.max())
    if drafter.correction and corrected > 1 and drafter.candidates > 1:
        if drafter.corrector is not None:
            pair = _successor_fit(drafter, corrector_context, hidden[:, :corrected], starts, lattice[:, :corrected], visible, far_memory, head.config.first_from_anchor)  # [B, corrected-1, m, m]
        else:
            pair = _pair_fit(drafter, encoded, anchors, starts, lattice[:, :corrected], visible, far_memory, head.config.first_from_anchor)
        if head.config.first_from_anchor:
            # The anchor's first draft is EAGLE's own next-token readout over the real context, the
            # best-informed of the block: the fit may choose what follows it, never overrule it
            # (measured: overruling it lowered the first draft's acceptance on 8 of 13 Spec-Bench categories).
            first = torch.cat((unary[:, :1, :1], torch.full_like(unary[:, :1, 1:], -math.inf)), dim=2)  # [B, 1, m]: top-1 only
            unary = torch.cat((first, unary[:, 1:]), dim=1)
        for row, length in enumerate(reach.tolist()):
            if length > 1:
                choice[row, :length] = best_path(unary[row, :length], pair[row, : length - 1])[0]
                row_passes[row] = 2
        passes = 2
    token_ids = index if drafter.vocab_ids is None else drafter.vocab_ids[index]  # [B, count, width]
    path_log_probs = ranked.gather(-1, choice[..., None])[..., 0].cumsum(-1)  # [B, count]: log prod_{j<=i} q_draft_j(path_j)
    lengths = path_lengths(path_log_probs, drafter.path_confidence, row_counts)
    return BlockDrafts(token_ids.gather(-1, choice[..., None])[..., 0], lengths, passes, row_passes, ranked, token_ids, choice)


def path_lengths(
    path_log_probs: torch.Tensor,  # [B, count]: log of each path's probability up to and including position i
    path_confidence: float | None,
    row_counts: torch.Tensor | None = None,  # [B] long: each row's most drafts (None: count each)
) -> torch.Tensor:
    """Drafts kept per row # [B] long: up to and including the first position whose path probability
    is below ``path_confidence`` (all ``count``, or the row's own count, if none is, or without a threshold)."""
    batch, count = path_log_probs.shape
    most = torch.full((batch,), count, dtype=torch.long) if row_counts is None else row_counts.clamp(max=count)
    if path_confidence is None:
        return most
    # The path probability only falls along the path, so the positions at or above the threshold
    # are a prefix; the first one below it is kept too.
    return torch.minimum((path_log_probs >= math.log(path_confidence)).sum(-1) + 1, most)


def _successor_paths(
    drafter: ParallelDrafter,
    context: KeysValues | SequencePrefixes | None,  # [1, kv_heads, P, head_dim]: the corrector's cached context (or each row's own)
    slot_features: torch.Tensor,  # [B, count, hidden]: ĥ_i, the drafted feature of each position (the anchor's at 0 when first_from_anchor)
    log_probs: torch.Tensor,  # [B, count, draft_vocab]: the block's log q_draft_i
    starts: torch.Tensor,  # [B] long: block positions L
    visible: torch.Tensor | None,  # [B, P] bool or None
    far_memory: FarMemoryConfig | None,
    row_counts: torch.Tensor | None,  # [B] long or None
    width: int,  # candidates ranked per position (>= m; more for runner-ups)
) -> BlockDrafts:
    """Paths drafted by the corrector's successors (``path_rule="successor"``), one corrector call.

    The pair fit's rows already hold, for each candidate c at position i, the corrector's feature
    for position i+1 after c (at i = 0, after the anchor's first draft: an EAGLE second step on the anchor's feature).
    Read over the block's S = SUCCESSOR_CANDIDATES likeliest tokens at i+1 (S LM-head rows, not the
    whole draft vocabulary, whose product cost as much as the gain in a timed run) it gives

        log q(x | c) = log softmax_{x in S}( W_x · EAGLE(ĥ_i, embed(c)) ) + log Σ_{y in S} q_draft_{i+1}(y)

    the corrector's choice among them, weighted by the block's mass on them (measured as good as the
    whole vocabulary's distribution for the path and its stop). The path starts with position 0's
    top-1 and continues

        path_{i+1} = argmax_x q(x | path_i)    while path_i is one of the block's m candidates at i

    (only they have a row: a successor outside them ends the path there, kept). The path stop reads
    the path's probability q_draft_0(path_0) · ∏ q(path_{i+1} | path_i), as EAGLE's stop does. On
    HumanEval problems 100-115 (replayed greedy decoding, README Performance 2026-12-08 (small
    hours)) the third draft was accepted in 0.17 of rounds (γ 3), the EAGLE head's in 0.19, the
    lattice's best path's in 0.11. BlockDrafts' candidates are the block's at position 0 and, after
    it, the successor's best after the path's token (runner-ups for draft trees; choice 0 everywhere).
    """
    batch, count, vocab = log_probs.shape
    block_ranked, block_index = log_probs.topk(min(max(SUCCESSOR_CANDIDATES, width), vocab), dim=-1)  # [B, count, S]: best first (S >= m: width >= m)
    lattice = block_index[..., : drafter.candidates]  # [B, count, m]
    following, position, owner, row_of = _corrector_steps(drafter, context, slot_features, starts, lattice, visible, far_memory, drafter.head.config.first_from_anchor)
    next_index = block_index[owner, position + 1]  # [rows, S]: the block's S likeliest at each row's next position
    next_rows = drafter.lm_head_rows[next_index if drafter.vocab_ids is None else drafter.vocab_ids[next_index]].float()  # [rows, S, hidden]
    successor = torch.einsum("rh,rsh->rs", following.float(), next_rows).log_softmax(-1) + block_ranked[owner, position + 1].logsumexp(-1, keepdim=True)
    successor_ranked, order = successor.topk(width, dim=-1)  # [rows, width]
    successor_index = next_index.gather(-1, order)
    path_ranked, path_index = block_ranked[..., :width].clone(), block_index[..., :width].clone()  # [B, count, width]: position 0 stays the block's
    chain = torch.ones(batch, dtype=torch.long)  # [B]: drafts the chain reaches (position 0 always)
    rank = torch.zeros(batch, dtype=torch.long)  # [B]: the path token's rank among position i's m candidates
    has_row = torch.ones(batch, dtype=torch.bool)  # [B]: position i's path token has a successor row
    for i in range(count - 1):
        row = row_of[torch.arange(batch), i, rank]  # [B]
        path_ranked[:, i + 1], path_index[:, i + 1] = successor_ranked[row], successor_index[row]
        chain += has_row.long()
        matches = lattice[:, i + 1] == successor_index[row, :1]  # [B, m]: where path_{i+1} sits in the lattice
        has_row &= matches.any(-1)
        rank = matches.long().argmax(-1)
    most = chain if row_counts is None else torch.minimum(chain, row_counts)
    lengths = path_lengths(path_ranked[..., 0].cumsum(-1), drafter.path_confidence, most)
    token_ids = path_index if drafter.vocab_ids is None else drafter.vocab_ids[path_index]  # [B, count, width]
    choice = torch.zeros(batch, count, dtype=torch.long)
    row_passes = torch.full((batch,), 2, dtype=torch.long) if row_counts is None else 1 + (row_counts > 1).long()  # a 1-draft row reads no successor
    return BlockDrafts(token_ids[..., 0], lengths, 2, row_passes, path_ranked, token_ids, choice)


def path_runner_ups(drafts: BlockDrafts, row: int, count: int) -> list[tuple[int, int, float]]:
    """(position i, token, score) of the ``count`` best other candidates at each drafted position of
    one row's path: score = q_draft(path[:i]) · q_draft_i(token), from the block's own per-position
    distributions (the path's probability up to i and the runner-up's at i)."""
    if count <= 0:
        return []
    length = int(drafts.lengths[row])
    log_probs, candidates, choice = drafts.log_probs[row], drafts.candidates[row], drafts.choice[row, :length].tolist()
    alternatives, path = [], 0.0  # path: log q_draft of the drafted tokens before position i
    for position, chosen in enumerate(choice):
        others = [rank for rank in range(candidates.shape[1]) if rank != chosen][:count]
        alternatives += [(position, int(candidates[position, rank]), math.exp(path + float(log_probs[position, rank]))) for rank in others]
        path += float(log_probs[position, chosen])
    return alternatives


def _pair_fit(
    drafter: ParallelDrafter,
    encoded: list,  # per layer # [1, kv_heads, P, head_dim]
    anchors: torch.Tensor,  # [B, hidden]
    starts: torch.Tensor,  # [B] long
    index: torch.Tensor,  # [B, count, m]: candidate indices into the draft vocabulary
    visible: torch.Tensor | None,  # [B, P] bool or None
    far_memory: FarMemoryConfig | None = None,  # the setting the context was encoded with; None: as trained
    first_pinned: bool = False,  # position 0 is its top-1 whatever the fit says (see _candidate_rows)
) -> torch.Tensor:
    """pair[b, i, c, c'] # [B, count-1, m, m] from one batched pass of B·(count-1)·m blocks: slot i known as candidate c."""
    block, hidden_size = drafter.head.config.block_size, drafter.head.config.hidden_size
    position, owner, tokens, row_visible, row_of = _candidate_rows(drafter, index, visible, first_pinned)
    rows = len(position)
    known = torch.zeros(rows, block, dtype=torch.bool)
    known[torch.arange(rows), position] = True
    known_embeds = torch.zeros(rows, block, hidden_size)
    known_embeds[torch.arange(rows), position] = drafter.embed(tokens).float()
    encoded = [for_rows(layer, rows // len(index)) for layer in encoded]  # each row b became its candidate rows
    hidden = drafter.head.draft_block(encoded, anchors[owner], starts[owner], known_embeds, known, row_visible, far_memory=far_memory)  # [rows, K, hidden]
    following = hidden[torch.arange(rows), position + 1]  # [rows, hidden]: ĥ_{i+1}
    return _fit_over_candidates(drafter, following[row_of], index)


def _successor_fit(
    drafter: ParallelDrafter,
    context: KeysValues | SequencePrefixes | None,  # [1, kv_heads, P, head_dim]: the corrector's cached context (or each row's own)
    slot_features: torch.Tensor,  # [B, count, hidden]: ĥ_i, the drafted feature of each position
    starts: torch.Tensor,  # [B] long: block positions L
    index: torch.Tensor,  # [B, count, m]: candidate indices into the draft vocabulary
    visible: torch.Tensor | None,  # [B, P] bool or None
    far_memory: FarMemoryConfig | None = None,  # the setting the context was encoded with; None: as trained
    first_pinned: bool = False,  # position 0 is its top-1 whatever the fit says (see _candidate_rows)
) -> torch.Tensor:
    """pair[b, i, c, c'] # [B, count-1, m, m] from the EAGLE corrector, ONE call of B·(count-1)·m steps
    (B·((count-2)·m + 1) with ``first_pinned``).

    Position i's drafted feature ĥ_i stands for f_{L+i}, whose token x_{L+1+i} is candidate c; the
    EAGLE step at position L+i reads (ĥ_i, embed(c)) — the token one step ahead, as EAGLE was
    trained — and predicts f_{L+i+1}, the feature that drafts position i+1:

        pair[i, c, c'] = log softmax_{c'}( W_{cand[i+1, c']} · EAGLE(ĥ_i, embed(cand[i, c]) | context) )

    Unlike the parallel head's own known-slot pass, the successor is conditioned on c through the
    layer's input, not only through attention. Each step sees the real context, not the other
    drafted positions."""
    following, _, _, row_of = _corrector_steps(drafter, context, slot_features, starts, index, visible, far_memory, first_pinned)
    return _fit_over_candidates(drafter, following[row_of], index)


def _corrector_steps(
    drafter: ParallelDrafter,
    context: KeysValues | SequencePrefixes | None,  # [1, kv_heads, P, head_dim]: the corrector's cached context (or each row's own)
    slot_features: torch.Tensor,  # [B, count, hidden]: ĥ_i
    starts: torch.Tensor,  # [B] long: block positions L
    index: torch.Tensor,  # [B, count, m]: candidate indices into the draft vocabulary
    visible: torch.Tensor | None,  # [B, P] bool or None
    far_memory: FarMemoryConfig | None,
    first_pinned: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The corrector's step on (ĥ_i, embed(cand[i, c])) at position L+i for every row of
    :func:`_candidate_rows`, in ONE call: (predicted features # [rows, hidden], each row's position i
    # [rows], its drafted row b # [rows], row_of # [B, count-1, m]) — what the pair fit and the
    successor paths both read."""
    if context is None:
        raise ValueError("a corrector's pair fit needs its cached context (corrector_context)")
    position, owner, tokens, row_visible, row_of = _candidate_rows(drafter, index, visible, first_pinned)
    features = slot_features[owner, position].float()  # [rows, hidden]: ĥ_i of each step
    context = for_rows(context, len(position) // len(index))  # each row b became its candidate rows
    following = drafter.corrector.independent_steps(features, drafter.embed(tokens).float(), starts[owner] + position, context, row_visible, far_memory=far_memory)  # [rows, hidden]
    return following, position, owner, row_of


def _candidate_rows(
    drafter: ParallelDrafter,
    index: torch.Tensor,  # [B, count, m]: candidate indices into the draft vocabulary
    visible: torch.Tensor | None,  # [B, P] bool or None
    first_pinned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One row per (drafted row b, position i < count-1, candidate c), in that order, as both pair
    fits lay them out: (i # [rows], b # [rows], candidate c's token id # [rows], b's visible context
    # [rows, P] or None, row_of # [B, count-1, m] long: the row that scores each (b, i, c)).

    ``first_pinned``: the path keeps position 0's top-1 (``ParallelConfig.first_from_anchor``), so
    only candidate 0 at position 0 is ever followed: its row alone is computed and serves all of
    position 0's (c = 1.. read it too; their paths score -inf whatever their fit). With the path
    stop most corrected rounds reach 2 positions, where that is 1 row instead of m."""
    batch, count, width = index.shape
    per_position = torch.full((count - 1,), width)  # rows at each position i < count-1
    if first_pinned:
        per_position[0] = 1
    first_row = per_position.cumsum(0) - per_position  # [count-1]: a drafted row's first row at each position
    per_owner = int(per_position.sum())
    position = torch.arange(count - 1).repeat_interleave(per_position).repeat(batch)  # [rows]
    rank = (torch.arange(per_owner) - first_row.repeat_interleave(per_position)).repeat(batch)  # [rows]: c
    owner = torch.arange(batch).repeat_interleave(per_owner)
    tokens = index[owner, position, rank]
    tokens = tokens if drafter.vocab_ids is None else drafter.vocab_ids[tokens]
    row_of = torch.arange(batch)[:, None, None] * per_owner + first_row[None, :, None] + torch.minimum(torch.arange(width)[None, :], per_position[:, None] - 1)[None]
    return position, owner, tokens, None if visible is None else visible[owner], row_of


def _fit_over_candidates(
    drafter: ParallelDrafter,
    following: torch.Tensor,  # [B, count-1, m, hidden]: the feature predicted for position i+1 after candidate c at i
    index: torch.Tensor,  # [B, count, m]: candidate indices into the draft vocabulary
) -> torch.Tensor:
    """log softmax over the m candidates at i+1 of their LM-head logits # [B, count-1, m, m]."""
    following_ids = index[:, 1:] if drafter.vocab_ids is None else drafter.vocab_ids[index[:, 1:]]  # [B, count-1, m] token ids
    candidate_rows = drafter.lm_head_rows[following_ids].float()  # [B, count-1, m, hidden]: W rows of the candidates at i+1
    return torch.einsum("bich,bijh->bicj", following.float(), candidate_rows).log_softmax(-1)


class ParallelSession:
    def __init__(self, drafter: ParallelDrafter, alternatives: int = 0, far_memory: FarMemoryConfig | None = None, sampling: SamplingParams | None = None) -> None:
        self.drafter, self.alternatives = drafter, alternatives
        self.far_memory = far_memory  # this request's attention ("auto" resolved by the prompt's length); None: as trained
        self.sampling = SamplingParams() if sampling is None else sampling  # read only to decide who drafts together
        self.caches = [LayerKVCache() for _ in drafter.head.layers]
        self.corrector_cache = LayerKVCache()  # the corrector's keys/values of the same positions (with a corrector)
        self.num_real = 0  # context positions encoded (0 .. num_real-1), all with real target features
        self.anchor: torch.Tensor | None = None  # [1, hidden]: output h of the last encoded position

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        return ParallelSession.propose_many([self], [context], [max_tokens], [generator])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(sessions: list["ParallelSession"], contexts: list[DraftContext], max_tokens: list[int], generators: list[torch.Generator]) -> list[Proposal]:
        """One proposal per session (batched serving): the sessions of one drafter catch up in one
        call of the head (and one of the corrector) and draft their blocks, and correct them, in one
        :func:`draft_paths` call, each row attending to its own session's caches
        (:class:`~verispec.drafters.shared_prefix.SequencePrefixes`). Why: alone a corrected round
        reads the head's weights 2-3 times, the corrector's once (and its fc and key/value
        projections for the catch-up) and the LM head's draft rows once (~200 MB of int8 weights
        for the 1.5B target, ~15-20 ms on a 2-core EPYC), and a server round
        of 8 requests paid that 8 times. The drafts are deterministic (no generator is read);
        :func:`~verispec.drafters.base.lockstep_groups` says who drafts alone."""
        proposals = [Proposal([], None)] * len(sessions)
        for indices in lockstep_groups(sessions):
            drafted = _draft_together([sessions[i] for i in indices], [contexts[i] for i in indices], [max_tokens[i] for i in indices])
            for index, proposal in zip(indices, drafted):
                proposals[index] = proposal
        return proposals

    def _catch_up(self, context: DraftContext) -> int:
        """Encode every real feature the head (and the corrector) has not seen; return the number of
        head calls (0, 1, or 2 with a corrector)."""
        rows = unseen_context_rows(context, self.num_real, "parallel")
        if rows is None:
            return 0
        fresh, next_tokens = rows
        features, embeds = fresh[None].float(), self.drafter.embed(next_tokens[None]).float()  # [1, n, hidden] each
        far_memory = self.far_memory
        _, outputs = self.drafter.head.encode_context(features, embeds, start=self.num_real, caches=self.caches, far_memory=far_memory, last_only=True)
        if self.drafter.corrector is not None:  # only its keys/values are read later
            self.drafter.corrector.append_keys_values([features[0]], [embeds[0]], [self.corrector_cache], [far_memory])
        self.anchor = outputs[:, -1]
        self.num_real += len(fresh)
        return 1 if self.drafter.corrector is None else 2

    def close(self) -> None:
        self.caches = [LayerKVCache() for _ in self.drafter.head.layers]
        self.corrector_cache = LayerKVCache()
        self.num_real, self.anchor = 0, None


def _draft_together(sessions: list[ParallelSession], contexts: list[DraftContext], max_tokens: list[int]) -> list[Proposal]:
    """Proposals of sessions sharing one drafter (:meth:`ParallelSession.propose_many`); a lone
    session drafts over its own caches (far memory included) as it always did."""
    drafter = sessions[0].drafter
    passes = _catch_up_many(sessions, contexts)
    proposals = [Proposal([], None, num_forward_passes=count) for count in passes]
    # A session drafts once the head has read every real feature (not yet: a 1-token prompt).
    ready = [i for i, (session, context) in enumerate(zip(sessions, contexts)) if max_tokens[i] > 0 and session.num_real > 0 and session.num_real == len(context.token_ids) - 1]
    if not ready:
        return proposals
    counts = [min(drafter.block_size, max_tokens[i]) for i in ready]
    if len(ready) == 1:
        session = sessions[ready[0]]
        encoded = [cached(cache) for cache in session.caches]
        corrector_context = cached(session.corrector_cache) if drafter.corrector is not None else None
        far_memory = session.far_memory
    else:  # sessions drafting together attend as trained (lockstep_groups)
        encoded = [SequencePrefixes([cached(sessions[i].caches[layer]) for i in ready], [1] * len(ready)) for layer in range(len(drafter.head.layers))]
        corrector_context = SequencePrefixes([cached(sessions[i].corrector_cache) for i in ready], [1] * len(ready)) if drafter.corrector is not None else None
        far_memory = None
    anchors = torch.cat([sessions[i].anchor for i in ready])  # [ready, hidden]
    starts = torch.tensor([sessions[i].num_real for i in ready])
    width = 1 + max(sessions[i].alternatives for i in ready)
    drafts = draft_paths(drafter, encoded, anchors, starts, max(counts), width=width, corrector_context=corrector_context, far_memory=far_memory, row_counts=torch.tensor(counts))
    for row, index in enumerate(ready):
        tokens = drafts.tokens[row, : int(drafts.lengths[row])].tolist()
        alternatives = path_runner_ups(drafts, row, sessions[index].alternatives)
        proposals[index] = Proposal(tokens=tokens, probs=None, num_forward_passes=passes[index] + int(drafts.row_passes[row]), alternatives=alternatives)
    return proposals


def _catch_up_many(sessions: list[ParallelSession], contexts: list[DraftContext]) -> list[int]:
    """Every session encodes the real features it has not seen (:meth:`ParallelSession._catch_up`): a
    round's few rows per session in one call of the head (:meth:`ParallelHead.encode_many`) and one
    of the corrector (:meth:`EagleHead.append_keys_values`: only its cached keys/values are read later),
    a prompt or a lone session in its own calls. Returns each session's head calls (0, 1, or 2 with a corrector)."""
    drafter = sessions[0].drafter
    passes, few, features, embeds = round_catch_ups(sessions, contexts, "parallel", DISTINCT_EMBEDS_FROM_ROWS, drafter.embed)
    if few:
        anchors = drafter.head.encode_many(features, embeds, [sessions[index].caches for index in few])  # [len(few), hidden]
        if drafter.corrector is not None:
            drafter.corrector.append_keys_values(features, embeds, [sessions[index].corrector_cache for index in few])
        for index, rows, anchor in zip(few, features, anchors):
            sessions[index].num_real += len(rows)
            sessions[index].anchor = anchor[None]
            passes[index] = 1 if drafter.corrector is None else 2
    return passes
