"""The target's own greedy answers, many requests at once, with the features that produced them.

EAGLE learns best from text the target itself writes (chat answers mixing prose and code), but
one sequence at a time the target writes ~4 tokens/s here. A decode step for 32 sequences
costs ~4x a step for one (the weights are read once per step either way), so answering a batch
of requests together is ~8x faster. Prompts are left-padded; each row's positions count only
its own tokens, and padded slots are masked out of attention.

Features are the body's top-layer outputs (what the LM head reads), recorded as each token is
fed: f_i for every fed position, so a sequence's features line up with its tokens. A row's last
token (end of turn, or the one at the length limit) is never fed, so it is not part of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from verispec.engine.cached_lm import cache_argument_name


def stop_and_pad_ids(target) -> tuple[set[int], int]:  # noqa: ANN001 - a LoadedModel
    """(the token ids that end an answer, as the engine reads end of sequence; the id that left-pads a batch)."""
    from verispec.engine import SpeculativeDecoder

    tokenizer = target.tokenizer
    stop_ids = {tokenizer.eos_token_id, *SpeculativeDecoder(target.model).default_stop()} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_ids), 0)
    return stop_ids, pad_id


@torch.inference_mode()
def greedy_answers(
    model,  # noqa: ANN001 - a Hugging Face causal LM
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    on_step: Callable[[int], None] | None = None,
) -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (prompt + answer tokens that were fed, their features # [n, hidden])."""
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    body, lm_head = model.get_decoder(), model.get_output_embeddings()
    batch, width = len(prompts), max(len(prompt) for prompt in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [batch, width]: each row counts from its first real token
    cache = {cache_argument_name(type(body)): DynamicCache(config=model.config)}
    out = body(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    hidden = out.last_hidden_state  # [batch, width, hidden]
    tokens = [list(prompt) for prompt in prompts]
    features = [[hidden[row, width - len(prompt) :]] for row, prompt in enumerate(prompts)]
    last = hidden[:, -1]  # [batch, hidden]
    running = [True] * batch
    for step in range(max_new_tokens):
        next_tokens = lm_head(last).argmax(-1)  # [batch]
        for row in range(batch):
            if running[row]:
                tokens[row].append(int(next_tokens[row]))
                running[row] = int(next_tokens[row]) not in stop_ids
        if on_step is not None:
            on_step(step + 1)
        if not any(running) or step == max_new_tokens - 1:
            break
        # Finished rows keep stepping (removing rows from the cache costs more than it saves at
        # this size); their outputs are simply not recorded.
        mask = torch.cat((mask, torch.ones(batch, 1, dtype=torch.long)), dim=1)
        positions = positions[:, -1:] + 1
        last = body(input_ids=next_tokens[:, None], attention_mask=mask, position_ids=positions, use_cache=True, **cache).last_hidden_state[:, -1]
        for row in range(batch):
            if running[row]:
                features[row].append(last[row : row + 1])
    results = []
    for row in range(batch):
        row_features = torch.cat(features[row])  # [fed, hidden]
        results.append((tokens[row][: len(row_features)], row_features))
    return results
