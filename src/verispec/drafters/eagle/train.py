"""``verispec eagle train``: fit an EAGLE head to extracted target features.

For a sequence with target features f_0..f_{n-1} and tokens x_0..x_{n-1}, the head reads
(f_i + noise, embed(x_{i+1})) for i = 0..n-2 and predicts f̂_{i+1}. The loss per position is

    SmoothL1(f̂_{i+1}, f_{i+1})  +  0.1 · CE( softmax(W f_{i+1}),  log_softmax(W f̂_{i+1}) )

with W the target's frozen LM head (restricted to the draft vocabulary): the classification
term distils the target's own next-token distribution, which is what drafts are accepted
against. Noise: uniform in ±noise·rms(f) on the input features, so the head learns to recover
from its own imperfect predictions when it drafts several steps ahead. ``unroll_steps`` S > 1
trains on those predictions themselves ("training-time test", :meth:`EagleHead.unrolled`):
the loss is the mean over drafting steps s = 1..S of the same loss on step s's predictions,
which read the head's own step s-1 features exactly as drafting does. ``init_from`` starts
from a trained head (e.g. fine-tune a one-step head with unrolling).
AdamW, linear warm-up then cosine decay; a checkpoint (head, optimiser, step, RNG) is written
every ``checkpoint_every`` steps and the run resumes from it.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from verispec.drafters.eagle.checkpoint import load_head, save_head, target_fingerprint
from verispec.drafters.eagle.extract import load_shards
from verispec.drafters.eagle.head import EagleConfig, EagleHead


PRECISIONS = ("float32", "bfloat16")


def default_precision() -> str:
    """bfloat16 where the CPU multiplies in it natively (AVX512-BF16 / AMX: several times faster), else float32."""
    return "bfloat16" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


@dataclass(frozen=True)
class TrainSettings:
    epochs: float = 4.0
    lr: float = 1e-3
    warmup_steps: int = 50
    tokens_per_step: int = 1024  # sequences are accumulated until this many positions
    max_seq_len: int = 1024
    noise: float = 0.1
    ce_weight: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    intermediate_size: int = 4096  # the head's MLP width; the target's is larger
    draft_vocab: int = 32768  # most frequent corpus tokens; 0 = the full vocabulary
    validation_fraction: float = 0.05
    checkpoint_every: int = 50
    seed: int = 0
    unroll_steps: int = 1  # drafting steps trained on (1: real input features only)
    init_from: str = ""  # a head file to start from ("" = fresh initialisation)
    # With init_from: keep that head's draft vocabulary (the rows its readout was trained on) instead
    # of counting this run's data - for fine-tuning on a smaller or narrower corpus than it saw.
    keep_draft_vocab: bool = False
    precision: str = "float32"  # "bfloat16": matrix products in bfloat16 (autocast), weights and optimiser in float32

    def __post_init__(self) -> None:
        positive = ("epochs", "lr", "tokens_per_step", "max_seq_len", "intermediate_size", "checkpoint_every")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.unroll_steps, bool) or not isinstance(self.unroll_steps, int) or self.unroll_steps < 1:
            raise ValueError(f"unroll_steps must be an integer >= 1, got {self.unroll_steps!r}")
        for name in ("noise", "ce_weight", "weight_decay", "grad_clip", "warmup_steps", "draft_vocab"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.keep_draft_vocab and not self.init_from:
            raise ValueError("keep_draft_vocab needs init_from: there is no draft vocabulary to keep without a head to start from")
        if not 0.0 <= self.validation_fraction < 0.5:
            raise ValueError(f"validation_fraction must be in [0, 0.5), got {self.validation_fraction!r}")


def most_frequent_tokens(sequences: list[tuple[torch.Tensor, torch.Tensor]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of the corpus (ties by id), sorted by id # [size]."""
    counts: Counter[int] = Counter()
    for tokens, _ in sequences:
        counts.update(tokens.tolist())
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


