"""``verispec parallel train``: fit a parallel head to the EAGLE pipeline's feature shards.

For a sequence with target features f_0..f_{n-1} and tokens x_0..x_{n-1}, the head encodes the
context rows (f_i, x_{i+1}) causally once; then, for several cut points t, a block of K slots
at positions t+1..t+K sees the context up to t and drafts x_{t+2}..x_{t+1+K}. Per slot j:

    loss_j = CE( softmax(W f_{t+1+j}), log_softmax(W ĥ_j) )  +  feature_weight · SmoothL1(ĥ_j, f_{t+1+j})

with W the target's frozen LM head over the draft vocabulary: the classification term distils
the target's own distribution of x_{t+2+j} given the true prefix (what verification accepts
against). Every block also scores its anchor, the last visible context row's output h_t, with
EAGLE's own objective (the same two terms against f_{t+1}, weight ``anchor_weight``): every slot
starts from the anchor, and without this term the block loss pulls the shared layer away from
EAGLE's next-feature solution (measured: slot 0's held-out top-1 fell from the EAGLE head's 0.47
to 0.26 after 190 steps). Each slot is given as its true token with probability ``known_fraction`` (then it
is not scored), so the known-token input of contextual correction is in-distribution.
AdamW, linear warm-up then cosine decay; every ``checkpoint_every`` steps a resumable checkpoint
AND a usable head file are written, so a run stopped at any time leaves a head behind.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from verispec.drafters.eagle.checkpoint import load_head, target_fingerprint
from verispec.drafters.eagle.train import epoch_order, lm_head_rows, load_sequences, most_frequent_tokens, save_checkpoint, start_run
from verispec.drafters.parallel.checkpoint import save_parallel_head
from verispec.drafters.parallel.head import ParallelConfig, ParallelHead


@dataclass(frozen=True)
class ParallelTrainSettings:
    epochs: float = 2.0
    lr: float = 5e-4
    warmup_steps: int = 20
    sequences_per_step: int = 4
    cuts_per_sequence: int = 32  # block cut points t drawn per sequence (the context is encoded once for all)
    block_size: int = 4  # K: drafted positions per pass
    num_layers: int = 1
    intermediate_size: int = 4096
    known_fraction: float = 0.25  # probability a slot is given as its true token
    feature_weight: float = 0.1
    anchor_weight: float = 1.0  # EAGLE's next-feature loss on each block's anchor row; 0 = off
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    max_seq_len: int = 1024
    draft_vocab: int = 32768  # most frequent corpus tokens when no EAGLE head brings its vocabulary; 0 = full
    init_from_eagle: bool = False  # start fc + layer 0 + norm from the EAGLE head's weights
    validation_fraction: float = 0.05
    checkpoint_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "lr", "sequences_per_step", "cuts_per_sequence", "block_size", "intermediate_size", "max_seq_len", "checkpoint_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "feature_weight", "anchor_weight", "weight_decay", "grad_clip", "draft_vocab"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.known_fraction < 1.0:
            raise ValueError(f"known_fraction must be in [0, 1), got {self.known_fraction!r}")
        if not 0.0 <= self.validation_fraction < 0.5:
            raise ValueError(f"validation_fraction must be in [0, 0.5), got {self.validation_fraction!r}")
        if self.num_layers not in (1, 2):
            raise ValueError(f"num_layers must be 1 or 2, got {self.num_layers!r}")


class BlockObjective:
    """Loss of the head's blocks on one sequence, against the frozen target embedding and LM-head rows."""

    def __init__(self, head: ParallelHead, embed: torch.nn.Module, head_rows: torch.Tensor, settings: ParallelTrainSettings) -> None:
        self.head, self.embed, self.head_rows, self.settings = head, embed, head_rows, settings

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, dict]:
        """(mean loss over scored slots, metrics); ``generator`` None: evaluation (evenly spaced cuts, no known slots).

        tokens: # [n] int64; features: # [n, hidden] (bfloat16 on disk)
        """
        block, settings = self.head.config.block_size, self.settings
        features = features.float()
        num_context = len(tokens) - 1  # context rows (f_i, x_{i+1}), i = 0..n-2
        last_cut = len(tokens) - 2 - block  # the block's known tokens x_{t+2+j} must exist
        with torch.no_grad():
            embeds = self.embed(tokens).float()  # [n, hidden]
        context, outputs = self.head.encode_context(features[None, :num_context], embeds[None, 1:])
        if generator is not None:
            cuts = torch.randperm(last_cut + 1, generator=generator)[: settings.cuts_per_sequence].sort().values
            known = torch.rand(len(cuts), block, generator=generator) < settings.known_fraction
        else:
            cuts = torch.linspace(0, last_cut, min(settings.cuts_per_sequence, last_cut + 1)).round().long().unique()
            known = torch.zeros(len(cuts), block, dtype=torch.bool)
        slots = cuts[:, None] + 1 + torch.arange(block)  # [S, K]: index of f_{t+1+j}, whose token is x_{t+2+j}
        visible = torch.arange(num_context)[None] <= cuts[:, None]  # [S, n-1]
        hidden = self.head.draft_block(context, outputs[0, cuts], cuts + 1, embeds[slots + 1], known, visible)  # [S, K, hidden]
        with torch.no_grad():
            target_logits = F.linear(features[slots], self.head_rows)  # [S, K, draft_vocab]
            target_probs = target_logits.softmax(-1)
            target_entropy = -(target_probs * target_logits.log_softmax(-1)).sum(-1)  # [S, K]: the CE's floor
        draft_log_probs = F.linear(hidden, self.head_rows).log_softmax(-1)
        classification = -(target_probs * draft_log_probs).sum(-1)  # [S, K]
        regression = F.smooth_l1_loss(hidden, features[slots], reduction="none").mean(-1)  # [S, K]
        scored = (~known).float()
        loss = ((classification + settings.feature_weight * regression) * scored).sum() / scored.sum().clamp(min=1.0)
        # The anchor h_t, normed, is the head's EAGLE-style guess of f_{t+1}: slot 0's target too.
        anchor = self.head.norm(outputs[0, cuts])  # [S, hidden]
        anchor_log_probs = F.linear(anchor, self.head_rows).log_softmax(-1)  # [S, draft_vocab]: also for the metric
        if settings.anchor_weight > 0:
            anchor_classification = -(target_probs[:, 0] * anchor_log_probs).sum(-1)  # [S]
            anchor_regression = F.smooth_l1_loss(anchor, features[cuts + 1], reduction="none").mean(-1)  # [S]
            loss = loss + settings.anchor_weight * (anchor_classification + settings.feature_weight * anchor_regression).mean()
        agree = (draft_log_probs.argmax(-1) == target_logits.argmax(-1)).float() * scored  # [S, K]
        anchor_agree = (anchor_log_probs.argmax(-1) == target_logits[:, 0].argmax(-1)).float()  # [S]
        kl = (classification.detach() - target_entropy) * scored  # KL(p_target || q_draft) per scored slot
        return loss, {
            "loss": loss.item(),
            "classification": float((classification.detach() * scored).sum() / scored.sum().clamp(min=1.0)),
            "kl": float(kl.sum() / scored.sum().clamp(min=1.0)),
            "agree_by_slot": agree.sum(0).tolist(),
            "scored_by_slot": scored.sum(0).tolist(),
            "anchor_agree": float(anchor_agree.sum()),
            "anchors": len(cuts),
        }


