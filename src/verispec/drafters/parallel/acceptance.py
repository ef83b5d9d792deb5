"""Greedy acceptance of a parallel drafter on recorded text, without decoding it.

A greedy round whose catch-up ends at context row r (the head has encoded rows 0..r, each
(f_i, x_{i+1}), so its anchor is that row's output and its block starts at position r+1) drafts
x_{r+2} .. x_{r+1+K}. While drafts are accepted they ARE the text's tokens, so the round the engine
would run from row r is the head's block drafted with the text's context up to row r. The context
is encoded once for the whole text (causal: row i's keys are the same as the cached catch-up's),
and every start's block — and, with correction, its (K-1)·m known-slot blocks — sees only its own
rows through a visibility mask: the same :func:`~verispec.drafters.parallel.drafter.draft_paths`
a decoding round runs, over many rows at once. Acceptance is then counted as for EAGLE
(:func:`~verispec.drafters.eagle.acceptance.accepted_prefixes`, a path the stop rule ended early
counting only its kept drafts) and :func:`~verispec.drafters.eagle.acceptance.replay_rounds`
replays the rounds with each start's number of drafts.

Near the end of a text the engine drafts fewer than K (it never drafts past what it could emit);
replay scores such a round on the first drafts of a full block, which can differ from a shorter
corrected path: a last round or two per answer.
"""

from __future__ import annotations

import torch

from verispec.drafters.eagle.acceptance import accepted_prefixes, check_recorded_text
from verispec.drafters.parallel.drafter import ParallelDrafter, draft_paths
from verispec.drafters.parallel.head import cached
from verispec.engine.kv_cache import LayerKVCache


@torch.no_grad()
def accepted_from_every_start(
    drafter: ParallelDrafter,
    tokens: torch.Tensor,  # [n] int64: the text x_0..x_{n-1}
    features: torch.Tensor,  # [n, hidden]: the target's features f_0..f_{n-1} on that text
    gamma: int,
    target_choice: torch.Tensor,  # [n] long: the target's argmax at each row (:func:`~verispec.drafters.eagle.acceptance.target_choices`)
    starts_per_call: int = 32,  # rows drafted together (memory: the correction pass runs (K-1)·m blocks per row)
    first_row: int = 0,  # rounds before this row are not drafted (0 there): a prompt's rows, which decoding never starts from
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafted # [n-2], accepted # [n-2]) by a greedy round whose catch-up ends at row r, r = 0..n-3:
    the drafts it makes (min(gamma, K), fewer where the drafter's path stop ends the path) and how
    many of them are accepted (r < first_row: 0, not drafted)."""
    check_recorded_text(tokens, features, gamma)
    if drafter.far_memory is not None:  # the whole-text encoding below is the trained attention's
        raise ValueError("replay runs the head as trained: pass a drafter without far_memory")
    num_tokens = len(tokens)
    if num_tokens < 3:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    count = min(drafter.block_size, gamma)
    embeds = drafter.embed(tokens[None, 1:]).float()  # [1, n-1, hidden]: x_{i+1} of context row i
    context_features = features[None, :-1].float()  # [1, n-1, hidden]: f_i of context row i
    context, outputs = drafter.head.encode_context(context_features, embeds)
    corrector_context = None
    if drafter.corrector is not None:  # its keys/values of every context row, as its cached catch-up holds them
        corrector_cache = LayerKVCache()
        drafter.corrector.append_keys_values([context_features[0]], [embeds[0]], [corrector_cache])
        corrector_context = cached(corrector_cache)
    rows = torch.arange(num_tokens - 1)
    skipped = min(first_row, num_tokens - 2)
    drafted = [torch.full((skipped, count), -2, dtype=torch.long)]  # rows no round starts from
    lengths = [torch.zeros(skipped, dtype=torch.long)]
    for first in range(first_row, num_tokens - 2, starts_per_call):
        last_rows = torch.arange(first, min(first + starts_per_call, num_tokens - 2))  # [B]: r, each round's last context row
        visible = rows[None] <= last_rows[:, None]  # [B, n-1]
        paths = draft_paths(drafter, context, outputs[0, last_rows], last_rows + 1, count, visible, corrector_context=corrector_context)
        # A draft past the path's end is never verified: -2 matches no token.
        drafted.append(paths.tokens.masked_fill(torch.arange(count)[None] >= paths.lengths[:, None], -2))
        lengths.append(paths.lengths)
    return torch.cat(lengths), accepted_prefixes(torch.cat(drafted), tokens, target_choice)
