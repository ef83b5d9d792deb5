"""Prompt-lookup (n-gram) drafting: what it proposes, and exactness through the engine."""

import pytest
import torch

from tiny_models import tiny_target
from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import DraftContext, NgramDrafter


def _propose(tokens, max_tokens=4, **kwargs):
    session = NgramDrafter(**kwargs).start(tokens, SamplingParams())
    return session.propose(DraftContext(list(tokens)), max_tokens, torch.Generator()).tokens


def test_copies_what_followed_the_latest_longest_match():
    # suffix (7, 8) occurred twice; the latest earlier occurrence was followed by 1, 2.
    assert _propose([7, 8, 9, 9, 7, 8, 1, 2, 3, 7, 8]) == [1, 2, 3, 7]
    # a longer match wins over a more recent shorter one
    assert _propose([5, 7, 8, 4, 4, 0, 8, 6, 5, 7, 8], max_ngram=3) == [4, 4, 0, 8]


def test_no_match_proposes_nothing_and_respects_max_tokens():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([1, 2, 3, 1, 2], max_tokens=1) == [3]


def test_index_grows_incrementally_across_rounds():
    session = NgramDrafter().start([1, 2, 3], SamplingParams())
    assert session.propose(DraftContext([1, 2, 3]), 4, torch.Generator()).tokens == []
    assert session.propose(DraftContext([1, 2, 3, 9, 1, 2]), 4, torch.Generator()).tokens == [3, 9, 1, 2]


@pytest.mark.parametrize(("kwargs", "argument"), [({"min_ngram": 0}, "min_ngram"), ({"max_ngram": 1, "min_ngram": 2}, "max_ngram")])
def test_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        NgramDrafter(**kwargs)


def test_greedy_output_identical_and_sampling_valid():
    target = tiny_target()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = SpeculativeDecoder(target).generate(prompt, 40, stop=[])
    lookup = SpeculativeDecoder(target, NgramDrafter(), gamma=4).generate(prompt, 40, stop=[])
    assert lookup.token_ids == plain.token_ids
    assert lookup.stats.num_drafted > 0
    sampled = SpeculativeDecoder(target, NgramDrafter(), gamma=4).generate(prompt, 30, SamplingParams(temperature=1.0, seed=0), stop=[])
    assert len(sampled.token_ids) == 30 and all(1 <= n <= 5 for n in sampled.stats.emitted_per_round)
