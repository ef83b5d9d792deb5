"""The target's greedy answers to evaluation prompts, recorded once and kept on disk.

`eagle eval --teacher-forced` and `parallel eval` replay greedy decoding on the target's own answers
and the features that produced them. Recording the answers is nearly all of such an evaluation's
time (65 Spec-Bench answers of 128 tokens: over an hour in float32 on a 2-core CPU), the replay
minutes. So each answer is stored under a key of everything it depends on — the target (its
fingerprint and the precision it ran in), the chat-templated prompt's ids and the answer's length
limit — and a later evaluation (another head, other settings, or a run that was interrupted)
records only the answers that are missing. Files are written atomically: an interrupted write
leaves no file, never a partial one.

Two recorders. :func:`recorded_answers` writes answers in batches through transformers' forward
(fast for many short prompts). :func:`recorded_engine_answers` writes one prompt at a time through
the forward the decoding engine runs (:func:`~verispec.engine.lean_lm.target_lm`: our kernels where
the target runs them), in float32 — the very features a drafter receives in decoding, which a
session replay (:func:`~verispec.drafters.eagle.acceptance.replay_session_rounds`) needs to be
exact, and a batch of 16K-token prompts would not fit anyway. Their keys differ.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

ANSWERS_PER_BATCH = 16  # answers written together: ~8x faster a token than one at a time here


def default_recordings_dir(target_name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """<cache>/eagle/<target>/recordings, beside the target's heads and feature shards."""
    from verispec.drafters.eagle import default_head_path

    return default_head_path(target_name, cache_dir).with_name("recordings")


