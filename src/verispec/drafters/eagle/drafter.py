"""The ``eagle`` drafter: drafts with an :class:`EagleHead` on the target's own features.

Positions, for a committed sequence x_0 .. x_{L-1} whose target features f_0 .. f_{L-2} exist
(the verification passes computed them; the last token is not fed to the target yet):

- catch-up: the head reads (f_i, x_{i+1}) for every real feature it has not seen, in one call;
  its last output is f̂_{L-1}, whose logits give the first draft d_1 = x̂_L;
- each further draft: the head reads (f̂_{L-2+k}, d_k) and predicts the next feature.

The head's cache keeps only positions with real features between rounds (drafted positions are
cropped), so EAGLE always conditions on the target's features once they exist.

``far_memory`` (long inputs): every head call of a session, the catch-up over the prompt included,
attends with far memory (:mod:`verispec.drafters.far_memory`); only the drafts change, never the output.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from verispec.drafters.base import DraftContext, Proposal, unseen_context_rows
from verispec.drafters.draft_model import checked_alternatives, checked_threshold, round_stops, runner_ups
from verispec.drafters.draft_vocab import full_vocab_probs, reduced_lm_head, resolve_head
from verispec.drafters.eagle.checkpoint import load_head
from verispec.drafters.eagle.head import EagleHead
from verispec.drafters.far_memory import FarMemoryConfig, checked_far_memory
from verispec.engine.kv_cache import LayerKVCache
from verispec.sampling import SamplingParams, logits_to_probs, sample_from


# What `generate`, `compare` and `serve` pass as ``path_confidence`` (README, Performance, 2026-12-04
# (evening)): chosen on HumanEval problems 100-107 with the bundled head, where a round of up to 8
# drafts stopped at 0.2 ran 1.71x over plain against 1.64x at 0.4 and 1.61x for 3 drafts a round.
EAGLE_PATH_CONFIDENCE = 0.2
# Catch-ups over more rows than this (prompts, not rounds) pass each distinct next token's
# embedding once (EagleHead.forward's ``embed_rows``): a round's few rows gain nothing from it.
DISTINCT_EMBEDS_FROM_ROWS = 64


class EagleDrafter:
    """EAGLE drafting for ``target`` with a trained ``head`` (an :class:`EagleHead` or a checkpoint path).

    ``draft_vocab``: token ids the draft distribution is restricted to (the head's checkpoint
    brings its own); drafting then multiplies by those LM-head rows only. Exact either way:
    verification receives the probabilities actually sampled from, zero outside the subset.
    ``use_draft_vocab=False`` drafts over the full vocabulary with the shared LM head.
    ``quantize=True``: int8 dynamic linears for the head and its LM-head rows (a copy of the head;
    cheaper draft steps, possibly lower acceptance, the output exact either way); where the CPU
    multiplies bfloat16 natively, fc's feature half in bfloat16 too.
    ``far_memory``: how the head attends over long contexts; None (or mode "full") as trained; mode
    "auto" is resolved per request by its prompt's length (:meth:`FarMemoryConfig.for_prompt`).
    ``path_confidence``: stop a round early once the product of the head's probabilities of this
    round's drafts falls below this (the draft model's rule, :func:`round_stops`): long rounds where
    the head is sure, short ones where it is not. Reads only the head's outputs, so still exact.
    ``alternatives``: offer this many runner-up tokens per draft
    (:attr:`Proposal.alternatives`, scored by the head's probability of the path to them), which a
    decoder with ``tree_rows`` verifies beside the chain as a one-level draft tree; 0 (default): none.
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
        far_memory: FarMemoryConfig | None = None,
        path_confidence: float | None = None,
        alternatives: int = 0,
        name: str = "eagle",
    ) -> None:
        path_confidence = checked_threshold(path_confidence, "path_confidence")
        self.alternatives = checked_alternatives(alternatives)
        target_model, self.tokenizer, self.head, draft_vocab = resolve_head(target, head, draft_vocab, EagleHead, load_head, "EagleDrafter", quantize=quantize)
        self.far_memory = checked_far_memory(far_memory)
        self.path_confidence = path_confidence or None  # 0 = off
        self.name = name
        self.embed = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings()
        self.vocab_ids, self._lm_head = reduced_lm_head(lm_head, draft_vocab if use_draft_vocab else None, quantize=quantize)  # [draft_vocab] or None
        self.vocab_size = int(lm_head.weight.shape[0])

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary # [n, draft_vocab] for features # [n, hidden]."""
        return self._lm_head(features).float()

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> "EagleSession":
        far_memory = self.far_memory.for_prompt(len(prompt_ids)) if self.far_memory is not None else None
        return EagleSession(self, sampling, far_memory)


