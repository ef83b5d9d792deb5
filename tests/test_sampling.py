"""SamplingParams validation and the logits -> probs transform (temperature -> top-k -> top-p)."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from verispec import SamplingParams, logits_to_probs


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_params_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        SamplingParams(**kwargs)


def test_greedy_is_one_hot_argmax():
    logits = torch.randn(3, 5, 50)
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, 5))
    assert int((probs > 0).sum()) == 15


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.99),
    ],
)
def test_matches_transformers_warpers_in_the_same_order(params):
    """Same transform, same order as transformers' temperature -> top-k -> top-p warpers."""
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 3
    expected = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        expected = TopKLogitsWarper(params.top_k)(None, expected)
    if params.top_p < 1:
        expected = TopPLogitsWarper(params.top_p)(None, expected)
    expected = torch.softmax(expected, -1)
    torch.testing.assert_close(logits_to_probs(logits, params), expected, atol=1e-6, rtol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81)) > 0
    assert kept.tolist() == [[True, True, True, False]]


def test_seeded_generator_repeats():
    params = SamplingParams(temperature=1.0, seed=123)
    assert torch.equal(torch.rand(5, generator=params.make_generator()), torch.rand(5, generator=params.make_generator()))
