"""Reduced draft vocabularies, and what the feature-reading drafters share (loading their head).

A drafter's LM head over a reduced draft vocabulary is the rows of an LM head it needs: the
target's for the EAGLE and parallel heads, the draft model's own for a draft model.

Drafting multiplies by the LM head once per drafted position; restricting it to the draft
vocabulary (the corpus' most frequent tokens, or a tokenizer's first ids) makes that a fraction
of the cost. Exact either way: a drafter's distribution is zero outside the subset, and
verification receives it (:func:`full_vocab_probs`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verispec.modelref import unwrap_model
from verispec.models.quantize import MixedPrecisionLinear, float_weight, native_bf16_products, quantize_int8


def resolve_head(
    target: Any,  # a transformers causal LM or LoadedModel
    head: Any,  # a head module of ``head_type``, or a checkpoint path
    draft_vocab: torch.Tensor | None,  # [draft_vocab] token ids; None: the checkpoint's own, if any
    head_type: type,
    load: Callable[[Any, Any], tuple[Any, torch.Tensor | None]],  # (path, target model) -> (head, saved draft vocab)
    owner: str,  # the drafter class, for error messages
    *,
    quantize: bool = False,
) -> tuple[Any, Any, Any, torch.Tensor | None]:
    """(target model, tokenizer, head, draft vocabulary): a head loaded if given as a path, checked
    against the target, frozen in eval mode; with ``quantize`` an int8 copy, its input layer ``fc`` kept float32
    (a :class:`MixedPrecisionLinear`: bfloat16 products where the CPU has them natively; the caller's head is untouched)."""
    target_model, tokenizer = unwrap_model(target, argument=f"{owner}(target)")
    if isinstance(head, (str, os.PathLike)):
        head, saved_vocab = load(head, target_model)
        draft_vocab = saved_vocab if draft_vocab is None else draft_vocab
    if not isinstance(head, head_type):
        raise ValueError(f"head must be an instance of {head_type.__name__} or a checkpoint path, got {type(head).__name__}")
    target_hidden = target_model.config.get_text_config(decoder=True).hidden_size
    if head.config.hidden_size != target_hidden:
        raise ValueError(f"head hidden_size {head.config.hidden_size} does not match the target's {target_hidden}")
    head = head.eval().requires_grad_(False)
    if quantize:
        float_fc = copy.deepcopy(head.fc)
        head = quantize_int8(copy.deepcopy(head))
        # fc reads concat(embed(token), feature). An int8 dynamic linear rounds its whole input to 8
        # bits with ONE scale per call, which the features' outlier dimensions set (|x| up to ~36
        # for the built-in target): the embedding half (|x| ~0.02) rounds to zero and the head
        # loses the token one step ahead. Measured on 64 recorded HumanEval answers (replayed, γ 6):
        # tau 1.91 float32, 1.55 all int8, 1.87 int8 with fc in float32, for 0.4 ms more a step.
        # Where the CPU has bfloat16 products, the feature half multiplies in bfloat16 (the head
        # trained in bfloat16; half float32's cost) and the embedding half in float32 (see
        # MixedPrecisionLinear: a bfloat16 sum would round the small embedding share away). On
        # 11,926 positions of recorded target answers (teacher-forced, the bundled head) the first
        # draft matched the target's token at 71.26% against 71.19% with fc in float32; the fc
        # took 0.34 against 0.47 ms for one row, 0.75 against 1.5 ms for a round's 3-4 rows.
        # Elsewhere both halves stay float32, each a contiguous part through our few-row kernels:
        # PyTorch's float32 product of 3-10 rows took 2.3 ms there against 0.3-0.6 ms.
        hidden = head.config.hidden_size  # fc reads [embed ; feature]
        head.fc = MixedPrecisionLinear(float_fc, float32_columns=hidden, bf16_rest=native_bf16_products())
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
    weight = float_weight(lm_head)  # [vocab, hidden]
    vocab = weight.shape[0]
    if draft_vocab.ndim != 1 or draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids in [0, {vocab})")
    vocab_ids = draft_vocab.to(torch.long)
    rows = nn.Linear(weight.shape[1], len(vocab_ids), bias=False)
    rows.weight = nn.Parameter(weight[vocab_ids].contiguous(), requires_grad=False)
    return vocab_ids, quantize_int8(nn.Sequential(rows))[0] if quantize else rows


def full_vocab_probs(
    probs: torch.Tensor,  # [..., draft_vocab]: distributions over the draft vocabulary
    vocab_ids: torch.Tensor | None,  # [draft_vocab] int64: the token id of each entry; None = the full vocabulary already
    vocab_size: int,
) -> torch.Tensor:
    """q_draft over the full vocabulary # [..., vocab]: ``probs`` scattered to their ids, zero elsewhere."""
    if vocab_ids is None:
        return probs
    return probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, vocab_ids, probs)


def leading_token_ids(vocab_size: int, count: int, always: list[int]) -> torch.Tensor:
    """Token ids 0..count-1 plus ``always`` (end-of-sequence and special ids) # [<= count + len(always)].

    Byte-level BPE vocabularies number tokens in merge order, and the first merges are the most
    frequent pieces of the tokenizer's training text: the first ids are a frequency list that needs
    no corpus. Special tokens sit at the end of the vocabulary, so they are added explicitly (a
    draft that can never propose end-of-sequence stops too late).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"draft_vocab must be a positive number of tokens, got {count!r}")
    ids = set(range(min(count, vocab_size))) | {token for token in always if 0 <= token < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)
