"""verispec: lossless speculative decoding. Same output as the target model, fewer target calls."""

from verispec.drafters import DraftModel
from verispec.engine import GenerationResult, GenerationStats, SpeculativeDecoder, StepResult
from verispec.rejection import greedy_verify, rejection_sample
from verispec.sampling import SamplingParams, logits_to_probs

__version__ = "0.1.0"


def load_model(spec, **kwargs):  # noqa: ANN001, ANN201 - documented in verispec.models.load_model
    """Load a target or draft model; see :func:`verispec.models.load_model`."""
    from verispec.models import load_model as _load_model

    return _load_model(spec, **kwargs)


__all__ = [
    "DraftModel",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "StepResult",
    "greedy_verify",
    "load_model",
    "logits_to_probs",
    "rejection_sample",
]
