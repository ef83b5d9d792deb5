"""--drafter auto: one drafter for short prompts, another for long ones (LengthSwitchDrafter)."""

from __future__ import annotations

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import SpeculativeDecoder
from verispec.drafters import DraftModel, lookup_then_model
from verispec.drafters.base import Proposal
from verispec.drafters.by_length import LengthSwitchDrafter
from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=VOCAB)


def _head(target) -> EagleHead:
    torch.manual_seed(3)
    return EagleHead(EagleConfig.for_target(target.config, 24)).eval().requires_grad_(False)


class _Named:
    """A drafter that records the prompts its sessions were started on and never drafts."""

    def __init__(self, name: str, needs_target_features: bool) -> None:
        self.name, self.needs_target_features, self.started = name, needs_target_features, []

    def start(self, prompt_ids, sampling):
        self.started.append(len(prompt_ids))

        class Session:
            def propose(self, context, max_tokens, generator):
                return Proposal([], None)

            def close(self):
                pass

        return Session()


def test_the_prompt_length_picks_the_drafter_once_per_request():
    short, long = _Named("short", False), _Named("long", True)
    switch = LengthSwitchDrafter(short, long, 10)
    assert switch.needs_target_features  # handed whenever either drafter reads them
    assert "short" in switch.name and "long" in switch.name and "10" in switch.name
    assert switch.for_prompt(9) is short and switch.for_prompt(10) is long and switch.for_prompt(10_000) is long
    for length in (1, 9, 10, 11):
        switch.start(list(range(length)), None)
    assert short.started == [1, 9] and long.started == [10, 11]
    assert not LengthSwitchDrafter(short, _Named("other", False), 5).needs_target_features


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, None])
def test_a_bad_threshold_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="long_prompt_tokens must be an integer >= 1"):
        LengthSwitchDrafter(_Named("a", False), _Named("b", False), bad)


def test_each_request_decodes_exactly_as_its_drafter_alone(target):
    """Short prompt: lookup + draft model's rounds; long prompt: lookup + EAGLE's; both plain decoding's text."""
    draft = noisy_copy(target, noise=0.2)
    short = lookup_then_model(DraftModel(draft))
    long = lookup_then_model(EagleDrafter(target, _head(target)))
    switch = LengthSwitchDrafter(short, long, 12)
    prompts = {"short": [5, 6, 7, 8, 5, 6, 7], "long": [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 9, 10, 11, 12]}
    for which, prompt in prompts.items():
        plain = SpeculativeDecoder(target).generate(prompt, 40, stop=[]).token_ids
        switched = SpeculativeDecoder(target, switch, gamma=4, adaptive_gamma=False).generate(prompt, 40, stop=[])
        alone = SpeculativeDecoder(target, short if which == "short" else long, gamma=4, adaptive_gamma=False).generate(prompt, 40, stop=[])
        assert switched.token_ids == plain == alone.token_ids
        # The same rounds: the same drafts proposed and accepted, round by round.
        assert switched.stats.drafted_per_round == alone.stats.drafted_per_round
        assert switched.stats.accepted_per_round == alone.stats.accepted_per_round
        assert sum(switched.stats.accepted_per_round) > 0, f"{which}: no draft accepted, the comparison shows nothing"