class _Objective:
    """Loss of the head on one sequence, against the frozen target embedding and LM-head rows."""

    def __init__(self, head: EagleHead, embed: torch.nn.Module, head_rows: torch.Tensor, settings: TrainSettings) -> None:
        self.head, self.embed, self.settings = head, embed, settings
        # Cast once: autocast would re-cast these frozen rows (no grad, so not in its cache) at every product.
        self.head_rows = head_rows.to(torch.bfloat16) if settings.precision == "bfloat16" else head_rows

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, dict]:
        # tokens: [n] int64, features: [n, hidden] (bfloat16 on disk)
        features = features.float()
        inputs, targets = features[:-1], features[1:]  # f_i -> f_{i+1}
        if generator is not None and self.settings.noise > 0:
            scale = self.settings.noise * inputs.pow(2).mean().sqrt()
            inputs = inputs + (torch.rand(inputs.shape, generator=generator) * 2 - 1) * scale
        # bfloat16: the matrix products only; softmaxes and losses are taken in float32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.settings.precision == "bfloat16"):
            return self._loss(tokens, inputs, targets)

    def _loss(self, tokens: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # tokens: [n]; inputs, targets: [n-1, hidden] float32 (f_i with noise, f_{i+1})
        with torch.no_grad():
            next_embeds = self.embed(tokens[1:]).float()  # embed(x_{i+1})
            target_logits = F.linear(targets, self.head_rows).float()  # [n-1, draft_vocab]
            target_probs = torch.softmax(target_logits, -1)
        steps = min(self.settings.unroll_steps, len(targets))  # step s has rows s-1.. only
        if steps == 1:
            predictions = [self.head(inputs[None], next_embeds[None])]
        else:
            predictions = self.head.unrolled(inputs[None], next_embeds[None], steps)  # each [1, n-1, hidden]
        loss, metrics = 0.0, {}
        for step, predicted in enumerate(predictions):
            predicted = predicted[0, step:].float()  # rows with a drafting counterpart at this step
            regression = F.smooth_l1_loss(predicted, targets[step:])
            draft_log_probs = torch.log_softmax(F.linear(predicted, self.head_rows).float(), -1)
            classification = -(target_probs[step:] * draft_log_probs).sum(-1).mean()
            loss = loss + (regression + self.settings.ce_weight * classification) / steps
            # max().indices: the same top-1 as argmax, twice as fast over [n, 32768] here
            top1 = (draft_log_probs.max(-1).indices == target_logits[step:].max(-1).indices).float().mean()
            if step == 0:
                metrics.update(regression=regression.item(), classification=classification.item(), top1=top1.item())
            else:
                metrics.update({f"regression_step{step + 1}": regression.item(), f"top1_step{step + 1}": top1.item()})
        return loss, metrics


def train_head(
    target,  # noqa: ANN001 - a LoadedModel or PreTrainedModel: its embeddings and LM head are used, frozen
    features_dirs: str | os.PathLike | list[str | os.PathLike],
    out_path: str | os.PathLike,
    settings: TrainSettings,
    *,
    progress: bool = True,
) -> dict:
    """Train (or resume training) a head on one or more feature directories; write it to ``out_path``."""
    from verispec.modelref import unwrap_model

    model, _ = unwrap_model(target, argument="target")
    out_path = Path(out_path)
    fingerprint = target_fingerprint(model)
    training, validation, corpora = load_sequences(features_dirs, fingerprint, settings.max_seq_len, settings.validation_fraction, settings.seed)

    torch.manual_seed(settings.seed)
    config = EagleConfig.for_target(model.config, settings.intermediate_size)
    head = EagleHead(config)
    start_vocab = None
    if settings.init_from:
        start_head, start_vocab = load_head(settings.init_from, model)  # refuses a head of another target
        if start_head.config != config:
            raise ValueError(f"init_from {settings.init_from!r} has another shape ({start_head.config}) than this run's head ({config})")
        head.load_state_dict(start_head.state_dict())
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if settings.keep_draft_vocab:
        draft_vocab = start_vocab  # (counting this run's tokens would be thrown away)
    else:
        draft_vocab = most_frequent_tokens(training, settings.draft_vocab, vocab_size) if 0 < settings.draft_vocab < vocab_size else None
    objective = _Objective(head, model.get_input_embeddings(), lm_head_rows(model, draft_vocab), settings)

    tokens_per_epoch = sum(len(tokens) - 1 for tokens, _ in training)
    total_steps = max(1, math.ceil(settings.epochs * tokens_per_epoch / settings.tokens_per_step))
    # position: index into the epoch-by-epoch order of training sequences
    optimizer, schedule, generator, checkpoint_path, step, position = start_run(head, settings, total_steps, out_path, fingerprint, corpora)

    before = evaluate(objective, validation) if step == 0 else None  # the untrained head, for comparison
    order = epoch_order(len(training), settings.seed)
    bar = tqdm(total=total_steps, initial=step, unit="step", desc="train", disable=not progress)
    head.train()
    metrics: dict = {}
    try:
        while step < total_steps:
            optimizer.zero_grad(set_to_none=True)
            batch_tokens, batch_metrics = 0, []
            while batch_tokens < settings.tokens_per_step:
                epoch, index = divmod(position, len(training))
                tokens, features = training[order(epoch)[index]]
                loss, values = objective(tokens, features, generator)
                weight = (len(tokens) - 1) / settings.tokens_per_step
                (loss * weight).backward()
                batch_tokens += len(tokens) - 1
                batch_metrics.append(values)
                position += 1
            if settings.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            metrics = {key: sum(m[key] for m in batch_metrics) / len(batch_metrics) for key in batch_metrics[0]}
            bar.set_postfix(loss=f"{metrics['regression'] + settings.ce_weight * metrics['classification']:.3f}", top1=f"{metrics['top1']:.2f}")
            bar.update(1)
            if step % settings.checkpoint_every == 0 or step == total_steps:
                save_checkpoint(checkpoint_path, head, optimizer, schedule, generator, step, position, settings, fingerprint, corpora)
    finally:
        bar.close()
    head.eval()
    result = {"steps": step, "train": metrics, "validation": evaluate(objective, validation), "training_tokens": tokens_per_epoch}
    if before is not None:
        result["validation_before"] = before
    save_head(out_path, head, draft_vocab=draft_vocab, fingerprint=fingerprint, training={**asdict(settings), **result, "corpora": corpora})
    return result


def load_sequences(
    features_dirs: str | os.PathLike | list[str | os.PathLike],
    fingerprint: str,
    max_seq_len: int,
    validation_fraction: float,
    seed: int,
    min_length: int = 3,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]], list[dict]]:
    """(training, validation, corpora) from feature directories of this target (another target's are refused).

    Sequences are cut to ``max_seq_len``, those shorter than ``min_length`` dropped, then shuffled
    by ``seed`` and split; ``corpora`` describes each directory (resuming over other data is refused).
    """
    dirs = [features_dirs] if isinstance(features_dirs, (str, os.PathLike)) else list(features_dirs)
    sequences, corpora = [], []
    for features_dir in dirs:
        manifest, found = load_shards(features_dir)
        if manifest["target_fingerprint"] != fingerprint:
            raise ValueError(f"features in {features_dir} come from another target ({manifest['target']}, fingerprint {manifest['target_fingerprint']}); this target is {fingerprint}")
        sequences += found
        corpora.append({"corpus": manifest.get("corpus"), "sequences": len(found), "tokens": sum(len(tokens) for tokens, _ in found)})
    sequences = [(tokens[:max_seq_len], features[:max_seq_len]) for tokens, features in sequences if len(tokens) >= min_length]
    random.Random(seed).shuffle(sequences)
    num_validation = max(1, int(len(sequences) * validation_fraction)) if validation_fraction > 0 and len(sequences) > 1 else 0
    return sequences[num_validation:], sequences[:num_validation], corpora


