"""Convert a GGUF file, once, into a Hugging Face model directory (safetensors).

Dequantising a GGUF through transformers is slow (~100 s for the 1.5B model on 2 cores,
~20 s of it rebuilding the tokenizer), while loading safetensors is a memory map. So built-in
models are converted once into ``cache_dir/<name>/hf/`` and loaded from there.

Weights are stored as float32: transformers dequantises GGUF blocks in float32, and
the products of fp16 scales and integer quants do not generally fit in bf16/fp16, so
float32 keeps the converted model bit-identical to loading the GGUF directly. The
caller's dtype is applied at load time.

Atomicity: the directory is written under a ``.tmp-<pid>`` name and renamed into place
only after everything, including the ``verispec-conversion.json`` marker, is written.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .fetch import remove_stale_temps

MARKER = "verispec-conversion.json"
# Measured on 2 CPU cores (0.5B: 71 s, 1.5B: 100 s); only used to announce the wait.
_TOKENIZER_SECONDS, _SECONDS_PER_GB = 20, 70


def is_converted(out_dir: Path) -> bool:
    return (out_dir / MARKER).is_file()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into a safetensors model directory at ``out_dir`` (if not done yet)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir.parent)
    if out_dir.exists():  # we only ever rename finished conversions into place
        raise FileExistsError(f"{out_dir} exists but is not a finished verispec conversion "
                              f"(no {MARKER}); remove it and retry")

    size_gb = gguf_path.stat().st_size / 1e9
    if progress:
        print(f"verispec: converting {gguf_path.name} to safetensors, once "
              f"(roughly {round(_TOKENIZER_SECONDS + size_gb * _SECONDS_PER_GB, -1):.0f} s on 2 CPU cores)...",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    try:
        _write_hf_dir(gguf_path, tmp)
        (tmp / MARKER).write_text(json.dumps({
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "transformers": transformers.__version__,
            "seconds": round(time.perf_counter() - start, 1),
        }, indent=2) + "\n")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_converted(out_dir):  # else a concurrent conversion won the race: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"verispec: converted in {time.perf_counter() - start:.0f} s -> {out_dir}",
              file=sys.stderr, flush=True)
    return out_dir


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32, **_dense())
    _drop_gguf_quantizer(model)

    # GGUF carries the special ids in its tokenizer metadata; make generate() agree with
    # the tokenizer instead of relying on whatever defaults the GGUF config mapping gave.
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = gen.eos_token_id
    model.config.pad_token_id = gen.pad_token_id
    model.config.bos_token_id = gen.bos_token_id

    model.save_pretrained(out)  # safetensors; also writes generation_config.json
    tokenizer.save_pretrained(out)
    del model
    gc.collect()  # several GB of float32 weights; free them before the caller loads the result


def _dense() -> dict:
    """from_pretrained kwargs that make transformers unpack every GGUF weight into a dense tensor.

    Newer transformers 5.x can keep GGUF blocks packed (when the optional `kernels` package
    is installed); a converted model must be dense. Older 5.x always unpacks.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_gguf_quantizer(model: torch.nn.Module) -> None:
    """Turn a GGUF-loaded (dequantised) model into a plain one that save_pretrained accepts.

    transformers tags it "quantized with gguf" and refuses to serialise it, although every
    weight is already a dense tensor; the tag would also make the saved config point at a
    .gguf file that is not in the directory.
    """
    bad = [n for n, p in model.named_parameters() if type(p.data) is not torch.Tensor or p.dtype != torch.float32]
    if bad:
        raise RuntimeError(f"GGUF weights were not fully dequantised ({bad[:3]}...); cannot convert")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
