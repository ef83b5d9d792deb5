"""The OpenAI request bodies we accept, and the error body every refusal uses.

Field types are strict (a string where a number belongs is refused, not coerced), ranges follow
OpenAI's, and extra fields are ignored, as OpenAI's clients send some we do not use.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit


class OpenAIError(Exception):
    """A refusal with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


Number = StrictFloat | StrictInt


class GenerationBody(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # extension (vLLM's spelling); 0 = off
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = Field(default=None, validate_default=True)  # normalised to a list
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return strings

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionBody(GenerationBody):
    # A text (no chat template) or token ids; a list of one text is also accepted (OpenAI's batch form).
    prompt: StrictStr | list[StrictStr] | list[StrictInt]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def as_template_message(self) -> dict:
        """The message as chat templates take it (developer is OpenAI's newer name for system)."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionBody(GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
