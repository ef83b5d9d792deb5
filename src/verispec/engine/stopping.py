"""When generation ends: stop token ids (EOS by default) and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopCondition:
    """Cuts each round's new tokens at the first stop; remembers the text seen so far."""

    def __init__(self, stop: Sequence[int | str], tokenizer: Any | None) -> None:
        self.stop_ids = {s for s in stop if isinstance(s, int) and not isinstance(s, bool)}
        self.stop_strings = [s for s in stop if isinstance(s, str)]
        bad = [s for s in stop if not (s in self.stop_ids or s in self.stop_strings)]
        if bad or any(not s for s in self.stop_strings):
            raise ValueError(f"stop must hold token ids (int) and non-empty strings, got {list(stop)!r}")
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass a LoadedModel or tokenizer=..., or use stop token ids")
        self.tokenizer = tokenizer
        self.generated: list[int] = []

    def cut(self, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Return the part of ``new_tokens`` to emit and whether generation must stop."""
        for index, token in enumerate(new_tokens):
            if token in self.stop_ids:
                return self._take(new_tokens[: index + 1]), True
        if self.stop_strings:
            for index in range(len(new_tokens)):
                # Check after each token so the output ends at the token that completed the stop string.
                if self._contains_stop(self.generated + new_tokens[: index + 1]):
                    return self._take(new_tokens[: index + 1]), True
        return self._take(new_tokens), False

    def _take(self, tokens: list[int]) -> list[int]:
        self.generated.extend(tokens)
        return tokens

    def _contains_stop(self, tokens: list[int]) -> bool:
        # A stop string can only be completed in the last few tokens' text; decoding a tail window
        # (wider than any stop string) keeps this O(1) per token.
        window = max(len(s) for s in self.stop_strings) + 8
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)

    def trim_text(self, text: str) -> str:
        """Cut decoded output text before the first stop string (OpenAI semantics)."""
        positions = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(positions)] if positions else text
