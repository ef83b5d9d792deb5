"""Accept a model the way users hold it: a transformers model or what ``load_model`` returns."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel


def unwrap_model(model: Any, *, argument: str = "model") -> tuple[PreTrainedModel, Any | None]:
    """Return ``(PreTrainedModel, tokenizer or None)`` for a model or a ``LoadedModel``."""
    if isinstance(model, PreTrainedModel):
        return model, None
    inner = getattr(model, "model", None)
    if isinstance(inner, PreTrainedModel):
        return inner, getattr(model, "tokenizer", None)
    raise ValueError(
        f"{argument} must be a transformers PreTrainedModel or a verispec LoadedModel, got {type(model).__name__}"
    )
