"""The target plus one KV cache PER request, passes over all of them in one kernel call: batched serving
on the lean forward.

:class:`~verispec.serving.batch_cache.BatchedTarget` runs transformers' forward over one shared,
padded cache with a 4-D mask. Where the target runs our panel kernels and the lean forward covers
it (:func:`~verispec.engine.lean_lm.target_runs_lean`), :class:`LeanBatchedTarget` does instead what
the single-sequence engine does, for many sequences at once: each request owns its per-layer
:class:`~verispec.engine.kv_cache.LayerKVCache` (preallocated, rolled back by moving its end), and a
pass is ONE call of the fused stack (``verispec_lean_stack``) over every request's new rows: the
weight products run over all rows together (the weights are read once), attention reads each row's
own cache. So there is no padding, no mask, no compaction, and no per-round copy of any cache;
joining is a prefill into the newcomer's own cache, leaving drops its caches.

Exactness: the kernels compute every row of a product exactly as a pass over that row alone would,
and a row's attention sees only its own sequence, so a request's tokens do not depend on who shares
its passes — and a lone request runs exactly the engine's forward (the same call with one sequence),
so the server's greedy text equals ``verispec generate``'s (tested bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.engine.cached_lm import ForwardOutput
from verispec.engine.kv_cache import LayerKVCache, RowLog
from verispec.engine.lean_lm import LeanDecoder, target_lm, target_runs_lean
from verispec.engine.prefix_cache import PrefixCache, start_sequence
from verispec.serving.batch_cache import check_feeds, check_kept, head_outputs


def lean_batching_unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanBatchedTarget` cannot serve ``model``, or None if it can."""
    if not target_runs_lean(model):
        return "the target does not run the lean forward (it needs the panel kernels and a Llama/Qwen2/Mistral-family model)"
    if LeanDecoder.shared(model).fused is None:
        return "the fused stack does not cover this model's products"
    return None


class LeanBatchedTarget:
    """A causal LM serving several sequences at once, each from its own cache, through the fused stack.

    Between passes every row holds its committed sequence minus the last token (the engine's
    invariant). :meth:`extend` feeds each row its own tokens in one pass; :meth:`commit` then says
    how many of them each row keeps. Same interface as :class:`~verispec.serving.batch_cache.BatchedTarget`.
    """

    def __init__(self, model: nn.Module, screen_lm_head: bool = True, prefixes: PrefixCache | None = None) -> None:
        """``prefixes``: a new row starts from the longest stored prefix of its prompt (a shared
        system prompt, a conversation's earlier turns) and a leaving row stores its sequence; every
        pass then runs row-exact (see :class:`~verispec.engine.prefix_cache.PrefixCache`)."""
        reason = lean_batching_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean batched serving cannot run this model: {reason}")
        self.model = model
        self.decoder = LeanDecoder.shared(model)
        # The LM head (and its int8 argmax screen for greedy passes), as the engine computes it.
        self._head = target_lm(model, screen_lm_head=screen_lm_head)
        self.device = self._head.device
        self.prefixes = prefixes
        self.last_reused = 0  # prompt positions the last add() restored from ``prefixes``
        self._caches: list[list[LayerKVCache]] = []  # per row: its per-layer caches
        # Per row, kept only with a prefix cache (to store the row when it leaves): its cached
        # tokens and their features, rolled back with its caches.
        self._token_ids: list[list[int]] = []
        self._feature_logs: list[RowLog] = []
        self._fed: list[int] | None = None  # per row: tokens fed by the last extend(), awaiting commit()

    @property
    def rows(self) -> int:
        return len(self._caches)

    @property
    def vocab_size(self) -> int:
        return self._head.vocab_size

    @property
    def next_positions(self) -> list[int]:
        """Per row: its number of committed-and-cached tokens."""
        return [caches[0].length for caches in self._caches]

    @torch.inference_mode()
    def add(self, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt[:-1]`` into a new row's own cache; return its features [n, hidden]."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        self._check_committed()
        caches = self.decoder.new_cache()
        features = torch.zeros(0, self.decoder.hidden_size)  # [0, hidden]
        if self.prefixes is None:
            if len(prompt) > 1:
                features = self.decoder.forward(torch.tensor(prompt[:-1], dtype=torch.long), caches)
            self._caches.append(caches)
            return features
        log, ids = RowLog(), prompt[:-1]
        self.last_reused = 0
        if ids:
            compute = lambda rest: self.decoder.forward(torch.tensor(rest, dtype=torch.long), caches, row_exact=True)  # noqa: E731
            features, self.last_reused = start_sequence(self.prefixes, ids, caches, log, compute)
        self._caches.append(caches)
        self._token_ids.append(list(ids))
        self._feature_logs.append(log)
        return features

    def remove(self, keep: list[int]) -> None:
        """Keep only the rows at indices ``keep`` (in that order); free the others (stored first, with a prefix cache)."""
        self._check_committed()
        if self.prefixes is not None:
            for index in sorted(set(range(self.rows)) - set(keep)):
                self.prefixes.keep(self._token_ids[index], self._caches[index], self._feature_logs[index])
            self._token_ids = [self._token_ids[index] for index in keep]
            self._feature_logs = [self._feature_logs[index] for index in keep]
        self._caches = [self._caches[index] for index in keep]

    @torch.inference_mode()
    def extend(self, new_ids: list[list[int]], num_logits: list[int], argmax_only: bool = False) -> list[ForwardOutput]:
        """One pass feeding row ``i`` the tokens ``new_ids[i]`` (at least one each).

        Returns per row the logits for its last ``num_logits[i]`` fed tokens and the features of all
        of them, as the engine's target would (``argmax_only``: every row decodes greedily, so only
        the logits' argmax need be right). Call :meth:`commit` before the next pass.
        """
        check_feeds(new_ids, num_logits, self.rows)
        self._check_committed()
        features = self.decoder.forward_many(new_ids, self._caches, row_exact=self.prefixes is not None)  # each [len_i, hidden]
        self._fed = [len(ids) for ids in new_ids]
        if self.prefixes is not None:
            for tokens, log, ids, rows in zip(self._token_ids, self._feature_logs, new_ids, features):
                tokens.extend(ids)
                log.append(rows)
        return head_outputs(self._head, features, num_logits, argmax_only)

    def commit(self, kept: list[int]) -> None:
        """Row ``i`` keeps the first ``kept[i]`` tokens it was fed by the last :meth:`extend`."""
        check_kept(kept, self._fed)
        for row, (caches, count, fed) in enumerate(zip(self._caches, kept, self._fed)):
            for cache in caches:  # the one rollback: the rejected drafts' keys/values are dropped
                cache.crop(cache.length - fed + count)
            if self.prefixes is not None:
                del self._token_ids[row][len(self._token_ids[row]) - fed + count :]
                self._feature_logs[row].crop(self._feature_logs[row].length - fed + count)
        self._fed = None

    def _check_committed(self) -> None:
        if self._fed is not None:
            raise RuntimeError("the last extend() has not been committed")

