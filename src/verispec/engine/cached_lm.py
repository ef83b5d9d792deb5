"""One causal LM plus the KV cache of one sequence: the single owner of that cache.

Every forward pass and every rollback of a sequence's cache goes through :class:`CachedLM`,
so "what the cache holds" is always ``self.token_ids`` and nothing else. Rollback has one
path, :meth:`CachedLM.crop`; :meth:`CachedLM.sync` (used by drafters) is crop-to-common-prefix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32: next-token logits for the last num_logits fed tokens
    features: torch.Tensor  # [num_fed, hidden]: the top-layer features (what the LM head reads) of the fed tokens


# One row of a draft tree beside a pass's chain (CachedLM.extend_branches): (index, token, parent).
# parent -1: ``token`` stands as an alternative to the chain's new_ids[index], after new_ids[:index];
# parent p >= 0: ``token`` continues branch p (an earlier entry, with the same index), one position on.
Branch = tuple[int, int, int]


def checked_branches(chain_length: int, branches: list[Branch]) -> None:
    """ValueError unless ``branches`` form a draft tree beside a chain of ``chain_length`` fed tokens:
    indices in [1, chain_length), parents earlier entries with the same index, and no path deeper
    than the chain (index + depth < chain_length: a kept path replaces chain drafts one for one, so a
    pass still emits at most one token more than it drafted)."""
    depth: list[int] = []
    for number, (index, _, parent) in enumerate(branches):
        if not 1 <= index < chain_length:
            raise ValueError(f"branch indices must be in [1, {chain_length}) of a non-empty chain, got {[entry[0] for entry in branches]}")
        if parent >= 0 and (parent >= number or branches[parent][0] != index):
            raise ValueError(f"branch {number}'s parent must be an earlier branch with the same index, got parent {parent}")
        depth.append(0 if parent < 0 else depth[parent] + 1)
        if index + depth[-1] >= chain_length:
            raise ValueError(f"branch {number} reaches past the chain: index {index} + depth {depth[-1]} >= {chain_length}")


@functools.cache
def cache_argument_name(body_class: type) -> str:
    # transformers >= 5.2x renamed the forward argument past_key_values to cache.
    return "cache" if "cache" in inspect.signature(body_class.forward).parameters else "past_key_values"


class CachedLM:
    """A Hugging Face causal LM with the KV cache of one growing, croppable sequence."""

    def __init__(self, model: PreTrainedModel, lm_head: torch.nn.Module | None = None, argmax_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``lm_head``: an output layer to use instead of the model's own (a drafter's reduced-vocabulary rows).

        ``argmax_head``: what :meth:`extend` computes instead of the LM head when only the argmax of
        the logits matters (``argmax_only``): logits whose argmax is the head's, e.g.
        :class:`~verispec.models.screened_head.ScreenedArgmaxHead` (exact where it matters, -inf elsewhere)."""
        self.model = model
        # The body and the LM head separately: the head (vocab x hidden) is the costliest matrix
        # of a small model, so it runs only on the rows whose logits are needed (none in prefill),
        # and the body hands over the top-layer features that feature-level drafters (EAGLE) reuse.
        self.body = model.get_decoder()
        self.lm_head = lm_head if lm_head is not None else model.get_output_embeddings()
        config = model.config.get_text_config(decoder=True)
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._logit_scale = getattr(config, "logit_scale", None)
        # Soft-capping saturates (distinct logits can cap to one value) and a scale could flip the
        # order: the argmax shortcut is only taken for plain logits.
        self.argmax_head = argmax_head if self._softcap is None and self._logit_scale is None else None
        self.device = next(model.parameters()).device
        self._cache_kwarg = cache_argument_name(type(self.body))
        self.cache = self._empty_cache()
        self.token_ids: list[int] = []

    @property
    def vocab_size(self) -> int:
        """Width of the logits (rows of the LM head; quantised heads expose out_features)."""
        return int(self.lm_head.out_features)

    def __len__(self) -> int:
        return len(self.token_ids)

    @torch.inference_mode()
    def extend(self, new_ids: list[int], num_logits: int = 1, argmax_only: bool = False) -> ForwardOutput:
        """Append ``new_ids`` to the cached sequence in one forward pass.

        Returns the logits predicting the token after each of the last ``num_logits`` fed tokens.
        ``argmax_only``: the caller reads only each row's argmax (greedy decoding), so the logits may
        come from ``argmax_head``: -inf except where a token can be the argmax.
        """
        if not new_ids:
            raise ValueError("extend() needs at least one new token")
        if not 0 <= num_logits <= len(new_ids):
            raise ValueError(f"num_logits must be in [0, {len(new_ids)}], got {num_logits}")
        input_ids = torch.tensor(new_ids, dtype=torch.long, device=self.device)
        features = self._run_body(input_ids)  # [num_fed, hidden]
        self.token_ids.extend(new_ids)
        logits = self.logits(features[len(new_ids) - num_logits :], argmax_only) if num_logits else features.new_empty(0, self.vocab_size)
        return ForwardOutput(logits=logits, features=features)

    def logits(self, features: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """LM-head logits (float32, scaled / soft-capped as the model defines) of top-layer features [n, hidden].

        ``argmax_only``: through ``argmax_head`` if there is one (only each row's argmax is meaningful)."""
        if argmax_only and self.argmax_head is not None:
            return self.argmax_head(features)
        logits = self.lm_head(features).float()
        if self._logit_scale is not None:  # Cohere-style scaled heads
            logits = logits * self._logit_scale
        if self._softcap is not None:  # Gemma-2-style soft-capped logits
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds exactly the first ``length`` tokens."""
        if not 0 <= length <= len(self.token_ids):
            raise ValueError(f"crop length must be in [0, {len(self.token_ids)}], got {length}")
        tokens_to_remove = len(self.token_ids) - length
        if tokens_to_remove:
            self._drop_cached(tokens_to_remove)
            del self.token_ids[length:]

    def sync(self, token_ids: list[int]) -> list[int]:
        """Crop to the longest common prefix with ``token_ids``; return the ids still to feed.

        At least one id is always returned, so the caller gets logits for the next position.
        """
        common = 0
        limit = min(len(self.token_ids), len(token_ids) - 1)
        while common < limit and self.token_ids[common] == token_ids[common]:
            common += 1
        self.crop(common)
        return token_ids[common:]

    def max_branch_rows(self) -> int:
        """The most rows :meth:`extend_branches` takes in one pass; 0: this LM runs no draft trees."""
        return 0

    def extend_branches(self, new_ids: list[int], branches: list["Branch"], argmax_only: bool = False) -> ForwardOutput:
        """Feed ``new_ids`` as :meth:`extend` does plus, in the same pass, one row per (index,
        token, parent) in ``branches`` (:data:`Branch`): ``token`` as an alternative to ``new_ids[index]``
        (index >= 1), seeing what precedes that index, or continuing the earlier branch ``parent``
        (then seeing its path too). Logits for every row # [len(new_ids) + len(branches), vocab]. The
        branch rows' keys/values sit after the chain until :meth:`keep_branch` moves them in place."""
        raise NotImplementedError(f"{type(self).__name__} runs no draft trees (max_branch_rows() is 0)")

    def keep_branch(self, branch_slot: int, position: int) -> None:
        """Make the token fed at ``branch_slot`` (a branch row of the last :meth:`extend_branches`)
        the sequence's token at ``position`` (a kept path: each of its branches in order); the caller
        then crops to just past the last."""
        raise NotImplementedError(f"{type(self).__name__} runs no draft trees")

    def release(self) -> None:
        """Free the cache's memory (the object stays usable, empty)."""
        self.cache = self._empty_cache()
        self.token_ids = []

    # The cache itself: transformers' DynamicCache through the model's own forward. A subclass
    # (LeanLM) swaps these three for its own forward and cache; everything above stays shared.
    def _empty_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _run_body(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Top-layer features # [n, hidden] of input_ids # [n], appended to the cache."""
        out = self.body(input_ids=input_ids[None], use_cache=True, **{self._cache_kwarg: self.cache})
        return out.last_hidden_state[0]

    def _drop_cached(self, num_tokens: int) -> None:
        # transformers 5 takes the number of tokens to remove as a negative count.
        self.cache.crop(-num_tokens)
