"""One drafter for short prompts, another for long ones, chosen once per request by the prompt's length.

Why: which drafter decodes fastest depends on the input's length. On short prompts (HumanEval,
108-147 tokens) lookup + draft model leads; from 512 tokens up lookup + EAGLE head decoded in less
time in 12 of the 14 groups measured (README, Performance, 2026-12-06 (early morning)): the draft
model reads the prompt itself before its first draft (the head catches up over target features it
is handed), a draft model step costs ~3x a head step here, and its window sees only the last
part of a long input.

The choice is made in :meth:`LengthSwitchDrafter.start` and the request keeps that drafter's
session to its end, so each request is decoded exactly as that drafter alone decodes it (same
proposals, same verification: the output stays the target's).
"""

from __future__ import annotations

from verispec.drafters.base import Drafter, DraftSession
from verispec.sampling import SamplingParams

# Where `--drafter auto` switches from lookup + draft model to lookup + EAGLE head. Measured (README,
# Performance, 2026-12-06 (early morning)): below 512 tokens the draft model leads (HumanEval, 108-147
# tokens; Spec-Bench extraction, 187-385); from 512 on lookup + head decoded in less time in 12 of 14
# (length, request) or Spec-Bench category groups — 2-31% less, Spec-Bench rag (671-805 tokens) 20%
# less — and in 2-3% more in the other two (rewrite at 512, explain at 16K).
DEFAULT_LONG_PROMPT = 512


class LengthSwitchDrafter:
    """``short`` for prompts of fewer than ``long_prompt_tokens`` tokens, ``long`` for the others."""

    def __init__(self, short: Drafter, long: Drafter, long_prompt_tokens: int) -> None:
        if isinstance(long_prompt_tokens, bool) or not isinstance(long_prompt_tokens, int) or long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be an integer >= 1, got {long_prompt_tokens!r}")
        self.short, self.long, self.long_prompt_tokens = short, long, long_prompt_tokens
        # The engine decides once per request whether to hand over target features, before the
        # choice: hand them whenever either drafter reads them (a session that does not ignores them).
        self.needs_target_features = short.needs_target_features or long.needs_target_features
        self.name = f"{short.name}, {long.name} from {long_prompt_tokens} prompt tokens"
        short_tokenizer, long_tokenizer = getattr(short, "tokenizer", None), getattr(long, "tokenizer", None)
        if short_tokenizer is not None and long_tokenizer is not None:
            from verispec.models import check_same_tokenizer

            check_same_tokenizer(short_tokenizer, long_tokenizer, names=("short-prompt drafter", "long-prompt drafter"))
        self.tokenizer = short_tokenizer or long_tokenizer  # the engine checks it against the target's

    def for_prompt(self, prompt_length: int) -> Drafter:
        """The drafter a prompt of ``prompt_length`` tokens gets."""
        return self.long if prompt_length >= self.long_prompt_tokens else self.short

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> DraftSession:
        return self.for_prompt(len(prompt_ids)).start(prompt_ids, sampling)
