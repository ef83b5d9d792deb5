"""What drafters that read the target's features share: their head's loading and their LM head.

A drafter's LM head over a reduced draft vocabulary is the rows of the target's LM head it needs.

Drafting multiplies by the LM head once per drafted position; restricting it to the draft
vocabulary (the corpus' most frequent tokens) makes that a fraction of the cost. Exact either
way: a drafter's distribution is zero outside the subset, and verification knows it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verispec.modelref import unwrap_model
from verispec.models.quantize import quantize_int8


def resolve_head(
    target: Any,  # a transformers causal LM or LoadedModel
    head: Any,  # a head module of ``head_type``, or a checkpoint path
    draft_vocab: torch.Tensor | None,  # [draft_vocab] token ids; None: the checkpoint's own, if any
    head_type: type,
    load: Callable[[Any, Any], tuple[Any, torch.Tensor | None]],  # (path, target model) -> (head, saved draft vocab)
    owner: str,  # the drafter class, for error messages
) -> tuple[Any, Any, Any, torch.Tensor | None]:
    """(target model, tokenizer, head, draft vocabulary): a head loaded if given as a path, checked against the target."""
    target_model, tokenizer = unwrap_model(target, argument=f"{owner}(target)")
    if isinstance(head, (str, os.PathLike)):
        head, saved_vocab = load(head, target_model)
        draft_vocab = saved_vocab if draft_vocab is None else draft_vocab
    if not isinstance(head, head_type):
        raise ValueError(f"head must be an instance of {head_type.__name__} or a checkpoint path, got {type(head).__name__}")
    target_hidden = target_model.config.get_text_config(decoder=True).hidden_size
    if head.config.hidden_size != target_hidden:
        raise ValueError(f"head hidden_size {head.config.hidden_size} does not match the target's {target_hidden}")
    return target_model, tokenizer, head, draft_vocab


def reduced_lm_head(
    lm_head: nn.Module,  # the target's output layer, weight # [vocab, hidden]
    draft_vocab: torch.Tensor | None,  # [draft_vocab] token ids, or None for the full vocabulary
    *,
    quantize: bool = False,
) -> tuple[torch.Tensor | None, nn.Module]:
    """(draft vocabulary ids # [draft_vocab] long or None, a module mapping features # [n, hidden] to logits # [n, draft_vocab]).

    With ``draft_vocab`` the module is ONE contiguous copy of those rows (int8 with ``quantize``);
    without, the target's own LM head, shared (never quantised: it is the target's).
    """
    if draft_vocab is None:
        return None, lm_head
    vocab = lm_head.weight.shape[0]
    if draft_vocab.ndim != 1 or draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids in [0, {vocab})")
    vocab_ids = draft_vocab.to(torch.long)
    rows = nn.Linear(lm_head.weight.shape[1], len(vocab_ids), bias=False)
    rows.weight = nn.Parameter(lm_head.weight.detach()[vocab_ids].float().contiguous(), requires_grad=False)
    return vocab_ids, quantize_int8(nn.Sequential(rows))[0] if quantize else rows
