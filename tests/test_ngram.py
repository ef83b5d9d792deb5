"""Prompt-lookup (n-gram) drafting: what it proposes, and exactness through the engine."""

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import DraftContext, LookupRule, NgramDrafter
from verispec.drafters.ngram import LATEST_CAPPED, SELF_TUNING_RULES, TRANSFORMERS_RULE


def _propose(tokens, max_tokens=4, **rule):
    session = NgramDrafter(LookupRule(**rule)).start(tokens, SamplingParams())
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
    session = NgramDrafter(LookupRule(match_drafts=())).start([1, 2, 3], SamplingParams())
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
        LookupRule(**kwargs)


@pytest.mark.parametrize(("kwargs", "argument"), [({"rules": ()}, "rules"), ({"rules": [(4, 1)]}, "rules"), ({"row_cost": -0.1}, "row_cost"), ({"row_cost": float("nan")}, "row_cost")])
def test_bad_drafter_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        NgramDrafter(**kwargs)


def test_earliest_occurrence_and_transformers_rule():
    tokens = [7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 7, 8]
    assert _propose(tokens, max_tokens=3, match_drafts=()) == [4, 5, 6]  # latest
    assert _propose(tokens, max_tokens=3, match_drafts=(), earliest=True) == [1, 2, 3]
    assert _propose(tokens, max_tokens=3, earliest=True) == [1, 2]  # a 2-token match stays capped
    # transformers' rule: a 2- then 1-token match, the first occurrence, as far as the round allows
    session = NgramDrafter(TRANSFORMERS_RULE).start(tokens, SamplingParams())
    assert session.propose(DraftContext(tokens), 5, torch.Generator()).tokens == [1, 2, 3, 7, 8]


def _session_drafts(drafter, text, max_tokens=4):
    """Feed ``text`` one committed token per round; the drafts proposed at every round."""
    session = drafter.start(text[:1], SamplingParams())
    return session, [session.propose(DraftContext(text[:end]), max_tokens, torch.Generator()).tokens for end in range(1, len(text) + 1)]


def test_self_tuning_switches_to_the_rule_the_committed_text_confirms():
    # A source span, a copy of it with every 6th token altered, then the source again: while the
    # source is copied, the latest occurrence of the suffix is often the altered copy (wrong within
    # a few tokens), the first one always the source.
    source = list(range(10, 50))
    altered = [0 if i % 6 == 5 else token for i, token in enumerate(source)]
    text = source + [1] + altered + [2] + source
    tuned, tuned_drafts = _session_drafts(NgramDrafter(), text)
    _, latest_drafts = _session_drafts(NgramDrafter(LATEST_CAPPED), text)
    assert tuned.rules == SELF_TUNING_RULES and tuned.scores[0] < max(tuned.scores[1:])
    # before any proposal is settled the first rule (latest, capped) drafts
    assert tuned_drafts[:8] == latest_drafts[:8]

    def confirmed(drafts):  # drafts the text then confirmed, summed over rounds
        total = 0
        for end, proposal in enumerate(drafts, start=1):
            matched = 0
            while matched < len(proposal) and end + matched < len(text) and proposal[matched] == text[end + matched]:
                matched += 1
            total += matched
        return total

    assert confirmed(tuned_drafts) > confirmed(latest_drafts)


def test_self_tuning_scores_only_settled_proposals():
    def session():
        return NgramDrafter((LATEST_CAPPED, TRANSFORMERS_RULE), row_cost=0.5).start([5], SamplingParams())

    def propose(tokens):
        return one.propose(DraftContext(tokens), 4, torch.Generator()).tokens

    one = session()
    assert propose([5, 6, 7, 5]) == [6, 7]  # a 1-token match: capped at 2; transformers' rule drafted [6, 7, 5]
    assert one.scores == [0.0, 0.0] and len(one.pending) == 2
    # [6, 7] confirmed to its end: 2 - 0.5 x 2; [6, 7, 5] confirmed so far but not settled
    propose([5, 6, 7, 5, 6, 7])
    assert one.scores == [1.0, 0.0]
    one = session()
    propose([5, 6, 7, 5])
    propose([5, 6, 7, 5, 6])  # first drafts confirmed, the rest not yet known: nothing settled
    assert one.scores == [0.0, 0.0]
    propose([5, 6, 7, 5, 6, 8])  # contradicted: round 1 [6, 7] 1 - 1, [6, 7, 5] 1 - 1.5; round 2 [7, 5] -1, [7, 5, 6] -1.5
    assert one.scores == [-1.0, -2.0]


def test_greedy_output_identical_and_sampling_valid():
    target = tiny_target()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = SpeculativeDecoder(target).generate(prompt, 40, stop=[])
    for drafter in (NgramDrafter(), NgramDrafter(LATEST_CAPPED)):
        lookup = SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, 40, stop=[])
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
    assert lookup.rules == SELF_TUNING_RULES
    assert build_method("ngram:tune=0", target, None, 4).decoder.drafter.rules == (LookupRule(1 * 4, 1, (2, 2, 4)),)
    # combined: lookup only on 2+ token matches, uncapped; the draft model takes every other round
    combined = build_method("ngram+draft", target, draft, 4).decoder.drafter
    assert combined.primary.rules == (LookupRule(min_ngram=2, match_drafts=()),)
    with pytest.raises(ValueError, match="tune applies to ngram"):
        build_method("ngram+draft:tune=0", target, draft, 4)
