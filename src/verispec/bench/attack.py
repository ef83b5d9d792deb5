"""Rejection attacks: a short prompt suffix that makes the drafter disagree with the target.

Speculative decoding accepts a draft token with probability min(1, p_target / q_draft), so the
expected acceptance at a position is

    accept(position) = sum_x min(p_target(x), q_draft(x)) = 1 - TV(p_target, q_draft).

The attack searches a suffix s (``suffix_tokens`` tokens placed after the prompt - by the caller's
``attacked_ids``, e.g. at the end of the user's message, where planted content sits) minimising the
mean of accept() over the target's own greedy continuation of the attacked prompt (teacher-forced: one
target pass and one draft pass score a candidate), optionally plus ``quality_weight`` × the
target's mean negative log-likelihood of the clean continuation after the attacked prompt — a
penalty keeping the answer what it was (stealth) at the cost of attack strength. The search is
random coordinate descent: each step tries ``candidates`` single-token swaps and keeps the best
if it improves. Output stays exact whatever the suffix: only speed is attacked.

The drafter searched against (the surrogate) is a draft model or an EAGLE head. The EAGLE head's
q_draft at each position is its first draft of a round there: teacher-forced on the target's own
features of the attacked sequence (the features the engine would hand it), so a suffix can be
searched on EAGLE and carried to the draft model or n-gram drafting (transfer the other way).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from verispec.engine.cached_lm import CachedLM
from verispec.engine.decoder import SpeculativeDecoder
from verispec.modelref import unwrap_model


@dataclass(frozen=True)
class AttackSettings:
    suffix_tokens: int = 12
    steps: int = 40
    candidates: int = 4  # single-token swaps tried per step
    continuation_tokens: int = 24  # the target's continuation the acceptance is measured on
    quality_weight: float = 0.0  # 0: strongest attack; > 0 also keeps the clean answer likely
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("suffix_tokens", "steps", "candidates", "continuation_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.quality_weight < 0:
            raise ValueError(f"quality_weight must be >= 0, got {self.quality_weight!r}")


@dataclass
class AttackResult:
    suffix: list[int]
    score: float  # the minimised objective
    expected_acceptance: float  # mean 1 - TV over the continuation after prompt + suffix
    initial_expected_acceptance: float  # the same for the random suffix the search started from
    history: list[float]  # best score after each step


def _draft_distributions(draft) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:  # noqa: ANN001
    """q_draft(input_ids # [1, n], target features # [n, hidden], start) -> # [n - start, vocab]: the
    draft's distribution of each of ids[start:], for a causal LM (or LoadedModel) or an EagleDrafter."""
    from verispec.drafters.draft_vocab import full_vocab_probs
    from verispec.drafters.eagle import EagleDrafter

    if isinstance(draft, EagleDrafter):
        if draft.far_memory is not None and draft.far_memory.mode != "full":
            raise ValueError("an EAGLE surrogate attends as trained: far_memory must be None or mode 'full'")

        def eagle(input_ids: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
            if start < 2:
                raise ValueError(f"start must be >= 2 for an EAGLE surrogate (its first draft needs a feature), got {start}")
            # Head row j reads (f_j, x_{j+1}) and predicts f_{j+1}, whose LM-head readout drafts x_{j+2}.
            embeds = draft.embed(input_ids[:, 1:]).float()  # [1, n-1, hidden]
            predicted = draft.head(features[None, :-1].float(), embeds)[0]  # [n-1, hidden]
            probs = draft.draft_logits(predicted[start - 2 : -1]).softmax(-1)  # [n-start, draft_vocab]
            return full_vocab_probs(probs, draft.vocab_ids, draft.vocab_size)

        return eagle
    draft_model, _ = unwrap_model(draft, argument="draft")

    def model(input_ids: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
        return torch.softmax(draft_model(input_ids).logits[0, start - 1 : -1].float(), -1)

    return model


def _target_pass(target, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001 - a causal LM
    """One target pass: (log p_target of each of ids[start:] # [n - start, vocab], top-layer features # [n, hidden])."""
    # The engine's own pass (same logits, same features); LM-head rows only where they are read.
    out = CachedLM(target).extend(ids, num_logits=len(ids) - start + 1)
    return out.logits[:-1].log_softmax(-1), out.features


@torch.inference_mode()
def expected_acceptance(target, draft, ids: list[int], start: int) -> float:  # noqa: ANN001 - causal LMs / EagleDrafter
    """Mean of sum_x min(p_target(x), q_draft(x)) over the positions predicting ids[start:].

    ``draft``: the draft model (a causal LM) or an :class:`~verispec.drafters.eagle.EagleDrafter`.
    """
    if not 1 <= start < len(ids):
        raise ValueError(f"start must be in [1, {len(ids) - 1}], got {start}")
    return _acceptance(unwrap_model(target, argument="target")[0], _draft_distributions(draft), ids, start)


@torch.inference_mode()
def _acceptance(target, q_draft, ids: list[int], start: int) -> float:  # noqa: ANN001
    log_p_target, features = _target_pass(target, ids, start)
    p_target = log_p_target.exp()  # [n - start, vocab]
    q = q_draft(torch.tensor([ids]), features, start)  # [n - start, vocab_draft]
    vocab = min(p_target.shape[-1], q.shape[-1])
    return float(torch.minimum(p_target[:, :vocab], q[:, :vocab]).sum(-1).mean())


@torch.inference_mode()
def _mean_nll(target, ids: list[int], start: int) -> float:  # noqa: ANN001
    log_p_target, _ = _target_pass(target, ids, start)
    return float(torch.nn.functional.nll_loss(log_p_target, torch.tensor(ids[start:])))


def search_suffix(
    target,  # noqa: ANN001 - a causal LM (or LoadedModel)
    draft,  # noqa: ANN001 - the draft model (causal LM / LoadedModel) or an EagleDrafter
    attacked_ids: Callable[[list[int]], list[int]],  # suffix token ids -> the full attacked prompt's ids
    settings: AttackSettings,
    allowed_tokens: list[int],
    *,
    progress: bool = False,
) -> AttackResult:
    """Search a suffix minimising the draft's expected acceptance; ``attacked_ids([])`` is the clean prompt."""
    if not allowed_tokens:
        raise ValueError("allowed_tokens must not be empty")
    if not attacked_ids([]):
        raise ValueError("attacked_ids([]) (the clean prompt) must not be empty")
    target_model, _ = unwrap_model(target, argument="target")
    q_draft = _draft_distributions(draft)
    plain = SpeculativeDecoder(target_model)
    clean_answer = plain.generate(attacked_ids([]), settings.continuation_tokens, stop=[]).token_ids
    rng = random.Random(settings.seed)

    def evaluate(suffix: list[int]) -> tuple[float, float]:
        attacked = attacked_ids(suffix)
        answer = plain.generate(attacked, settings.continuation_tokens, stop=[]).token_ids
        acceptance = _acceptance(target_model, q_draft, attacked + answer, len(attacked))
        score = acceptance
        if settings.quality_weight > 0:
            score += settings.quality_weight * _mean_nll(target_model, attacked + clean_answer, len(attacked))
        return score, acceptance

    suffix = [rng.choice(allowed_tokens) for _ in range(settings.suffix_tokens)]
    best_score, best_acceptance = evaluate(suffix)
    initial = best_acceptance
    history = []
    for _ in tqdm(range(settings.steps), desc="attack search", unit="step", disable=not progress):
        for _ in range(settings.candidates):
            candidate = list(suffix)
            candidate[rng.randrange(len(candidate))] = rng.choice(allowed_tokens)
            score, acceptance = evaluate(candidate)
            if score < best_score:
                suffix, best_score, best_acceptance = candidate, score, acceptance
        history.append(best_score)
    return AttackResult(suffix, best_score, best_acceptance, initial, history)