@torch.no_grad()
def evaluate(objective: _Objective, sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Mean losses and top-1 agreement with the target on held-out sequences (no noise)."""
    if not sequences:
        return {}
    totals: Counter[str] = Counter()
    positions: Counter[str] = Counter()  # per metric: a sequence too short for a step has no value for it
    for tokens, features in sequences:
        _, values = objective(tokens, features, None)
        for key, value in values.items():
            totals[key] += value * (len(tokens) - 1)
            positions[key] += len(tokens) - 1
    return {key: value / positions[key] for key, value in totals.items()}


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def epoch_order(count: int, seed: int):  # noqa: ANN202 - epoch -> permutation
    cache: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in cache:
            permutation = list(range(count))
            random.Random(seed * 1_000_003 + epoch).shuffle(permutation)
            cache.clear()
            cache[epoch] = permutation
        return cache[epoch]

    return order


def lm_head_rows(model, draft_vocab: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001 - a causal LM
    """The frozen LM head's rows a head trains against # [draft_vocab or vocab, hidden] float32.

    draft_vocab: # [draft_vocab] token ids, or None for the whole vocabulary.
    """
    lm_weight = model.get_output_embeddings().weight.detach()
    return (lm_weight[draft_vocab] if draft_vocab is not None else lm_weight).float()


def start_run(head, settings, total_steps: int, out_path: Path, fingerprint: str, corpora):  # noqa: ANN001, ANN201
    """AdamW with warm-up + cosine decay and the run's generator, resumed from ``out_path``'s checkpoint if any.

    Returns (optimizer, schedule, generator, checkpoint path, step, position); ``settings`` needs
    lr, weight_decay, warmup_steps and seed.
    """
    # fused: one kernel over all parameters, ~4x faster a step on CPU than the per-tensor loop
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings.warmup_steps, total_steps))
    generator = torch.Generator().manual_seed(settings.seed)
    checkpoint_path = out_path.with_name(out_path.name + ".checkpoint.pt")
    step, position = resume_checkpoint(checkpoint_path, head, optimizer, schedule, generator, settings, fingerprint, corpora)
    return optimizer, schedule, generator, checkpoint_path, step, position


def resume_checkpoint(path: Path, head, optimizer, schedule, generator, settings, fingerprint, corpora) -> tuple[int, int]:  # noqa: ANN001
    """Load a run's checkpoint into head/optimizer/schedule/generator; (step, position), (0, 0) if none."""
    if not path.exists():
        return 0, 0
    state = torch.load(path, weights_only=False)
    if state["settings"] != asdict(settings) or state["fingerprint"] != fingerprint:
        raise ValueError(f"{path} is from a run with other settings or another target: delete it or choose another --out")
    # Resuming over other data would continue at a position that means something else.
    if state.get("corpora") != corpora:
        raise ValueError(f"{path} was trained on other features ({state.get('corpora')}), these are {corpora}: delete it or choose another --out")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    generator.set_state(state["generator"])
    return state["step"], state["position"]


def save_checkpoint(path: Path, head, optimizer, schedule, generator, step, position, settings, fingerprint, corpora) -> None:  # noqa: ANN001
    state = {
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "generator": generator.get_state(),
        "step": step,
        "position": position,
        "settings": asdict(settings),
        "fingerprint": fingerprint,
        "corpora": corpora,
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)
