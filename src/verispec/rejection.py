"""Verification: the modified rejection sampler (Leviathan et al. 2022; Chen et al. 2023).

For draft tokens x_1..x_k drawn from q_draft, position by position:

    accept x_i with probability  accept_prob_i = min(1, p_target_i(x_i) / q_draft_i(x_i))

At the first rejection i, emit a *recovered* token drawn from the residual

    norm(max(0, p_target_i - q_draft_i))

and stop. If all k drafts are accepted, emit a *bonus* token drawn from p_target_{k+1}.
The emitted sequence is distributed exactly as sampling from p_target step by step.

A deterministic draft (n-gram lookup, a corrected parallel path) has q_draft = one-hot(x_i):
accept with probability p_target_i(x_i), otherwise sample from p_target_i with x_i removed.

Greedy decoding takes :func:`greedy_verify`, an exact argmax comparison that needs no
randomness and no probability tensors.

A one-level draft tree also offers runner-up tokens c_1..c_m for the rejected position; the
recovered token is then drawn through them (:func:`sample_through_candidates`): accept c_j with
probability r_j(c_j), where r_1 is the residual and r_{j+1} is r_j with c_j removed and
renormalised, else sample the last r. That is still exactly a draw from the residual.
"""

from __future__ import annotations

import torch

from verispec.sampling import sample_from

# Below this residual mass the residual is numerically meaningless (p_target ~= q_draft);
# the correct limit is then sampling from p_target itself.
_RESIDUAL_EPS = 1e-12


def rejection_sample(
    draft_tokens: torch.Tensor,  # Long[batch, k]
    draft_probs: torch.Tensor | None,  # Float[batch, k, vocab], or None for a deterministic draft
    target_probs: torch.Tensor,  # Float[batch, k+1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of the drafts and append one recovered or bonus token.

    Returns ``(output_tokens, num_accepted)``: ``output_tokens`` Long[batch, k+1] holds the
    ``num_accepted[b]`` accepted drafts, then the recovered (or bonus) token, then -1s;
    ``num_accepted`` Long[batch] is in 0..k.
    """
    num_accepted, p_next = accept_drafts(draft_tokens, draft_probs, target_probs, generator)
    next_token = sample_from(p_next, generator)  # [batch]
    batch, k = draft_tokens.shape
    rows = torch.arange(batch)
    output_tokens = torch.full((batch, k + 1), -1, dtype=torch.long)
    positions = torch.arange(k + 1).expand(batch, k + 1)
    output_tokens[:, :k] = torch.where(positions[:, :k] < num_accepted.unsqueeze(-1), draft_tokens, -1)
    output_tokens[rows, num_accepted] = next_token
    return output_tokens, num_accepted


def accept_drafts(
    draft_tokens: torch.Tensor,  # Long[batch, k]
    draft_probs: torch.Tensor | None,  # Float[batch, k, vocab], or None for a deterministic draft
    target_probs: torch.Tensor,  # Float[batch, k+1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject half of :func:`rejection_sample`: ``(num_accepted, p_next)``, num_accepted
    Long[batch] in 0..k and p_next Float[batch, vocab] the law of the one extra token: the residual
    norm(max(0, p_target - q_draft)) at the first rejection, p_target after the last draft."""
    _check_inputs(draft_tokens, draft_probs, target_probs)
    batch, k = draft_tokens.shape
    target_probs = target_probs.float()
    rows = torch.arange(batch)

    p_target_at_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    if draft_probs is None:
        q_draft_at_draft = torch.ones_like(p_target_at_draft)
    else:
        draft_probs = draft_probs.float()
        q_draft_at_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        if (q_draft_at_draft <= 0).any():
            raise ValueError("draft_tokens contains a token with zero probability under draft_probs")
    accept_prob = (p_target_at_draft / q_draft_at_draft).clamp(max=1.0)  # [batch, k]
    uniform = torch.rand(batch, k, generator=generator)
    accepted = uniform < accept_prob  # strict: a token with p_target = 0 is never accepted
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [batch] length of the accepted prefix

    # The distribution of the one extra token: residual at the first rejection, p_target after k.
    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < k
    if rejected.any():
        reject_pos = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, reject_pos].unsqueeze(-1), 1.0)
        else:
            q_next = draft_probs[rows, reject_pos]
        residual = (p_next - q_next).clamp(min=0.0)
        residual_mass = residual.sum(-1, keepdim=True)
        use_residual = rejected.unsqueeze(-1) & (residual_mass > _RESIDUAL_EPS)
        p_next = torch.where(use_residual, residual / residual_mass.clamp(min=_RESIDUAL_EPS), p_next)
    return num_accepted, p_next