def train_parallel_head(
    target,  # noqa: ANN001 - a LoadedModel or PreTrainedModel: its embeddings and LM head are used, frozen
    features_dirs: str | os.PathLike | list[str | os.PathLike],
    out_path: str | os.PathLike,
    settings: ParallelTrainSettings,
    *,
    eagle_head: str | os.PathLike | None = None,  # brings the draft vocabulary (and, if asked, initial weights)
    progress: bool = True,
) -> dict:
    """Train (or resume training) a parallel head on feature directories; write it to ``out_path``."""
    from verispec.modelref import unwrap_model

    model, _ = unwrap_model(target, argument="target")
    out_path = Path(out_path)
    fingerprint = target_fingerprint(model)
    training, validation, corpora = load_sequences(
        features_dirs, fingerprint, settings.max_seq_len, settings.validation_fraction, settings.seed, min_length=settings.block_size + 3
    )  # fmt: skip
    if not training:
        raise ValueError(f"no training sequence is longer than block_size + 2 = {settings.block_size + 2} tokens")

    torch.manual_seed(settings.seed)
    config = ParallelConfig.for_target(model.config, settings.intermediate_size, settings.block_size, settings.num_layers, first_from_anchor=settings.anchor_weight > 0)
    head = ParallelHead(config)
    eagle, draft_vocab = load_head(eagle_head, model) if eagle_head is not None else (None, None)
    if settings.init_from_eagle:
        if eagle is None:
            raise ValueError("init_from_eagle needs an EAGLE head (--eagle-head)")
        head.load_eagle(eagle)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if draft_vocab is None and 0 < settings.draft_vocab < vocab_size:
        draft_vocab = most_frequent_tokens(training, settings.draft_vocab, vocab_size)
    objective = BlockObjective(head, model.get_input_embeddings(), lm_head_rows(model, draft_vocab), settings)

    total_steps = max(1, math.ceil(settings.epochs * len(training) / settings.sequences_per_step))
    optimizer, schedule, generator, checkpoint_path, step, position = start_run(head, settings, total_steps, out_path, fingerprint, corpora)

    def save(result: dict) -> None:
        save_parallel_head(out_path, head, draft_vocab=draft_vocab, fingerprint=fingerprint, training={**asdict(settings), **result, "corpora": corpora})

    before = evaluate(objective, validation) if step == 0 else None  # the untrained head, for comparison
    order = epoch_order(len(training), settings.seed)
    bar = tqdm(total=total_steps, initial=step, unit="step", desc="train parallel", disable=not progress)
    head.train()
    metrics: dict = {}
    try:
        while step < total_steps:
            optimizer.zero_grad(set_to_none=True)
            batch_metrics = []
            for _ in range(settings.sequences_per_step):
                epoch, index = divmod(position, len(training))
                tokens, features = training[order(epoch)[index]]
                loss, values = objective(tokens, features, generator)
                (loss / settings.sequences_per_step).backward()
                batch_metrics.append(values)
                position += 1
            if settings.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            metrics = summarise(batch_metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=",".join(f"{a:.2f}" for a in metrics["top1_by_slot"]))
            bar.update(1)
            if step % settings.checkpoint_every == 0 or step == total_steps:
                save_checkpoint(checkpoint_path, head, optimizer, schedule, generator, step, position, settings, fingerprint, corpora)
                save({"steps": step, "train": metrics})  # usable even if the run is stopped here
    finally:
        bar.close()
    head.eval()
    result = {"steps": step, "train": metrics, "validation": evaluate(objective, validation), "training_sequences": len(training)}
    if before is not None:
        result["validation_before"] = before
    save(result)
    return result


