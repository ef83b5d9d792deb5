"""OpenAI response and stream-chunk bodies for completions and chat completions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from verispec.engine.stats import GenerationStats


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens, "total_tokens": stats.prompt_tokens + stats.new_tokens}


def speculation(stats: GenerationStats) -> dict:
    """The ``verispec`` extension field: what speculation did for this request."""
    return {
        "acceptance_rate": stats.acceptance_rate,  # alpha
        "tokens_per_call": stats.tokens_per_call,  # tau
        "target_calls": stats.target_calls,
        "draft_tokens": stats.num_drafted,
        "accepted_tokens": stats.num_accepted,
    }


@dataclass
class ResponseShape:
    """Builds one request's bodies; ``chat`` picks the chat completion layout."""

    model: str
    chat: bool
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        """The non-streamed body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(stream=False), "choices": [choice], "usage": usage(stats), "verispec": speculation(stats)}

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """A stream chunk carrying new text (and, on the last one, the finish reason)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or finish_reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(stream=True), "choices": [choice]}

    def usage_chunk(self, stats: GenerationStats) -> dict:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._envelope(stream=True), "choices": [], "usage": usage(stats), "verispec": speculation(stats)}