def sample_through_candidates(
    probs: torch.Tensor,  # Float[vocab]: the law to draw from (a residual, or p_target)
    candidates: torch.Tensor,  # Long[m]: distinct tokens to offer first, in order (a tree's runner-ups)
    generator: torch.Generator | None = None,
) -> tuple[int, int | None]:
    """Draw one token from ``probs``, offering ``candidates`` first; return (token, the index of
    the candidate taken, or None when the token was drawn from what remained).

    With r = probs normalised: accept c_j with probability

        accept_prob_j = r(c_j) / (1 - sum_{i<j} r(c_i))      (r_j(c_j): r without c_1..c_{j-1})

    at the first j whose uniform falls below it; when none does, draw from r with c_1..c_m removed.
    P(token = c_1) = r(c_1), and given "not c_1" the rest draws from r without c_1, so the token is
    distributed exactly as r, whichever candidates are offered (as long as they are chosen before
    these uniforms are drawn). All m uniforms are drawn at once (the rule is vectorised).
    """
    if candidates.dim() != 1 or candidates.dtype != torch.long:
        raise ValueError(f"candidates must be a Long tensor [m], got {candidates.dtype} {list(candidates.shape)}")
    if len(candidates) and (candidates.min() < 0 or candidates.max() >= probs.shape[-1]):
        raise ValueError(f"candidates must be token ids in [0, {probs.shape[-1]})")
    if len(candidates.unique()) != len(candidates):
        raise ValueError("candidates must be distinct tokens")
    probs = probs.float()
    total = probs.sum()
    candidate_mass = probs[candidates] / total  # [m]: r(c_j)
    mass_left = 1.0 - (candidate_mass.cumsum(0) - candidate_mass)  # [m]: 1 - sum_{i<j} r(c_i)
    # Left mass ~0: r is (numerically) all on candidates already refused; the limit takes c_j.
    accept_prob = torch.where(mass_left > _RESIDUAL_EPS, candidate_mass / mass_left.clamp(min=_RESIDUAL_EPS), torch.ones_like(candidate_mass))
    accepted = torch.rand(len(candidates), generator=generator) < accept_prob  # [m]
    if accepted.any():
        taken = int(accepted.long().argmax())
        return int(candidates[taken]), taken
    remaining = probs.clone()
    remaining[candidates] = 0.0
    if remaining.sum() <= _RESIDUAL_EPS * total:  # all mass on the candidates: rounding refused the last one
        return int(candidates[-1]), len(candidates) - 1
    return int(sample_from(remaining[None] / remaining.sum(), generator)[0]), None


def greedy_verify(
    draft_tokens: torch.Tensor,  # Long[batch, k]
    target_logits: torch.Tensor,  # Float[batch, k+1, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept drafts while they equal the target's argmax.

    Same return convention as :func:`rejection_sample`; the extra token is the target's
    argmax at the first mismatch (or after the last draft), so the output is exactly what
    plain greedy decoding of the target produces.
    """
    batch, k = draft_tokens.shape
    if target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_logits must be [batch, k+1, vocab] = [{batch}, {k + 1}, vocab], got {list(target_logits.shape)}")
    target_choice = target_logits.argmax(-1)  # [batch, k+1]
    matches = draft_tokens == target_choice[:, :k]
    num_accepted = matches.long().cumprod(-1).sum(-1)
    positions = torch.arange(k + 1).expand(batch, k + 1)
    output_tokens = torch.where(positions <= num_accepted.unsqueeze(-1), target_choice, -1)
    return output_tokens, num_accepted


def _check_inputs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a Long tensor [batch, k], got {draft_tokens.dtype} {list(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [batch, k+1, vocab] = [{batch}, {k + 1}, vocab], got {list(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [batch, k, vocab] = [{batch}, {k}, {vocab}], got {list(draft_probs.shape)}")
    if k and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab}), got range [{int(draft_tokens.min())}, {int(draft_tokens.max())}]")
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is not None and not torch.isfinite(probs).all():
            raise ValueError(f"{name} contains NaN or inf")
        if probs is not None and (probs < 0).any():
            raise ValueError(f"{name} contains negative probabilities")
