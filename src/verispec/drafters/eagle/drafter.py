"""The ``eagle`` drafter: drafts with an :class:`EagleHead` on the target's own features.

Positions, for a committed sequence x_0 .. x_{L-1} whose target features f_0 .. f_{L-2} exist
(the verification passes computed them; the last token is not fed to the target yet):

- catch-up: the head reads (f_i, x_{i+1}) for every real feature it has not seen, in one call;
  its last output is f̂_{L-1}, whose logits give the first draft d_1 = x̂_L;
- each further draft: the head reads (f̂_{L-2+k}, d_k) and predicts the next feature.

The head's cache keeps only positions with real features between rounds (drafted positions are
cropped), so EAGLE always conditions on the target's features once they exist.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from verispec.drafters.base import DraftContext, Proposal
from verispec.drafters.eagle.checkpoint import load_head
from verispec.drafters.eagle.head import EagleHead, HeadKVCache
from verispec.modelref import unwrap_model
from verispec.models.quantize import quantize_int8
from verispec.sampling import SamplingParams, logits_to_probs, sample_from


class EagleDrafter:
    """EAGLE drafting for ``target`` with a trained ``head`` (an :class:`EagleHead` or a checkpoint path).

    ``draft_vocab``: token ids the draft distribution is restricted to (the head's checkpoint
    brings its own); drafting then multiplies by those LM-head rows only. Exact either way:
    verification receives the probabilities actually sampled from, zero outside the subset.
    ``use_draft_vocab=False`` drafts over the full vocabulary with the shared LM head.
    ``quantize=True``: int8 dynamic linears for the head and its LM-head rows (a copy of the head;
    cheaper draft steps, possibly lower acceptance, the output exact either way).
    """

    needs_target_features = True

    def __init__(
        self,
        target: Any,
        head: EagleHead | str | os.PathLike,
        draft_vocab: torch.Tensor | None = None,  # [draft_vocab] int64
        *,
        use_draft_vocab: bool = True,
        quantize: bool = False,
        name: str = "eagle",
    ) -> None:
        target_model, self.tokenizer = unwrap_model(target, argument="EagleDrafter(target)")
        if isinstance(head, (str, os.PathLike)):
            head, saved_vocab = load_head(head, target_model)
            draft_vocab = saved_vocab if draft_vocab is None else draft_vocab
        if not isinstance(head, EagleHead):
            raise ValueError(f"head must be an EagleHead or a checkpoint path, got {type(head).__name__}")
        target_hidden = target_model.config.get_text_config(decoder=True).hidden_size
        if head.config.hidden_size != target_hidden:
            raise ValueError(f"head hidden_size {head.config.hidden_size} does not match the target's {target_hidden}")
        self.head = head.eval().requires_grad_(False)
        if quantize:
            self.head = quantize_int8(copy.deepcopy(self.head))
        self.name = name
        self.embed = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings()
        self.vocab_ids: torch.Tensor | None = None  # [draft_vocab]
        if use_draft_vocab and draft_vocab is not None:
            vocab = lm_head.weight.shape[0]
            if draft_vocab.ndim != 1 or draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
                raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids in [0, {vocab})")
            self.vocab_ids = draft_vocab.to(torch.long)
            # The one copy: those rows of the LM head, contiguous, so a draft step reads only them.
            rows = torch.nn.Linear(lm_head.weight.shape[1], len(self.vocab_ids), bias=False)
            rows.weight = torch.nn.Parameter(lm_head.weight.detach()[self.vocab_ids].float().contiguous(), requires_grad=False)
            self._lm_head = quantize_int8(torch.nn.Sequential(rows))[0] if quantize else rows
        else:
            self._lm_head = lm_head  # shared, whatever kernel the target uses (never quantised: it is the target's)
        self.vocab_size = int(lm_head.weight.shape[0])

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary # [n, draft_vocab] for features # [n, hidden]."""
        return self._lm_head(features).float()

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "EagleSession":
        return EagleSession(self, sampling)


class EagleSession:
    def __init__(self, drafter: EagleDrafter, sampling: SamplingParams) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.cache = HeadKVCache()
        self.num_real = 0  # head positions fed with real target features (0 .. num_real-1)
        self.next_feature: torch.Tensor | None = None  # [hidden]: f̂ at position num_real, from the catch-up

    @torch.inference_mode()
    def propose(self, context: DraftContext, max_tokens: int, generator: torch.Generator) -> Proposal:
        drafter, head = self.drafter, self.drafter.head
        passes = self._catch_up(context)
        if self.next_feature is None or self.num_real != len(context.token_ids) - 1:
            return Proposal(tokens=[], probs=None, num_forward_passes=passes)  # no features yet (1-token prompt)
        feature = self.next_feature[None]  # [1, hidden]
        tokens: list[int] = []
        step_probs: list[torch.Tensor] = []
        while True:
            logits = drafter.draft_logits(feature)[0]  # [draft_vocab]
            if self.sampling.is_greedy:
                index = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, self.sampling)  # [draft_vocab]
                index = int(sample_from(probs, generator))
                step_probs.append(self._full_vocab(probs))
            token = index if drafter.vocab_ids is None else int(drafter.vocab_ids[index])
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
            embed = drafter.embed(torch.tensor([[token]]))  # [1, 1, hidden]
            feature = head(feature[None], embed.float(), start=self.cache.length, cache=self.cache)[0]  # [1, hidden]
            passes += 1
        self.cache.crop(self.num_real)  # drafted positions go; the next round feeds real features there
        probs = torch.stack(step_probs) if step_probs else None
        return Proposal(tokens=tokens, probs=probs, num_forward_passes=passes)

    def _catch_up(self, context: DraftContext) -> int:
        """Feed the head every real feature it has not seen; return the number of head calls (0 or 1)."""
        features = context.target_features  # [n, hidden] for positions features_start ..
        if features is None or len(features) == 0:
            return 0
        start = context.features_start
        if start > self.num_real:
            raise RuntimeError(f"EAGLE session missed target features for positions {self.num_real}..{start - 1}")
        fresh = features[self.num_real - start :]  # positions num_real .. start+n-1
        if len(fresh) == 0:
            return 0
        next_tokens = torch.tensor(context.token_ids[self.num_real + 1 : self.num_real + 1 + len(fresh)])  # x_{i+1}
        embeds = self.drafter.embed(next_tokens[None]).float()  # [1, n, hidden]
        predicted = self.drafter.head(fresh[None].float(), embeds, start=self.num_real, cache=self.cache)[0]
        self.num_real += len(fresh)
        self.next_feature = predicted[-1]
        return 1

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """q_draft over the target's vocabulary # [vocab] from probs over the draft vocabulary."""
        if self.drafter.vocab_ids is None:
            return probs
        return probs.new_zeros(self.drafter.vocab_size).index_copy_(0, self.drafter.vocab_ids, probs)

    def close(self) -> None:
        self.cache = HeadKVCache()
        self.num_real, self.next_feature = 0, None
