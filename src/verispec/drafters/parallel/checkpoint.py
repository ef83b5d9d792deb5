"""Saving and loading a parallel head, bound to its target exactly as an EAGLE head is.

The file format is EAGLE's (safetensors, config + target fingerprint in the metadata) with its
own format tag, so an EAGLE head is never loaded as a parallel one or the other way round.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from verispec.drafters.eagle.checkpoint import BUNDLED_HEADS, bundled_head_path, check_target, default_head_path, read_metadata, resolve_head_file, save_head
from verispec.drafters.parallel.head import ParallelConfig, ParallelHead

FORMAT = "verispec-parallel-1"
KIND = "parallel head"


def default_parallel_path(target_name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """<cache>/eagle/<target>/parallel.safetensors: next to the EAGLE head and the feature shards it trains on."""
    return default_head_path(target_name, cache_dir).with_name("parallel.safetensors")


def bundled_parallel_path(target_name: str, bundled_dir: Path = BUNDLED_HEADS) -> Path:
    """Where a parallel head that ships with verispec for ``target_name`` would be (it may not exist):
    <target>.parallel.safetensors beside the bundled EAGLE head, whose draft vocabulary it shares."""
    eagle = bundled_head_path(target_name, bundled_dir)
    return eagle.with_name(f"{eagle.stem}.parallel.safetensors")


def existing_parallel_path(
    path: str | os.PathLike | None, target_name: str, cache_dir: str | os.PathLike | None = None, bundled_dir: Path = BUNDLED_HEADS
) -> Path:
    """``path``, else the parallel head trained here, else the bundled one; FileNotFoundError saying
    how to make one. A head the user trained wins, as for the EAGLE head: they made it on purpose."""
    built, bundled = default_parallel_path(target_name, cache_dir), bundled_parallel_path(target_name, bundled_dir)
    return resolve_head_file(path, target_name, built, bundled, KIND, f"verispec parallel train --target {target_name}")


def save_parallel_head(
    path: str | os.PathLike,
    head: ParallelHead,
    *,
    draft_vocab: torch.Tensor | None,  # [draft_vocab] int64
    fingerprint: str,
    training: dict | None = None,
) -> Path:
    return save_head(path, head, draft_vocab=draft_vocab, fingerprint=fingerprint, training=training, format=FORMAT)


def load_parallel_head(path: str | os.PathLike, target: PreTrainedModel) -> tuple[ParallelHead, torch.Tensor | None]:
    """Load a parallel head for ``target``: (head in float32, eval mode; draft vocabulary ids or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"parallel head {str(path)!r} does not exist")
    metadata = read_metadata(path, format=FORMAT, kind=KIND)
    config = ParallelConfig(**json.loads(metadata["config"]))
    check_target(path, metadata, config, target, KIND, "`verispec parallel train`")
    tensors = load_file(str(path))
    draft_vocab = tensors.pop("draft_vocab", None)
    head = ParallelHead(config)
    head.load_state_dict({name: value.float() for name, value in tensors.items()})
    return head.eval().requires_grad_(False), draft_vocab
