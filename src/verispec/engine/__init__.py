"""The engine: one owner per KV cache, and the draft -> verify -> accept loop."""

from verispec.engine.cached_lm import CachedLM, ForwardOutput
from verispec.engine.decoder import GenerationResult, SpeculativeDecoder, StepResult
from verispec.engine.stats import GenerationStats

__all__ = ["CachedLM", "ForwardOutput", "GenerationResult", "GenerationStats", "SpeculativeDecoder", "StepResult"]
