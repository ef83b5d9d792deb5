"""Batched serving on the lean forward: per-request caches, one fused kernel call per pass."""

from __future__ import annotations

import pytest
import torch
from marks import needs_bf16, needs_kernels
from scheduling import serve_all
from tiny_models import noisy_copy, tiny_target

from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.drafters.base import DraftContext, propose_batch
from verispec.drafters.combined import lookup_then_model
from verispec.engine.lean_lm import _groups, target_lm
from verispec.models.panel_linear import use_panel_kernels
from verispec.serving import BatchedTarget, BatchGammaPolicy, LeanBatchedTarget, Scheduler, SchedulerConfig
from verispec.serving.scheduler import batched_target

pytestmark = needs_kernels


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    # On the panel kernels (AVX-512 or AVX2) a row's products and attention are the same operations
    # whatever rows run beside it, so batching is bit for bit.
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def panel_target():
    return use_panel_kernels(tiny_target())


# Per round, per sequence: (fed tokens, how many of them the sequence keeps).
PROMPTS = {"a": list(range(3, 20)), "b": [7, 8], "c": list(range(40, 71))}
ROUNDS = [
    {"a": ([5, 6, 7], 2), "b": ([9], 1)},
    {"a": ([8, 9, 10, 11, 12], 5), "b": ([10, 11, 12], 1), "c": ([30, 31], 2)},  # c joins
    {"b": ([13, 14], 2), "c": ([32, 33, 34, 35, 36, 37, 38], 3)},  # a leaves
    {"b": ([15], 1), "c": ([39], 1)},
]


def _alone(model, name):
    """The engine's target running sequence ``name``'s rounds by itself: logits and features per round."""
    lm = target_lm(model)
    lm.extend(PROMPTS[name][:-1], num_logits=0)
    out = []
    for fed in ROUNDS:
        if name in fed:
            ids, kept = fed[name]
            step = lm.extend(ids, num_logits=len(ids))
            out.append((step.logits, step.features))
            lm.crop(len(lm) - len(ids) + kept)
    return out


def _batched(target, model):
    """The same rounds through ``target`` (a LeanBatchedTarget or BatchedTarget), rows joining and leaving."""
    order, out = [], {name: [] for name in PROMPTS}
    for fed in ROUNDS:
        for name in fed:
            if name not in order:
                target.add(PROMPTS[name])  # prefills prompt[:-1], as _alone does
                order.append(name)
        leaving = [name for name in order if name not in fed]
        if leaving:
            target.remove([index for index, name in enumerate(order) if name in fed])
            order = [name for name in order if name in fed]
        steps = target.extend([fed[name][0] for name in order], [len(fed[name][0]) for name in order])
        for name, step in zip(order, steps):
            out[name].append((step.logits, step.features))
        target.commit([fed[name][1] for name in order])
    return out


def test_rows_sharing_passes_compute_exactly_what_they_compute_alone(panel_target):
    batched = _batched(LeanBatchedTarget(panel_target), panel_target)
    masked = _batched(BatchedTarget(panel_target), panel_target)  # transformers' forward: equal up to rounding
    for name in PROMPTS:
        alone = _alone(panel_target, name)
        assert len(alone) == len(batched[name]) == len(masked[name])
        for (want_logits, want_features), (logits, features), (_, masked_features) in zip(alone, batched[name], masked[name]):
            _same(features, want_features)
            _same(logits, want_logits)
            torch.testing.assert_close(masked_features, want_features, atol=1e-4, rtol=1e-4)


@needs_bf16
def test_a_bfloat16_target_batches_on_the_lean_forward_bit_for_bit():
    # --target-dtype bfloat16 in serve: the same fused stack on bfloat16 panels, every row as alone.
    target = use_panel_kernels(tiny_target().bfloat16())
    batched = _batched(LeanBatchedTarget(target), target)
    for name in PROMPTS:
        for (want_logits, want_features), (logits, features) in zip(_alone(target, name), batched[name]):
            assert torch.equal(features, want_features) and torch.equal(logits, want_logits)


def test_more_rows_than_one_kernel_call_takes_run_in_several_calls(panel_target, monkeypatch):
    target = LeanBatchedTarget(panel_target)
    monkeypatch.setattr(target.decoder.fused, "max_rows", 4)  # round 2 feeds 5 + 3 + 2 rows: three calls
    calls = []
    real = target.decoder.fused.__class__.__call__
    monkeypatch.setattr(target.decoder.fused.__class__, "__call__", lambda self, *args: calls.append(args[2]) or real(self, *args))
    batched = _batched(target, panel_target)
    assert [3, 1] in calls and all(sum(rows) <= 4 for rows in calls)  # (5 and 7 rows: the op-by-op forward, as alone)
    for name in PROMPTS:
        for (want_logits, want_features), (logits, features) in zip(_alone(panel_target, name), batched[name]):
            _same(features, want_features)
            _same(logits, want_logits)
    assert _groups([5, 3, 2, 1], 4) == [(0, 1), (1, 2), (2, 4)] and _groups([], 4) == []


def test_commit_rolls_every_row_back_to_its_kept_tokens_and_checks_its_arguments(panel_target):
    target = LeanBatchedTarget(panel_target)
    target.add([3, 4, 5, 6])
    target.add([7, 8])
    target.extend([[6, 1, 2, 3], [8]], [4, 1])
    with pytest.raises(RuntimeError, match="not been committed"):
        target.add([1, 2])
    with pytest.raises(ValueError, match="kept must give each row"):
        target.commit([5, 1])
    target.commit([2, 1])
    assert target.next_positions == [3 + 2, 1 + 1]
    with pytest.raises(ValueError, match="one entry per row"):
        target.extend([[1]], [1])
    with pytest.raises(RuntimeError, match="without a pending extend"):
        target.commit([1, 1])


