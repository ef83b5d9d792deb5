"""Standardized sampling: every decoding mode is sampling from an adjusted distribution.

Greedy, temperature, top-k and top-p are all one transform ``logits -> probs`` that the
target and every drafter apply identically, so the rejection sampler compares like with like:

    probs = top_p( top_k( softmax(logits / temperature) ) )

applied in that order (the order transformers and vLLM use). Greedy (temperature 0) is
the one-hot distribution on the argmax, which lets the same verifier treat it exactly;
the engine still takes its own argmax path for greedy because it needs no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep only the k most likely tokens; 0 disables.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p
        (computed after top-k renormalisation); 1.0 disables.
    seed: seeds the per-request ``torch.Generator``; None draws a random seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        """A fresh CPU generator for one request: seeded when ``seed`` is set."""
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution both draft and target sample from.

    logits: [..., vocab] (any float dtype; computed in float32).
    Returns probs: [..., vocab] float32, rows sum to 1.
    """
    logits = logits.float()
    if params.is_greedy:
        # One-hot on the argmax: the limit of softmax(logits / T) as T -> 0 (ties -> lowest id).
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth_largest = probs.topk(params.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth_largest, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set with mass >= top_p, renormalised.

    A token survives when the mass of the tokens strictly more likely than it is still
    below top_p; the most likely token always survives.
    """
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_ids, keep_sorted)
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row.

    probs: [..., vocab] rows summing to 1. Returns Long[...].
    """
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
