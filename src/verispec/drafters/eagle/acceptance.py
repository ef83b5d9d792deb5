"""Greedy acceptance of an EAGLE head on recorded text, without decoding it.

In greedy decoding a round that starts after committed tokens x_0..x_{r+1} (target features
f_0..f_r) accepts draft k iff drafts 1..k-1 were accepted and draft k equals the target's argmax
at that position. While drafts are accepted they ARE the text's tokens, so the drafts a cached
drafting round would make are exactly the head's unrolled steps on the text
(:meth:`EagleHead.unrolled`): draft k of the round starting at row r is step k's prediction at
row r+k-1. One unrolled pass over a sequence therefore gives the number of accepted drafts of a
round starting at every position at once:

    accepted(r) = max { k <= gamma : for all j <= k,  draft_j(r) = x_{r+j+1} = argmax W f_{r+j} }

(requiring x_{r+j+1} to be the target's own choice keeps this exact on text the target did not
write; on the target's greedy answers it always is). :func:`replay_rounds` then replays the
rounds greedy decoding would run from the start of an answer: each round emits accepted + 1
tokens (the bonus included), exactly the engine's tokens per target call, in seconds instead of
minutes per prompt.

That shortcut runs the head as trained (uncached, full attention). :func:`replay_session_rounds`
replays the same greedy rounds through a drafter's own cached session instead — any far-memory
mode, an int8 head, any prompt length — at the cost of its real head calls (at 16K tokens: the
catch-up over the prompt, then a few milliseconds a call), still without any target pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.drafters.base import DraftContext, DraftSession
from verispec.drafters.eagle.head import EagleHead


@torch.no_grad()
def accepted_from_every_start(
    head: EagleHead,
    embed: torch.nn.Module,  # the target's input embedding
    lm_rows: torch.Tensor,  # [draft_vocab or vocab, hidden]: the LM-head rows the head drafts over
    vocab_ids: torch.Tensor | None,  # [draft_vocab] token id of each row; None: rows are the whole vocabulary
    tokens: torch.Tensor,  # [n] int64: the text x_0..x_{n-1}
    features: torch.Tensor,  # [n, hidden]: the target's features f_0..f_{n-1} on that text
    gamma: int,
    full_lm_head: torch.Tensor | None = None,  # [vocab, hidden]: the target's argmax; default lm_rows (vocab_ids None)
) -> torch.Tensor:
    """Drafts accepted (0..gamma) by a greedy round whose catch-up ends at row r, for r = 0..n-3 # [n-2]."""
    if full_lm_head is None:
        if vocab_ids is not None:
            raise ValueError("full_lm_head is needed to find the target's argmax when the head drafts over a reduced vocabulary")
        full_lm_head = lm_rows
    drafted = drafted_from_every_start(head, embed, lm_rows, vocab_ids, tokens, features, gamma)
    return accepted_prefixes(drafted, tokens, target_choices(features, full_lm_head))


@torch.no_grad()
def drafted_from_every_start(
    head: EagleHead,
    embed: torch.nn.Module,  # the target's input embedding
    lm_rows: torch.Tensor,  # [draft_vocab or vocab, hidden]: the LM-head rows the head drafts over
    vocab_ids: torch.Tensor | None,  # [draft_vocab] token id of each row; None: rows are the whole vocabulary
    tokens: torch.Tensor,  # [n] int64: the text x_0..x_{n-1}
    features: torch.Tensor,  # [n, hidden]: the target's features f_0..f_{n-1} on that text
    gamma: int,
) -> torch.Tensor:
    """The drafts of a greedy round whose catch-up ends at row r, r = 0..n-3 # [n-2, min(gamma, n-2)]
    (-2 past the text's end): the head's unrolled steps, one pass per step over the whole text."""
    check_recorded_text(tokens, features, gamma)
    num_tokens = len(tokens)
    if num_tokens < 3:
        return torch.zeros(0, 1, dtype=torch.long)
    features, lm_rows = features.float(), lm_rows.float()  # no-ops for float32 inputs
    steps = head.unrolled(features[None, :-1], embed(tokens[None, 1:]).float(), min(gamma, num_tokens - 2))
    num_starts = num_tokens - 2
    starts = torch.arange(num_starts)
    drafted = torch.full((num_starts, len(steps)), -2, dtype=torch.long)  # [starts, steps]: -2 past the text's end
    for step, predicted in enumerate(steps):  # step k = step+1 predicts x_{r+k+1} at row r+k-1
        drafts = (predicted[0].float() @ lm_rows.T).argmax(-1)  # [n-1] row of each step's draft
        drafts = vocab_ids[drafts] if vocab_ids is not None else drafts  # [n-1] token of row i's step
        rows = starts + step  # row r+k-1
        valid = rows < num_tokens - 1
        drafted[valid, step] = drafts[rows[valid]]
    return drafted


