"""Saving and loading an EAGLE head, bound to the one target it was trained on.

A head predicts one target's features; loaded next to another target it would draft garbage
(still exact, but slow) or crash on a shape. So a checkpoint records the target's shape and a
fingerprint of its embedding and LM-head weights, and :func:`load_head` refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from verispec.drafters.eagle.head import EagleConfig, EagleHead

FORMAT = "verispec-eagle-1"
_FINGERPRINT_ROWS = 64
# Heads that ship with verispec, one per target: <target>.safetensors (README, "The bundled head").
BUNDLED_HEADS = Path(__file__).with_name("heads")


class EagleHeadMismatchError(ValueError):
    """The head was trained for a different target (shape, vocabulary or weights)."""


def _safe_name(target_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in Path(str(target_name)).name or "target")


def default_head_path(target_name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``verispec eagle build`` puts the head for a target: <cache>/eagle/<target>/head.safetensors."""
    from verispec.models.registry import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "eagle" / _safe_name(target_name) / "head.safetensors"


def bundled_head_path(target_name: str, bundled_dir: Path = BUNDLED_HEADS) -> Path:
    """Where a head that ships with verispec for ``target_name`` would be (it may not exist)."""
    return bundled_dir / f"{_safe_name(target_name)}.safetensors"


def find_head(target_name: str, cache_dir: str | os.PathLike | None = None, bundled_dir: Path = BUNDLED_HEADS) -> Path | None:
    """The head ``--drafter eagle`` uses by default: one built on this machine, else the bundled one, else None.

    A head the user built (``verispec eagle build``) wins: they made it on purpose, for this target.
    """
    return _first_file(default_head_path(target_name, cache_dir), bundled_head_path(target_name, bundled_dir))


def existing_head_path(
    path: str | os.PathLike | None, target_name: str, cache_dir: str | os.PathLike | None = None, bundled_dir: Path = BUNDLED_HEADS
) -> Path:
    """``path``, or :func:`find_head`'s; FileNotFoundError saying how to make one if absent.

    Called before the target is loaded, so a missing head costs no minutes of loading.
    """
    built, bundled = default_head_path(target_name, cache_dir), bundled_head_path(target_name, bundled_dir)
    return resolve_head_file(path, target_name, built, bundled, "EAGLE head", f"verispec eagle build --target {target_name}")


def resolve_head_file(path: str | os.PathLike | None, target_name: str, built: Path, bundled: Path, kind: str, train_command: str) -> Path:
    """``path`` (it must exist), else ``built`` (made on this machine, on purpose), else ``bundled``;
    FileNotFoundError naming ``train_command`` if none is there. Shared by every head kind."""
    if path is not None:
        head = Path(path)
        if not head.is_file():
            raise FileNotFoundError(f"{kind} {str(head)!r} not found: pass an existing head, or train one with `{train_command}`")
        return head
    head = _first_file(built, bundled)
    if head is None:
        raise FileNotFoundError(f"no {kind} for {target_name!r} (none at {str(built)!r}, none bundled): train one with `{train_command}` or pass its path")
    return head


def _first_file(*candidates: Path) -> Path | None:
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def target_fingerprint(target: PreTrainedModel) -> str:
    """A short hash of what the head depends on: shapes, and the target's embedding/LM-head rows.

    Rounded to bfloat16 first, so the same weights loaded as float32 or bfloat16 match.
    """
    config = target.config.get_text_config(decoder=True)
    digest = hashlib.sha256()
    digest.update(f"{config.model_type}|{config.hidden_size}|{config.vocab_size}|{config.num_hidden_layers}".encode())
    for matrix in (target.get_input_embeddings().weight, target.get_output_embeddings().weight):
        rows = torch.linspace(0, matrix.shape[0] - 1, _FINGERPRINT_ROWS).long()
        sample = matrix.detach()[rows].to(torch.bfloat16).view(torch.int16)
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def save_head(
    path: str | os.PathLike,
    head: torch.nn.Module,  # an EagleHead, or another head kind with a config.to_dict()
    *,
    draft_vocab: torch.Tensor | None,  # [draft_vocab] int64 token ids, or None for the full vocabulary
    fingerprint: str,
    dtype: torch.dtype = torch.float32,
    training: dict | None = None,
    format: str = FORMAT,  # noqa: A002 - the file's format tag (another head kind passes its own)
) -> Path:
    """Write the head atomically (a crash leaves the previous file intact)."""
    path = Path(path)
    tensors = {name: value.detach().to(dtype).contiguous() for name, value in head.state_dict().items()}
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    metadata = {
        "format": format,
        "config": json.dumps(head.config.to_dict()),
        "target_fingerprint": fingerprint,
        "training": json.dumps(training or {}),
    }
    return write_atomically(path, tensors, metadata)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file written atomically: a crash leaves the previous file (or none) intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)
    return path


