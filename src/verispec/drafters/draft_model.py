"""Classic speculative sampling's drafter: an independent small causal LM of the same tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from verispec.drafters.base import DraftContext, Proposal
from verispec.engine.cached_lm import CachedLM
from verispec.modelref import unwrap_model
from verispec.sampling import SamplingParams, logits_to_probs, sample_from


class DraftModel:
    """Drafts autoregressively with a small LM, sampling with the target's own transform.

    ``confidence_threshold``: stop a round early once the draft gives its own latest token less
    than this probability. Long drafts then cost steps only where the draft is sure, which is
    where they get accepted. The stopping rule looks only at the draft's randomness, so the
    verifier still sees a valid draft and the output stays exact.
    """

    needs_target_features = False

    def __init__(self, model: Any, name: str = "draft-model", confidence_threshold: float | None = None) -> None:
        self.model, self.tokenizer = unwrap_model(model, argument="DraftModel(model)")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1) or None, got {confidence_threshold!r}")
        self.name = name
        self.confidence_threshold = confidence_threshold

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "DraftModelSession":
        return DraftModelSession(CachedLM(self.model), sampling, self.confidence_threshold)


class DraftModelSession:
    def __init__(self, lm: CachedLM, sampling: SamplingParams, confidence_threshold: float | None) -> None:
        self.lm = lm
        self.sampling = sampling
        self.confidence_threshold = confidence_threshold

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        # Rollback and catch-up in one step: drop rejected drafts, feed what the target committed.
        pending = self.lm.sync(context.token_ids)
        tokens: list[int] = []
        step_probs: list[torch.Tensor] = []
        while len(tokens) < max_tokens:
            logits = self.lm.extend(pending, num_logits=1).logits[0]  # [vocab]
            if self.sampling.is_greedy:
                token = int(logits.argmax())
                confident = self._confident(lambda: torch.softmax(logits, -1)[token])
            else:
                probs = logits_to_probs(logits, self.sampling)  # [vocab]
                token = int(sample_from(probs, generator))
                step_probs.append(probs)
                confident = self._confident(lambda: probs[token])
            tokens.append(token)
            pending = [token]
            if not confident:
                break
        probs = torch.stack(step_probs) if step_probs else None
        return Proposal(tokens=tokens, probs=probs, num_forward_passes=len(tokens))

    def _confident(self, token_prob) -> bool:  # noqa: ANN001 - a thunk, evaluated only when a threshold is set
        return self.confidence_threshold is None or float(token_prob()) >= self.confidence_threshold

    def close(self) -> None:
        self.lm.release()
