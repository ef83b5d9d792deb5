"""Best paths through the K×m candidate lattice of a parallel draft (pure functions).

Position i (0..K-1) has m candidate tokens with scores ``unary[i, c]``; adjacent candidates
have a fit score ``pair[i, c, c']`` (candidate c at i followed by c' at i+1). A path picks one
candidate per position and scores

    S(c_0 .. c_{K-1}) = Σ_i unary[i, c_i] + Σ_{i<K-1} pair[i, c_i, c_{i+1}]

Viterbi finds the maximum in O(K·m²) instead of m^K, vectorised over m:

    V_0(c) = unary[0, c]
    V_{i+1}(c') = unary[i+1, c'] + max_c ( V_i(c) + pair[i, c, c'] )

The n best paths keep the n best partial scores per end candidate instead of one (list Viterbi).
"""

from __future__ import annotations

import torch


def best_path(
    unary: torch.Tensor,  # [K, m] per-candidate log-scores
    pair: torch.Tensor,  # [K-1, m, m] pair-fit log-scores, pair[i, c, c'] for c at i, c' at i+1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate index per position # [K] long, the path's score S # [])."""
    paths, scores = top_paths(unary, pair, 1)
    return paths[0], scores[0]


def top_paths(
    unary: torch.Tensor,  # [K, m]
    pair: torch.Tensor,  # [K-1, m, m]
    num_paths: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_paths`` highest-scoring paths, best first: (indices # [n, K] long, scores S # [n]).

    n = min(num_paths, m^K): a lattice holds no more distinct paths than that.
    """
    if unary.dim() != 2 or unary.shape[0] < 1 or unary.shape[1] < 1:
        raise ValueError(f"unary must be [K, m] with K, m >= 1, got {list(unary.shape)}")
    length, width = unary.shape
    if tuple(pair.shape) != (length - 1, width, width):
        raise ValueError(f"pair must be [K-1, m, m] = [{length - 1}, {width}, {width}], got {list(pair.shape)}")
    if isinstance(num_paths, bool) or not isinstance(num_paths, int) or num_paths < 1:
        raise ValueError(f"num_paths must be an integer >= 1, got {num_paths!r}")
    keep = min(num_paths, width**length)
    # scores[c, r]: the r-th best partial path ending at candidate c (-inf where fewer exist).
    scores = torch.full((width, keep), float("-inf"), dtype=unary.dtype)
    scores[:, 0] = unary[0]
    back_candidate, back_rank = [], []  # per step: [m, keep] where each kept path came from
    for i in range(length - 1):
        extended = scores[:, :, None] + pair[i][:, None, :]  # [m_prev, keep, m]
        best, flat = extended.reshape(width * keep, width).topk(keep, dim=0)  # [keep, m]
        scores = (best + unary[i + 1][None, :]).T.contiguous()  # [m, keep]
        back_candidate.append(torch.div(flat, keep, rounding_mode="floor").T)
        back_rank.append((flat % keep).T)
    final, order = scores.reshape(-1).topk(keep)  # over (end candidate, rank)
    candidate, rank = torch.div(order, keep, rounding_mode="floor"), order % keep
    columns = [candidate]
    for step in reversed(range(length - 1)):
        candidate, rank = back_candidate[step][candidate, rank], back_rank[step][candidate, rank]
        columns.append(candidate)
    return torch.stack(columns[::-1], dim=1), final