class EagleSession:
    def __init__(self, drafter: EagleDrafter, sampling: SamplingParams, far_memory: FarMemoryConfig | None = None) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.far_memory = far_memory  # this request's attention ("auto" resolved by the prompt's length); None: as trained
        self.cache = LayerKVCache()
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
        alternatives: list[tuple[int, int, float]] = []  # (draft index, runner-up token, the head's probability of the path to it)
        path_prob = 1.0  # the head's probability of this round's drafts so far
        while True:
            logits = drafter.draft_logits(feature)[0]  # [draft_vocab]
            if self.sampling.is_greedy:
                index = int(logits.argmax())
                token_prob = 1.0  # not needed without a stop rule or runner-ups
                if drafter.path_confidence is not None or drafter.alternatives:
                    probs = torch.softmax(logits, -1)  # [draft_vocab]
                    token_prob = float(probs[index])
                    alternatives += [(len(tokens), other, path_prob * prob) for other, prob in runner_ups(probs, index, drafter.alternatives, drafter.vocab_ids)]
            else:
                probs = logits_to_probs(logits, self.sampling)  # [draft_vocab]
                index = int(sample_from(probs, generator))
                token_prob = float(probs[index])
                step_probs.append(full_vocab_probs(probs, drafter.vocab_ids, drafter.vocab_size))
                alternatives += [(len(tokens), other, path_prob * prob) for other, prob in runner_ups(probs, index, drafter.alternatives, drafter.vocab_ids, sampled=True)]
            token = index if drafter.vocab_ids is None else int(drafter.vocab_ids[index])
            tokens.append(token)
            path_prob *= token_prob
            if len(tokens) == max_tokens or round_stops(token_prob, path_prob, None, drafter.path_confidence):
                break
            embed = drafter.embed(torch.tensor([[token]]))  # [1, 1, hidden]
            feature = head(feature[None], embed.float(), start=self.cache.length, cache=self.cache, far_memory=self.far_memory)[0]  # [1, hidden]
            passes += 1
        self.cache.crop(self.num_real)  # drafted positions go; the next round feeds real features there
        probs = torch.stack(step_probs) if step_probs else None
        return Proposal(tokens=tokens, probs=probs, num_forward_passes=passes, alternatives=alternatives)

    def _catch_up(self, context: DraftContext) -> int:
        """Feed the head every real feature it has not seen; return the number of head calls (0 or 1)."""
        rows = unseen_context_rows(context, self.num_real, "EAGLE")
        if rows is None:
            return 0
        fresh, next_tokens = rows
        skipped = self._never_read(len(fresh))
        if skipped:  # zeros hold their places: positions must stay true, and nothing will attend to them
            head_config = self.drafter.head.config
            keys, values = self.cache.claim(skipped, head_config.num_kv_heads, head_config.head_dim)
            keys[:, -skipped:] = 0
            values[:, -skipped:] = 0
            fresh, next_tokens = fresh[skipped:], next_tokens[skipped:]
        embed_rows = None
        if len(next_tokens) > DISTINCT_EMBEDS_FROM_ROWS:  # a prompt: each distinct token's share of fc computed once
            next_tokens, embed_rows = next_tokens.unique(return_inverse=True)
        embeds = self.drafter.embed(next_tokens[None]).float()  # [1, n or distinct, hidden]
        predicted = self.drafter.head(fresh[None].float(), embeds, start=self.num_real + skipped, cache=self.cache, far_memory=self.far_memory, last_only=True, embed_rows=embed_rows)
        self.num_real += skipped + len(fresh)
        self.next_feature = predicted[0, -1]
        return 1

    def _never_read(self, num_fresh: int) -> int:
        """How many of ``num_fresh`` catch-up rows no later head call can attend to: with a local
        window only (``--draft-attention local``) every query from the catch-up's last row on sees the
        last W positions, so the keys and values of older rows (most of a long prompt: at 16K tokens
        ~0.35 s of head work, 1.1 s before the mixed-precision fc) need not be computed."""
        if self.far_memory is None or self.far_memory.mode != "local":
            return 0
        return max(0, num_fresh - self.far_memory.local_window)

    def close(self) -> None:
        self.cache = LayerKVCache()
        self.num_real, self.next_feature = 0, None