@torch.no_grad()
def evaluate(objective: BlockObjective, sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Held-out loss and top-1 agreement with the target per block slot (no known slots)."""
    was_training = objective.head.training
    objective.head.eval()
    try:
        return summarise([objective(tokens, features, None)[1] for tokens, features in sequences]) if sequences else {}
    finally:
        objective.head.train(was_training)


def summarise(per_sequence: list[dict]) -> dict:
    """Mean loss over sequences; top-1 agreement per slot pooled over every scored slot."""
    agree = torch.tensor([m["agree_by_slot"] for m in per_sequence]).sum(0)
    scored = torch.tensor([m["scored_by_slot"] for m in per_sequence]).sum(0)
    return {
        "loss": sum(m["loss"] for m in per_sequence) / len(per_sequence),
        "classification": sum(m["classification"] for m in per_sequence) / len(per_sequence),
        "kl": sum(m["kl"] for m in per_sequence) / len(per_sequence),
        "top1_by_slot": (agree / scored.clamp(min=1.0)).tolist(),
        # The anchor's own readout (EAGLE's first draft from the same layer): what slot 0 builds on.
        "top1_anchor": sum(m["anchor_agree"] for m in per_sequence) / max(1, sum(m["anchors"] for m in per_sequence)),
        "blocks": int(scored.max()),
    }
