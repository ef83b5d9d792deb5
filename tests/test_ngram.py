"""Prompt-lookup (n-gram) drafting: what it proposes, and exactness through the engine."""

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import DraftContext, NgramDrafter


def _propose(tokens, max_tokens=4, **kwargs):
    session = NgramDrafter(**kwargs).start(tokens, SamplingParams())
    return session.propose(DraftContext(list(tokens)), max_tokens, torch.Generator()).tokens


def test_copies_what_followed_the_latest_longest_match():
    # suffix (7, 8) occurred twice; the latest earlier occurrence was followed by 1, 2.
    assert _propose([7, 8, 9, 9, 7, 8, 1, 2, 3, 7, 8], match_drafts=()) == [1, 2, 3, 7]
    # a longer match wins over a more recent shorter one
    assert _propose([5, 7, 8, 4, 4, 0, 8, 6, 5, 7, 8], max_ngram=3, match_drafts=()) == [4, 4, 0, 8]
    # a single-token match when nothing longer matches
    assert _propose([4, 9, 1, 2, 3, 5, 6, 4], match_drafts=()) == [9, 1, 2, 3]
    assert _propose([4, 9, 1, 2, 3, 5, 6, 4], min_ngram=2) == []


def test_short_matches_propose_only_their_capped_number_of_drafts():
    history = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16]
    # default caps (2, 2, 4): the match length decides how far the copy goes
    assert _propose(history + [4], max_tokens=8) == [10, 11]  # 1-token match
    assert _propose(history + [3, 4], max_tokens=8) == [10, 11]  # 2-token match
    assert _propose(history + [2, 3, 4], max_tokens=8) == [10, 11, 12, 13]  # 3-token match
    assert _propose(history + [1, 2, 3, 4], max_tokens=8) == [10, 11, 12, 13, 14, 15, 16, 1]  # 4: uncapped
    assert _propose(history + [1, 2, 3, 4], max_tokens=3) == [10, 11, 12]  # the round's limit still holds
    assert _propose(history + [4], max_tokens=8, match_drafts=(5,)) == [10, 11, 12, 13, 14]
    assert _propose(history + [4], max_tokens=1) == [10]


def test_no_match_proposes_nothing_and_respects_max_tokens():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([1, 2, 3, 1, 2], max_tokens=1) == [3]


def test_index_grows_incrementally_across_rounds():
    session = NgramDrafter(match_drafts=()).start([1, 2, 3], SamplingParams())
    assert session.propose(DraftContext([1, 2, 3]), 4, torch.Generator()).tokens == []
    assert session.propose(DraftContext([1, 2, 3, 9, 1, 2]), 4, torch.Generator()).tokens == [3, 9, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 1, "min_ngram": 2}, "max_ngram"),
        ({"match_drafts": (2, 0)}, "match_drafts"),
        ({"match_drafts": (2.5,)}, "match_drafts"),
        ({"match_drafts": "22"}, "match_drafts"),
    ],
)
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


def test_bench_lookup_methods_use_their_own_match_settings():
    from verispec.bench.methods import build_method
    from verispec.models import LoadedModel

    target = tiny_target()
    draft = LoadedModel(model=noisy_copy(target, noise=0.2), tokenizer=None, name="tiny-draft", path=None)
    lookup = build_method("ngram", target, None, 4).decoder.drafter
    assert (lookup.min_ngram, lookup.match_drafts) == (1, (2, 2, 4))
    # combined: lookup only on 2+ token matches, uncapped; the draft model takes every other round
    combined = build_method("ngram+draft", target, draft, 4).decoder.drafter
    assert (combined.primary.min_ngram, combined.primary.match_drafts) == (2, ())
