"""``verispec eagle extract``: run the frozen target over a corpus, save (token ids, features) shards.

Each shard is a safetensors file with ``tokens`` [total] int32, ``features`` [total, hidden]
bfloat16 (the target's top-layer features, what its LM head reads) and ``offsets``
[num_sequences + 1] int64 marking where each sequence starts. ``manifest.json`` records the
target's fingerprint, the settings and every finished shard, so an interrupted run resumes
after its last shard (documents come in a deterministic order) and a run for another target or
other settings is refused rather than mixed in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from verispec.drafters.eagle.checkpoint import target_fingerprint, write_atomically
from verispec.drafters.eagle.corpus import Document
from verispec.engine.cached_lm import CachedLM
from verispec.models.text import encode_chat

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ExtractSettings:
    max_tokens: int  # stop after this many tokens in total
    max_seq_len: int = 1024  # longer documents are cut (the head trains on this length at most)
    shard_tokens: int = 16384  # tokens per shard: the unit of resumption

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_seq_len", "shard_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{name} must be an integer >= 2, got {value!r}")


def extract_features(
    target,  # noqa: ANN001 - a LoadedModel (model + tokenizer)
    documents: Iterable[Document],
    out_dir: str | os.PathLike,
    settings: ExtractSettings,
    *,
    corpus_name: str = "custom",
    progress: bool = True,
) -> dict:
    """Write shards into ``out_dir`` until ``settings.max_tokens``; return the manifest."""
    lm = CachedLM(target.model)

    def features_of(document: Document) -> list[tuple[list[int], torch.Tensor | None]]:
        ids = encode_chat(target.tokenizer, document.messages)[: settings.max_seq_len]
        if len(ids) < 2:
            return [(ids, None)]
        try:
            return [(ids, lm.extend(ids, num_logits=0).features)]  # [n, hidden]
        finally:
            lm.release()

    return _build_shards(target, documents, features_of, out_dir, settings, corpus_name, progress)


def record_answers(
    target,  # noqa: ANN001 - a LoadedModel
    requests: Iterable[tuple[str, str]],
    out_dir: str | os.PathLike,
    settings: ExtractSettings,
    *,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    corpus_name: str = "custom requests",
    progress: bool = True,
) -> dict:
    """The target's own greedy answers to ``requests`` (name, text), with their features.

    Requests are answered ``batch_size`` at a time (:func:`greedy_answers`); the features are
    recorded as the answers are written, so no second pass runs. The batch size is part of the
    corpus identity: resuming counts finished batches.
    """
    from verispec.drafters.eagle.answers import greedy_answers, stop_and_pad_ids
    from verispec.models.text import encode_prompt

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    tokenizer, model = target.tokenizer, target.model
    stop_ids, pad_id = stop_and_pad_ids(target)
    steps = tqdm(total=max_new_tokens, unit="step", desc="batch", leave=False, disable=not progress)

    def features_of(batch: list[tuple[str, str]]) -> list[tuple[list[int], torch.Tensor | None]]:
        prompts = [encode_prompt(tokenizer, text)[: settings.max_seq_len - 1] for _, text in batch]
        steps.reset()
        answers = greedy_answers(model, prompts, max_new_tokens, stop_ids, pad_id, on_step=lambda done: steps.update(done - steps.n))
        return [(ids[: settings.max_seq_len], features[: settings.max_seq_len]) for ids, features in answers]

    name = f"target greedy answers to {corpus_name} (batches of {batch_size}, up to {max_new_tokens} new tokens)"
    try:
        return _build_shards(target, _batches(requests, batch_size), features_of, out_dir, settings, name, progress)
    finally:
        steps.close()


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _build_shards(target, items, features_of, out_dir, settings: ExtractSettings, corpus_name: str, progress: bool) -> dict:  # noqa: ANN001
    """Turn each item into (ids, features) sequences with ``features_of`` and write shards until max_tokens; resumable."""
    if target.tokenizer is None:
        raise ValueError("feature extraction needs the target's tokenizer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _open_manifest(out, target, settings, corpus_name)
    done_tokens = sum(shard["tokens"] for shard in manifest["shards"])
    skip_documents = sum(shard["documents"] for shard in manifest["shards"])
    bar = tqdm(total=settings.max_tokens, initial=min(done_tokens, settings.max_tokens), unit="tok", desc="extract", disable=not progress)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tokens [n], features [n, hidden]) of the shard being built
    pending_tokens = pending_documents = 0
    try:
        for index, item in enumerate(items):
            if index < skip_documents:
                continue
            if done_tokens >= settings.max_tokens:
                break
            pending_documents += 1
            item_tokens = 0
            for ids, features in features_of(item):
                ids = ids[: settings.max_tokens - done_tokens]
                if features is None or len(ids) < 2:
                    continue
                features = features[: len(ids)]
                pending.append((torch.tensor(ids, dtype=torch.int32), features.to(torch.bfloat16)))
                pending_tokens += len(ids)
                done_tokens += len(ids)
                item_tokens += len(ids)
            # One update per item: a batch of answers arrives at once, and per-sequence updates
            # within tqdm's refresh interval left the bar showing the batch's first answer only
            # (and a rate of one answer per batch) until the next batch, minutes later.
            bar.update(item_tokens)
            if pending_tokens >= settings.shard_tokens:
                _write_shard(out, manifest, pending, pending_documents)
                pending, pending_tokens, pending_documents = [], 0, 0
        if pending:
            _write_shard(out, manifest, pending, pending_documents)
    finally:
        bar.close()
    return manifest


def _open_manifest(out: Path, target, settings: ExtractSettings, corpus_name: str) -> dict:  # noqa: ANN001
    identity = {
        "target": target.name,
        "target_fingerprint": target_fingerprint(target.model),
        "hidden_size": target.model.config.get_text_config(decoder=True).hidden_size,
        # Recorded so one directory never mixes precisions (features from either drafts alike, but a
        # resumed run should not silently switch); manifests from before the option are float32.
        "target_dtype": str(target.model.dtype).removeprefix("torch."),
        "max_seq_len": settings.max_seq_len,
        "corpus": corpus_name,
    }
    path = out / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        manifest.setdefault("target_dtype", "float32")
        for key, value in identity.items():
            if manifest.get(key) != value:
                raise ValueError(f"{out} holds features with {key}={manifest.get(key)!r}, this run has {value!r}: move that directory away or use another --cache-dir")
        return manifest
    manifest = {**identity, "shards": []}
    _save_manifest(out, manifest)
    return manifest


def _write_shard(out: Path, manifest: dict, sequences: list[tuple[torch.Tensor, torch.Tensor]], documents: int) -> None:
    lengths = torch.tensor([len(tokens) for tokens, _ in sequences], dtype=torch.int64)
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)))
    name = f"shard-{len(manifest['shards']):05d}.safetensors"
    tensors = {
        "tokens": torch.cat([tokens for tokens, _ in sequences]),
        "features": torch.cat([features for _, features in sequences]).contiguous(),
        "offsets": offsets,
    }
    write_atomically(out / name, tensors)
    manifest["shards"].append({"file": name, "sequences": len(sequences), "tokens": int(offsets[-1]), "documents": documents})
    _save_manifest(out, manifest)  # after the shard: a crash in between only redoes that shard


def _save_manifest(out: Path, manifest: dict) -> None:
    partial = out / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=1))
    os.replace(partial, out / MANIFEST)


def load_shards(features_dir: str | os.PathLike) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(manifest, [(tokens [n] int64, features [n, hidden] bfloat16) per sequence])."""
    features_dir = Path(features_dir)
    path = features_dir / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no {MANIFEST} in {str(features_dir)!r}: run `verispec eagle extract` or `verispec eagle answers` first")
    manifest = json.loads(path.read_text())
    sequences = []
    for shard in manifest["shards"]:
        tensors = load_file(str(features_dir / shard["file"]))
        offsets = tensors["offsets"].tolist()
        for begin, end in zip(offsets, offsets[1:]):
            sequences.append((tensors["tokens"][begin:end].long(), tensors["features"][begin:end]))
    if not sequences:
        raise ValueError(f"{features_dir} holds no sequences yet")
    return manifest, sequences
