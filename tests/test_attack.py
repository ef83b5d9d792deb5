"""The rejection-attack search on tiny models: it finds suffixes the drafter handles worse than random ones."""

import random

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.bench.attack import AttackSettings, expected_acceptance, search_suffix
from verispec.drafters.base import DraftContext
from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from verispec.engine.cached_lm import CachedLM


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, noisy_copy(target, noise=1.0)  # a drafter that agrees ~55% of the time: room to attack


def test_expected_acceptance_is_one_minus_total_variation(pair):
    target, draft = pair
    ids = [3, 17, 5, 9, 3, 17, 22, 40]
    assert expected_acceptance(target, target, ids, 2) == pytest.approx(1.0)
    value = expected_acceptance(target, draft, ids, 2)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([ids])).logits[0, 1:-1], -1)
        q = torch.softmax(draft(torch.tensor([ids])).logits[0, 1:-1], -1)
    assert value == pytest.approx(1 - 0.5 * (p - q).abs().sum(-1).mean().item(), abs=1e-5)
    with pytest.raises(ValueError, match="start"):
        expected_acceptance(target, draft, ids, 0)


def test_search_lowers_acceptance_below_random_suffixes_and_speculation_feels_it(pair):
    target, draft = pair
    prompt = [3, 17, 5, 9]
    settings = AttackSettings(suffix_tokens=6, steps=30, candidates=4, continuation_tokens=12, seed=1)
    allowed = list(range(1, 96))  # the tiny vocabulary
    result = search_suffix(target, draft, lambda suffix: prompt + suffix, settings, allowed)
    assert result.history == sorted(result.history, reverse=True)  # never worse than before
    rng = random.Random(7)
    random_suffixes = [[rng.choice(allowed) for _ in range(6)] for _ in range(6)]
    plain = SpeculativeDecoder(target)

    def acceptance(suffix):
        attacked = prompt + suffix
        answer = plain.generate(attacked, 12, stop=[]).token_ids
        return expected_acceptance(target, draft, attacked + answer, len(attacked))

    random_values = [acceptance(s) for s in random_suffixes]
    assert result.expected_acceptance == pytest.approx(acceptance(result.suffix))
    # Measured with these seeds: 0.51 found vs 0.57 mean (0.565 best) over the random suffixes.
    assert result.expected_acceptance < min(random_values)
    assert result.expected_acceptance < sum(random_values) / len(random_values) - 0.03
    # The speculative decoder's output stays the target's under attack; only its speed suffers.
    decoder = SpeculativeDecoder(target, DraftModel(draft), gamma=4)
    attacked = prompt + result.suffix
    assert decoder.generate(attacked, 12, stop=[]).token_ids == plain.generate(attacked, 12, stop=[]).token_ids


def eagle_drafter(target, draft_vocab=None):
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target.config, 24)).eval().requires_grad_(False)
    return EagleDrafter(target, head, draft_vocab)


@pytest.mark.parametrize("draft_vocab", [None, torch.arange(0, 96, 2)])
def test_eagle_surrogate_scores_the_first_draft_the_live_head_would_make(pair, draft_vocab):
    """An EAGLE surrogate's q_draft at each position is the live session's first-draft distribution there."""
    target, _ = pair
    drafter = eagle_drafter(target, draft_vocab)
    ids, start = [3, 17, 5, 9, 3, 17, 22, 40, 8, 61], 4
    features = CachedLM(target).extend(ids, num_logits=0).features  # [n, hidden]
    with torch.no_grad():
        p_target = torch.softmax(target(torch.tensor([ids])).logits[0, start - 1 : -1], -1)  # [n - start, vocab]
    expected = []
    for position in range(start, len(ids)):  # drafting ids[position] after ids[:position] was committed
        session = drafter.start(ids[:position], SamplingParams(temperature=1.0))
        proposal = session.propose(DraftContext(ids[:position], features[: position - 1], 0), 1, torch.Generator().manual_seed(0))
        expected.append(torch.minimum(p_target[position - start], proposal.probs[0]).sum())
    assert expected_acceptance(target, drafter, ids, start) == pytest.approx(float(torch.stack(expected).mean()), abs=1e-5)
    with pytest.raises(ValueError, match="start"):
        expected_acceptance(target, drafter, ids, 1)


def test_search_on_the_eagle_head_lowers_its_acceptance_below_random_suffixes(pair):
    target, _ = pair
    drafter = eagle_drafter(target)
    prompt = [3, 17, 5, 9]
    settings = AttackSettings(suffix_tokens=6, steps=20, candidates=4, continuation_tokens=12, seed=1)
    allowed = list(range(1, 96))
    result = search_suffix(target, drafter, lambda suffix: prompt + suffix, settings, allowed)
    plain = SpeculativeDecoder(target)

    def acceptance(suffix):
        attacked = prompt + suffix
        answer = plain.generate(attacked, 12, stop=[]).token_ids
        return expected_acceptance(target, drafter, attacked + answer, len(attacked))

    rng = random.Random(7)
    random_values = [acceptance([rng.choice(allowed) for _ in range(6)]) for _ in range(6)]
    assert result.expected_acceptance == pytest.approx(acceptance(result.suffix))
    assert result.expected_acceptance < min(random_values)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="suffix_tokens"):
        AttackSettings(suffix_tokens=0)
    with pytest.raises(ValueError, match="quality_weight"):
        AttackSettings(quality_weight=-1)


def test_stressed_prompts_cover_every_prompt_and_stressor_in_order():
    from verispec.bench.prompts import Prompt
    from verispec.bench.stressors import FORMAT_SWITCH, LANGUAGE_SWITCH, STRESSORS, parse_stressors, stressed_prompts

    prompts = [Prompt("a", "code", "def f():"), Prompt("b", "code", "def g():")]
    stressed = stressed_prompts(prompts, list(STRESSORS), random_suffix="qq zz", attack_suffix="xx yy")
    assert [(p.id, p.category) for p in stressed] == [(f"{p.id} [{s}]", s) for p in prompts for s in STRESSORS]
    texts = {p.category: p.text for p in stressed[:5]}
    assert texts == {"clean": "def f():", "random": "def f():\nqq zz", "language": f"def f():\n{LANGUAGE_SWITCH}",
                     "format": f"def f():\n{FORMAT_SWITCH}", "attack": "def f():\nxx yy"}  # fmt: skip
    assert parse_stressors("attack, clean,attack") == ["attack", "clean"]
    with pytest.raises(ValueError, match="--stressors"):
        parse_stressors("clean,loud")


def test_the_attack_benchmarks_with_its_decoding_and_kernel_options():
    from pathlib import Path

    from verispec.attack_cli import _bench_argv
    from verispec.cli import _build_parser

    args = _build_parser().parse_args(["attack", "--target-dtype", "bfloat16", "--target-kernels", "dense", "--threads", "2"])
    argv = _bench_argv(args, Path("stressed.jsonl"), Path("out"))
    assert argv[:5] == ["bench", "--prompts", "stressed.jsonl", "--out", "out"]
    for option, value in (("--target-dtype", "bfloat16"), ("--target-kernels", "dense"), ("--threads", "2")):
        assert argv[argv.index(option) + 1] == value
    assert _build_parser().parse_args(argv).target_dtype == "bfloat16"  # a valid bench command