def answer_key(fingerprint: str, dtype: torch.dtype, max_new_tokens: int, prompt: list[int]) -> str:
    """A file name for one recorded answer: a hash of the target, its precision, the length limit and the prompt ids."""
    digest = hashlib.sha256(f"{fingerprint}|{dtype}|{max_new_tokens}|".encode())
    digest.update(torch.tensor(prompt, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:32]


def engine_answer_key(fingerprint: str, forward: str, dtype: torch.dtype, max_new_tokens: int, prompt: list[int]) -> str:
    """:func:`answer_key` of an answer recorded through the engine's ``forward`` ("lean" or
    "transformers": they round differently) — another recorder, another file."""
    return answer_key(f"{fingerprint}|engine-{forward}", dtype, max_new_tokens, prompt)


def _read_answer(directory: Path, key: str) -> dict[str, torch.Tensor] | None:
    path = directory / f"{key}.safetensors"
    return load_file(path) if path.is_file() else None


def load_answer(directory: Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fed tokens # [n], their features # [n, hidden]) stored under ``key``, or None if there is none."""
    tensors = _read_answer(directory, key)
    return (tensors["tokens"], tensors["features"]) if tensors is not None else None


def load_decoded_answer(directory: Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the decoded sequence # [n+1]: the fed tokens then the last, emitted token; the fed tokens'
    features # [n, hidden]) stored with ``last_token`` under ``key``, or None if there is none."""
    tensors = _read_answer(directory, key)
    return (torch.cat((tensors["tokens"], tensors["last_token"])), tensors["features"]) if tensors is not None else None


def save_answer(
    directory: Path,
    key: str,
    tokens: torch.Tensor,  # [n] int64: prompt and answer as fed to the target
    features: torch.Tensor,  # [n, hidden]: the target's top-layer features at those positions
    last_token: int | None = None,  # the answer's last token (emitted, never fed), for load_decoded_answer
) -> Path:
    from verispec.drafters.eagle.checkpoint import write_atomically

    tensors = {"tokens": tokens.to(torch.int64).contiguous(), "features": features.contiguous()}
    if last_token is not None:
        tensors["last_token"] = torch.tensor([last_token], dtype=torch.int64)
    return write_atomically(directory / f"{key}.safetensors", tensors)  # a reader sees the whole file or none


def recorded_answers(
    target,  # noqa: ANN001 - a LoadedModel
    texts: list[str],
    max_new_tokens: int,
    directory: Path | None = None,
    *,
    reuse: bool = True,
    batch_size: int = ANSWERS_PER_BATCH,
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(prompt ids, the fed text # [n] long, its features # [n, hidden]) per text, in order: the target's
    greedy answer to the chat-templated text with the features that produced it.

    The recorded answer leaves out its last token (emitted, never fed): the decoded sequence is n + 1 long.
    With ``directory``, answers found there are read instead of recorded (unless ``reuse`` is False)
    and every recorded answer is stored there; the missing ones of each group of ``batch_size`` texts
    are recorded together.
    """
    from tqdm import tqdm

    from verispec.drafters.eagle.answers import greedy_answers, stop_and_pad_ids
    from verispec.drafters.eagle.checkpoint import target_fingerprint
    from verispec.models import encode_prompt

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    stop_ids, pad_id = stop_and_pad_ids(target)
    prompts = [encode_prompt(target.tokenizer, text) for text in texts]
    fingerprint, dtype = target_fingerprint(target.model), next(target.model.parameters()).dtype
    keys = [answer_key(fingerprint, dtype, max_new_tokens, prompt) for prompt in prompts]
    read = recorded = 0
    progress = tqdm(total=len(prompts), desc="answers", unit="answer", file=sys.stderr)
    try:
        for begin in range(0, len(prompts), batch_size):
            group = range(begin, min(begin + batch_size, len(prompts)))
            found = {index: load_answer(directory, keys[index]) for index in group} if directory is not None and reuse else {}
            missing = [index for index in group if found.get(index) is None]
            read += len(group) - len(missing)
            if missing:
                answers = greedy_answers(target.model, [prompts[index] for index in missing], max_new_tokens, stop_ids, pad_id)
                for index, (tokens, features) in zip(missing, answers):
                    found[index] = (torch.tensor(tokens), features)
                    if directory is not None:
                        save_answer(directory, keys[index], *found[index])
                recorded += len(missing)
            progress.update(len(group))
            for index in group:
                yield (prompts[index], *found[index])
    finally:
        progress.close()
        if directory is not None:
            print(f"answers: {read} read from {directory}, {recorded} recorded there", file=sys.stderr)


@torch.inference_mode()
def engine_greedy_answer(
    model,  # noqa: ANN001 - a Hugging Face causal LM
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decoded sequence, prompt then greedy answer # [n] long; the float32 features of every
    fed token # [n-1, hidden]), run as the engine runs plain greedy decoding: one prefill pass over
    the prompt but its last token, then one token a pass, the stop token kept (and never fed)."""
    from verispec.engine.lean_lm import target_lm

    if len(prompt) < 2 or max_new_tokens < 1:
        raise ValueError(f"a recorded answer needs a prompt of >= 2 tokens and max_new_tokens >= 1, got {len(prompt)} and {max_new_tokens}")
    lm = target_lm(model)
    try:
        features = [lm.extend(prompt[:-1], num_logits=0).features.float()]  # [len(prompt)-1, hidden]
        sequence = list(prompt)
        for _ in range(max_new_tokens):
            step = lm.extend(sequence[-1:], num_logits=1, argmax_only=True)
            features.append(step.features.float())
            sequence.append(int(step.logits[-1].argmax()))
            if sequence[-1] in stop_ids:
                break
    finally:
        lm.release()
    return torch.tensor(sequence), torch.cat(features)


def recorded_engine_answers(
    target,  # noqa: ANN001 - a LoadedModel
    prompts: list[list[int]],
    max_new_tokens: int,
    directory: Path | None = None,
    *,
    reuse: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(decoded sequence # [n] long, features # [n-1, hidden]) per chat-templated prompt, in order:
    :func:`engine_greedy_answer`, read from ``directory`` where recorded before (unless ``reuse`` is
    False) and stored there when recorded (stored as the fed tokens, the features and the last token)."""
    from tqdm import tqdm

    from verispec.drafters.eagle.answers import stop_and_pad_ids
    from verispec.drafters.eagle.checkpoint import target_fingerprint
    from verispec.engine.lean_lm import target_runs_lean

    stop_ids, _ = stop_and_pad_ids(target)
    fingerprint, dtype = target_fingerprint(target.model), next(target.model.parameters()).dtype
    forward = "lean" if target_runs_lean(target.model) else "transformers"
    read = recorded = 0
    progress = tqdm(prompts, desc="answers", unit="answer", file=sys.stderr)
    try:
        for prompt in progress:
            # A long prompt's prefill is one pass of minutes (16K tokens: ~10 here): say what runs.
            progress.set_postfix_str(f"{len(prompt)}-token prompt")
            key = engine_answer_key(fingerprint, forward, dtype, max_new_tokens, prompt)
            found = load_decoded_answer(directory, key) if directory is not None and reuse else None
            if found is not None:
                read += 1
                yield found
                continue
            sequence, features = engine_greedy_answer(target.model, prompt, max_new_tokens, stop_ids)
            recorded += 1
            if directory is not None:
                save_answer(directory, key, sequence[:-1], features, last_token=int(sequence[-1]))
            yield sequence, features
    finally:
        progress.close()
        if directory is not None:
            print(f"answers: {read} read from {directory}, {recorded} recorded there", file=sys.stderr)