def read_metadata(path: str | os.PathLike, format: str = FORMAT, kind: str = "EAGLE head") -> dict:  # noqa: A002
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for a damaged header
        raise ValueError(f"{path} is not a verispec {kind} (unreadable safetensors: {error})") from None
    if metadata.get("format") != format:
        raise ValueError(f"{path} is not a verispec {kind} (format {metadata.get('format')!r}, expected {format!r})")
    return metadata


def check_target(path: Path, metadata: dict, config: EagleConfig, target: PreTrainedModel, kind: str, how_to_train: str) -> None:
    """Refuse a head (``config`` from its ``metadata``) made for another target's shape or weights."""
    expected = EagleConfig.for_target(target.config, config.intermediate_size)
    for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(config, field) != getattr(expected, field):
            raise EagleHeadMismatchError(
                f"{kind} {path.name} was trained for a target with {field}={getattr(config, field)}, "
                f"this target has {getattr(expected, field)}"
            )
    fingerprint = target_fingerprint(target)
    if metadata["target_fingerprint"] != fingerprint:
        raise EagleHeadMismatchError(
            f"{kind} {path.name} was trained for a different target (fingerprint {metadata['target_fingerprint']}, "
            f"this target {fingerprint}): train one for it with {how_to_train}"
        )


def export_head(source: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a verispec head file (EAGLE or parallel) with its weights stored in ``dtype``.

    Made to bundle a head at half the size. Metadata (format, config, target fingerprint, training
    record) is kept, plus where the copy came from; the draft vocabulary stays int64. Loading
    computes in float32 whatever the file stores, so a bfloat16 copy drafts with its weights
    rounded once to bfloat16, the precision its products were trained in.
    """
    from safetensors import safe_open

    source, out = Path(source), Path(out)
    if not source.is_file():
        raise FileNotFoundError(f"head {str(source)!r} does not exist")
    try:
        with safe_open(str(source), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open is not iterable
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{source} is not a verispec head (unreadable safetensors: {error})") from None
    if not metadata.get("format", "").startswith("verispec-"):
        raise ValueError(f"{source} is not a verispec head (format {metadata.get('format')!r})")
    tensors = {name: value.to(dtype).contiguous() if value.is_floating_point() else value for name, value in tensors.items()}
    metadata["exported"] = json.dumps({"from": source.name, "dtype": str(dtype).removeprefix("torch.")})
    return write_atomically(out, tensors, metadata)


def load_head(path: str | os.PathLike, target: PreTrainedModel) -> tuple[EagleHead, torch.Tensor | None]:
    """Load a head for ``target``: (head in float32, eval mode; draft vocabulary ids or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE head {str(path)!r} does not exist")
    metadata = read_metadata(path)
    config = EagleConfig(**json.loads(metadata["config"]))
    check_target(path, metadata, config, target, "EAGLE head", "`verispec eagle extract` + `verispec eagle train`")
    tensors = load_file(str(path))
    draft_vocab = tensors.pop("draft_vocab", None)
    head = EagleHead(config)
    head.load_state_dict({name: value.float() for name, value in tensors.items()})
    return head.eval().requires_grad_(False), draft_vocab
