"""Token ids to streamed text: only text that can no longer change is sent.

Two things can change the tail of decoded text when more tokens arrive: a multi-byte character
split across tokens (it decodes to U+FFFD until complete) and a stop string still being written
(OpenAI leaves stop strings out of the text, so their first characters must not go out early).
The concatenation of everything sent equals the non-streamed text.
"""

from __future__ import annotations

from typing import Any

from verispec.engine.stopping import StopCondition


class TextStream:
    def __init__(self, tokenizer: Any, stop_strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.trimmer = StopCondition(stop_strings, tokenizer)  # only its trim_text is used
        # Any suffix shorter than the longest stop string could be the start of one.
        self.hold_back = max((len(s) for s in stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int], final: bool) -> str:
        """Add a round's tokens; return the new text that is safe to send (all of it when ``final``)."""
        self.token_ids.extend(token_ids)
        text = self.text()
        if not final:
            text = text[: len(text) - self.hold_back] if self.hold_back else text
            if text.endswith("\ufffd") or not text.startswith(self.sent):
                return ""
        new = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += new
        return new

    def text(self) -> str:
        """The whole text so far, stop strings trimmed: the non-streamed answer."""
        return self.trimmer.trim_text(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))