def test_the_scheduler_serves_a_panel_target_through_lean_batching_and_matches_the_engine(panel_target):
    assert isinstance(batched_target(panel_target, SchedulerConfig()), LeanBatchedTarget)
    assert isinstance(batched_target(panel_target, SchedulerConfig(lean_batching=False)), BatchedTarget)
    assert isinstance(batched_target(tiny_target(), SchedulerConfig()), BatchedTarget)  # transformers' linears: masked
    with pytest.raises(ValueError, match="lean batched serving cannot run this model"):
        LeanBatchedTarget(tiny_target())
    drafter = DraftModel(noisy_copy(tiny_target(), noise=0.05))
    prompts = [list(range(3, 12)), [5, 6], list(range(20, 45)), [9, 9, 9, 9]]
    engine = SpeculativeDecoder(panel_target, drafter, gamma=3)
    expected = [engine.generate(prompt, max_new_tokens=20, stop=[]).token_ids for prompt in prompts]
    # Drafting at every batch size, so rows of different lengths share every pass.
    config = SchedulerConfig(gamma=3, gamma_policy=BatchGammaPolicy(full_until=8, off_from=40))
    scheduler = Scheduler(panel_target, drafter, None, config)
    assert isinstance(scheduler.target, LeanBatchedTarget)
    joint = []  # the draft's passes over several requests at once (the requests draft together)
    forward_many = drafter.lean_decoder.forward_many
    drafter.lean_decoder.forward_many = lambda ids, caches, **options: joint.append(len(ids)) or forward_many(ids, caches, **options)
    try:
        got = [tokens for tokens, _ in serve_all(scheduler, prompts, 20)]
    finally:
        scheduler.stop()
        del drafter.lean_decoder.forward_many
    assert got == expected
    assert joint and max(joint) > 1


def _sessions(drafter, prompts, sampling):
    sessions = [drafter.start(prompt, sampling) for prompt in prompts]
    return sessions, [DraftContext(list(prompt)) for prompt in prompts]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_draft_sessions_drafting_together_propose_what_each_proposes_alone(sampling):
    model = noisy_copy(tiny_target(), noise=0.3)
    prompts = [list(range(3, 12)), [5, 6], list(range(20, 45)), [9, 9, 9, 9]]
    budgets = [4, 1, 6, 3]
    alone_drafter, together_drafter = DraftModel(model, path_confidence=0.2), DraftModel(model, path_confidence=0.2)
    assert together_drafter.lean_decoder.fused is not None
    sessions, contexts = _sessions(alone_drafter, prompts, sampling)
    alone = [s.propose(c, b, torch.Generator().manual_seed(i)) for i, (s, c, b) in enumerate(zip(sessions, contexts, budgets))]
    sessions, contexts = _sessions(together_drafter, prompts, sampling)
    passes = []
    forward_many = together_drafter.lean_decoder.forward_many
    together_drafter.lean_decoder.forward_many = lambda ids, caches, **options: passes.append(len(ids)) or forward_many(ids, caches, **options)
    together = propose_batch(sessions, contexts, budgets, [torch.Generator().manual_seed(i) for i in range(4)])
    for one, joint in zip(alone, together):
        assert one.tokens == joint.tokens and one.num_forward_passes == joint.num_forward_passes
        if sampling.is_greedy:
            assert joint.probs is None
        else:
            _same(joint.probs, one.probs)
    assert passes[0] == 4 and len(passes) == max(len(p.tokens) for p in together)  # one pass a step for all still drafting
    assert any(len(p.tokens) < b for p, b in zip(together, budgets)) or not sampling.is_greedy  # (the path stop ended some early)
    # A round later: each session rolls back its rejected drafts and catches up on its own committed
    # tokens, drafting what a fresh session given the same text drafts (a session asked for none: nothing).
    contexts = [DraftContext(list(prompt) + p.tokens[:1] + [2]) for prompt, p in zip(prompts, together)]
    again = propose_batch(sessions, contexts, [2, 2, 0, 2], [torch.Generator().manual_seed(9) for _ in range(4)])
    fresh, _ = _sessions(alone_drafter, prompts, sampling)
    want = [s.propose(c, 2, torch.Generator().manual_seed(9)).tokens if i != 2 else [] for i, (s, c) in enumerate(zip(fresh, contexts))]
    assert [p.tokens for p in again] == want


def test_lookup_first_then_the_draft_models_together():
    model = noisy_copy(tiny_target(), noise=0.3)
    drafter = lookup_then_model(DraftModel(model))
    prompts = [[5, 6, 7, 8, 5, 6], [3, 4, 10, 11], [1, 2, 3, 9]]  # the first repeats "5 6": lookup drafts 7 8 ...
    sessions, contexts = _sessions(drafter, prompts, SamplingParams())
    passes = []
    decoder = drafter.fallback.lean_decoder
    forward_many = decoder.forward_many
    decoder.forward_many = lambda ids, caches, **options: passes.append(len(ids)) or forward_many(ids, caches, **options)
    together = propose_batch(sessions, contexts, [3, 3, 3], [torch.Generator()] * 3)
    alone_sessions, _ = _sessions(lookup_then_model(DraftModel(model)), prompts, SamplingParams())
    alone = [s.propose(c, 3, torch.Generator()) for s, c in zip(alone_sessions, contexts)]
    assert [p.tokens for p in together] == [p.tokens for p in alone]
    assert together[0].tokens[:2] == [7, 8] and together[0].num_forward_passes == 0  # lookup: no model pass
    assert passes and passes[0] == 2  # the two others drafted with the model, together
