"""Classic speculative sampling's drafter: an independent small causal LM of the same tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from verispec.drafters.base import DraftContext, Proposal
from verispec.engine.cached_lm import CachedLM
from verispec.modelref import unwrap_model
from verispec.sampling import SamplingParams, logits_to_probs, sample_from


class DraftModel:
    """Drafts autoregressively with a small LM, sampling with the target's own transform."""

    needs_target_features = False

    def __init__(self, model: Any, name: str = "draft-model") -> None:
        self.model, self.tokenizer = unwrap_model(model, argument="DraftModel(model)")
        self.name = name

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "DraftModelSession":
        return DraftModelSession(CachedLM(self.model), sampling)


class DraftModelSession:
    def __init__(self, lm: CachedLM, sampling: SamplingParams) -> None:
        self.lm = lm
        self.sampling = sampling

    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        # Rollback and catch-up in one step: drop rejected drafts, feed what the target committed.
        pending = self.lm.sync(context.token_ids)
        tokens: list[int] = []
        step_probs: list[torch.Tensor] = []
        for _ in range(max_tokens):
            logits = self.lm.extend(pending, num_logits=1).logits[0]  # [vocab]
            if self.sampling.is_greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, self.sampling)
                token = int(sample_from(probs, generator))
                step_probs.append(probs)
            tokens.append(token)
            pending = [token]
        probs = torch.stack(step_probs) if step_probs else None
        return Proposal(tokens=tokens, probs=probs, num_forward_passes=max_tokens)

    def close(self) -> None:
        self.lm.release()