def check_recorded_text(tokens: torch.Tensor, features: torch.Tensor, gamma: int) -> None:
    """ValueError unless gamma >= 1 and tokens # [n] line up with features # [n, hidden]."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    if tokens.ndim != 1 or features.ndim != 2 or len(tokens) != len(features):
        raise ValueError(f"tokens # [n] and features # [n, hidden] must have the same length, got {tuple(tokens.shape)} and {tuple(features.shape)}")


def target_choices(
    features: torch.Tensor,  # [n, hidden]: the target's features f_0..f_{n-1} on a text
    full_lm_head: torch.Tensor,  # [vocab, hidden]: the target's LM head
) -> torch.Tensor:
    """The target's greedy choice for x_{i+1}, read at f_i # [n] long. Computed once per text: every
    drafter replayed on it is scored against the same choices (:func:`accepted_prefixes`)."""
    return F.linear(features.float(), full_lm_head.float()).argmax(-1)


def accepted_prefixes(
    drafted: torch.Tensor,  # [n-2, g] long: draft k+1 of the round starting at row r is drafted[r, k], a guess of x_{r+k+2}
    tokens: torch.Tensor,  # [n] int64: the text
    target_choice: torch.Tensor,  # [n] long: :func:`target_choices` of the text
) -> torch.Tensor:
    """Drafts a greedy round starting at each row r accepts # [n-2]: the longest prefix of its drafts that
    equals the text, where the text at each drafted position is the target's own argmax."""
    num_tokens, gamma = len(tokens), drafted.shape[1]
    # whether the text took the target's choice
    text_is_target = torch.zeros(num_tokens + gamma, dtype=torch.bool)  # padded: positions past the end never match
    text_is_target[1:num_tokens] = tokens[1:] == target_choice[:-1]  # at index t: x_t is the target's choice
    padded_tokens = torch.cat((tokens, torch.full((gamma,), -1, dtype=tokens.dtype)))
    position = torch.arange(len(drafted))[:, None] + 2 + torch.arange(gamma)  # [n-2, g]: x_{r+k+2}
    matches = (drafted == padded_tokens[position]) & text_is_target[position]
    return matches.long().cumprod(dim=1).sum(dim=1)


def replay_rounds(
    accepted: torch.Tensor,  # [n-2] long: drafts accepted by the round whose catch-up ends at each row
    first_row: int,
    num_tokens: int,
    gamma: int,
    drafted: torch.Tensor | None = None,  # [n-2] long: drafts that round makes (None: gamma every round)
) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round greedy decoding runs over a recorded answer; a round
    emits accepted + 1 tokens (the bonus included), so tau = sum(accepted + 1) / rounds.

    accepted # [n-2]: :func:`accepted_from_every_start` of the text x_0..x_{n-1} that was fed to
    the target; ``num_tokens``: the decoded sequence's length, n + 1 (its last token is emitted,
    never fed: the recorded answers of :func:`greedy_answers` leave it out); ``first_row``: the
    catch-up row of the first round, the prompt's length minus 2 (the engine prefills all of the
    prompt but its last token, which the first round feeds with the drafts of the answer's first
    tokens); ``drafted``: a drafter whose rounds can end early (a path stop) drafts this many from
    each row (never more than gamma). Like the engine, a round never drafts what it could not emit
    before the text's end.
    """
    if not 0 <= first_row:
        raise ValueError(f"first_row must be >= 0, got {first_row}")
    rounds = []
    row = first_row
    while row + 2 < num_tokens:  # a round emits x_{row+2} at least
        num_drafted = min(gamma, num_tokens - row - 3)  # leave room for the token verification adds
        if drafted is not None and num_drafted:
            num_drafted = min(num_drafted, int(drafted[row]))
        num_accepted = min(int(accepted[row]), num_drafted) if num_drafted else 0
        rounds.append((num_drafted, num_accepted))
        row += num_accepted + 1
    return rounds


def replay_session_rounds(
    session: DraftSession,
    sequence: torch.Tensor,  # [n] int64: the decoded sequence, the prompt then the target's greedy answer
    features: torch.Tensor,  # [n-1, hidden]: the target's features of every fed token (all but the last)
    prompt_length: int,
    gamma: int,
) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round greedy decoding runs over a recorded answer, asked of a
    feature-reading drafter's own session exactly as the engine asks it (:class:`SpeculativeDecoder`).

    Greedy verification accepts draft k iff drafts 1..k-1 were accepted and it is the target's
    token there — on the target's recorded greedy answer, the answer's token — so the target need
    not run: each round hands the session the features of the positions committed since its last
    round (after the prompt's prefill: positions 0..prompt_length-2), takes its drafts, accepts
    their longest prefix that equals the answer and commits that plus one token. Like the engine, a
    round drafts at most gamma and never what it could not emit before the answer's end. The
    session is closed before returning. Exact for any drafter whose greedy drafts depend only on
    the committed tokens and features (EAGLE with or without far memory, int8 or not).
    """
    check_recorded_text(sequence[:-1], features, gamma)
    if not 1 <= prompt_length < len(sequence):
        raise ValueError(f"prompt_length must be in [1, {len(sequence) - 1}] (an answer follows the prompt), got {prompt_length}")
    tokens = sequence.tolist()
    generator = torch.Generator().manual_seed(0)  # greedy drafting draws nothing; the protocol takes one
    rounds: list[tuple[int, int]] = []
    committed, handed = prompt_length, 0  # committed tokens; features handed to the session (positions 0..handed-1)
    try:
        while committed < len(tokens):
            num_draft = min(gamma, len(tokens) - committed - 1)
            drafts: list[int] = []
            if num_draft > 0:
                known = committed - 1  # the target's cache holds every committed token but the last
                fresh = features[handed:known] if known > handed else None  # [m, hidden]
                context = DraftContext(tokens[:committed], fresh, handed) if fresh is not None else DraftContext(tokens[:committed])
                handed = known
                drafts = session.propose(context, num_draft, generator).tokens
                if len(drafts) > num_draft:
                    raise RuntimeError(f"the session proposed {len(drafts)} tokens, asked for at most {num_draft}")
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == tokens[committed + num_accepted]:
                num_accepted += 1
            rounds.append((len(drafts), num_accepted))
            committed += num_accepted + 1
    finally:
        session.close()
    return rounds
