"""The modified rejection sampler: exact target distribution, conventions, edge cases."""

import pytest
import torch
from chi_square import SIGNIFICANCE, goodness_of_fit_pvalue

from verispec import SamplingParams, greedy_verify, logits_to_probs, rejection_sample
from verispec.rejection import sample_through_candidates

VOCAB = 12
SAMPLES = 60_000


def _random_probs(generator, *shape, params=SamplingParams(temperature=1.0)):
    return logits_to_probs(torch.randn(*shape, VOCAB, generator=generator) * 2, params)


def _chi_square_pvalue(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    return goodness_of_fit_pvalue(torch.bincount(samples, minlength=VOCAB).numpy(), expected_probs.numpy())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
    ],
    ids=["temperature", "top_k", "top_p", "combined"],
)
@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["sampled_draft", "deterministic_draft"])
def test_emitted_tokens_follow_the_target_distribution(params, deterministic_draft):
    generator = torch.Generator().manual_seed(7)
    k = 3
    target_probs = _random_probs(generator, 1, k + 1, params=params).expand(SAMPLES, k + 1, VOCAB)
    draft_row = _random_probs(generator, 1, k, params=SamplingParams(temperature=1.5)).expand(SAMPLES, k, VOCAB)
    draft_tokens = torch.multinomial(draft_row.reshape(-1, VOCAB), 1, generator=generator).reshape(SAMPLES, k)
    output, num_accepted = rejection_sample(draft_tokens, None if deterministic_draft else draft_row, target_probs, generator)

    # Position 0 is always emitted and must follow p_target[0].
    assert _chi_square_pvalue(output[:, 0], target_probs[0, 0]) > SIGNIFICANCE
    # Given position 0 was an accepted draft, position 1 must follow p_target[1] (rows are context-free here).
    continued = num_accepted >= 1
    assert continued.sum() > 1000
    assert _chi_square_pvalue(output[continued, 1], target_probs[0, 1]) > SIGNIFICANCE


def test_detects_a_biased_sampler():
    """The statistical check has power: emitting the draft's distribution instead fails it."""
    generator = torch.Generator().manual_seed(3)
    target = _random_probs(generator, 1)[0]
    draft = _random_probs(generator, 1)[0]
    samples = torch.multinomial(draft, SAMPLES, replacement=True, generator=generator)
    assert _chi_square_pvalue(samples, target) < SIGNIFICANCE


def test_output_layout():
    generator = torch.Generator().manual_seed(0)
    k = 4
    target_probs = _random_probs(generator, 64, k + 1)
    draft_probs = _random_probs(generator, 64, k)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=generator).reshape(64, k)
    output, num_accepted = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    assert output.shape == (64, k + 1) and num_accepted.shape == (64,)
    for row in range(64):
        n = int(num_accepted[row])
        assert 0 <= n <= k
        assert output[row, :n].tolist() == draft_tokens[row, :n].tolist()
        assert 0 <= output[row, n] < VOCAB
        assert (output[row, n + 1 :] == -1).all()


def test_identical_draft_is_always_accepted():
    generator = torch.Generator().manual_seed(1)
    probs = _random_probs(generator, 500, 5)
    draft_tokens = torch.multinomial(probs[:, :4].reshape(-1, VOCAB), 1, generator=generator).reshape(500, 4)
    _, num_accepted = rejection_sample(draft_tokens, probs[:, :4], probs, generator)
    assert (num_accepted == 4).all()


def test_zero_target_probability_is_never_accepted_and_residual_excludes_it():
    target_probs = torch.zeros(1000, 2, VOCAB)
    target_probs[:, :, :3] = 1 / 3
    draft_tokens = torch.full((1000, 1), 5)
    output, num_accepted = rejection_sample(draft_tokens, None, target_probs, torch.Generator().manual_seed(0))
    assert (num_accepted == 0).all()
    assert set(output[:, 0].tolist()) == {0, 1, 2}


def test_residual_without_mass_falls_back_to_target():
    """p_target == q_draft with a (numerically impossible) rejection: sample from p_target, not NaN."""
    probs = torch.zeros(1, 2, VOCAB)
    probs[0, :, 4] = 1.0
    draft = torch.tensor([[4]])
    # Deterministic draft of the only supported token: accepted; bonus from p_target[1].
    output, num_accepted = rejection_sample(draft, probs[:, :1], probs, torch.Generator().manual_seed(0))
    assert output.tolist() == [[4, 4]] and num_accepted.tolist() == [1]


def test_greedy_one_hot_rejection_equals_greedy_verify():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(200, 4, VOCAB, generator=generator)
    draft_tokens = torch.where(torch.rand(200, 3, generator=generator) < 0.7, logits[:, :3].argmax(-1), torch.randint(0, VOCAB, (200, 3), generator=generator))
    greedy = SamplingParams(temperature=0)
    draft_probs = torch.zeros(200, 3, VOCAB).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    sampled = rejection_sample(draft_tokens, draft_probs, logits_to_probs(logits, greedy), generator)
    exact = greedy_verify(draft_tokens, logits)
    assert torch.equal(sampled[0], exact[0]) and torch.equal(sampled[1], exact[1])


def test_zero_drafts_emits_one_token_from_the_target():
    probs = torch.zeros(3, 1, VOCAB)
    probs[:, 0, 9] = 1.0
    output, num_accepted = rejection_sample(torch.zeros(3, 0, dtype=torch.long), None, probs)
    assert output.tolist() == [[9]] * 3 and num_accepted.tolist() == [0] * 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d, q, p: (d, q, p.clone().fill_(float("nan"))), "NaN or inf"),
        (lambda d, q, p: (d, q.clone().fill_(float("inf")), p), "NaN or inf"),
        (lambda d, q, p: (d, q, p[:, :2]), "target_probs must be"),
        (lambda d, q, p: (d, q[:, :, :5], p), "draft_probs must be"),
        (lambda d, q, p: (d.float(), q, p), "draft_tokens must be a Long"),
        (lambda d, q, p: (d + VOCAB, q, p), "token ids in"),
        (lambda d, q, p: (d, -q, p), "negative"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, message):
    generator = torch.Generator().manual_seed(0)
    q = _random_probs(generator, 2, 3)
    p = _random_probs(generator, 2, 4)
    d = q.argmax(-1)
    with pytest.raises(ValueError, match=message):
        rejection_sample(*mutate(d, q, p))


# --- drawing the recovered token through a draft tree's runner-ups ------------------------------

CANDIDATE_DRAWS = 20_000


@pytest.mark.parametrize(
    "candidates",
    [[], [1], [1, 3], [3, 1, 0], [11, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]],
    ids=["none", "one", "two", "three", "zero-mass-first", "all"],
)
def test_sampling_through_candidates_draws_exactly_from_the_distribution(candidates):
    # Token 11 has no mass (as under top-k): offering it first must change nothing. Offering every
    # token leaves nothing to draw afterwards: the last candidate with mass must then be certain.
    generator = torch.Generator().manual_seed(11)
    probs = _random_probs(generator, 1)[0]
    probs[11] = 0.0
    probs = probs / probs.sum()
    offered = torch.tensor(candidates, dtype=torch.long)
    drawn, taken_first = [], 0
    for _ in range(CANDIDATE_DRAWS):
        token, taken = sample_through_candidates(probs, offered, generator)
        assert (taken is None) == (token not in candidates)
        assert taken is None or candidates[taken] == token
        taken_first += taken == 0
        drawn.append(token)
    assert _chi_square_pvalue(torch.tensor(drawn), probs) > SIGNIFICANCE
    if candidates:  # the first candidate is taken exactly as often as its own probability
        assert abs(taken_first / CANDIDATE_DRAWS - float(probs[candidates[0]])) < 4 * (0.25 / CANDIDATE_DRAWS) ** 0.5


def test_sampling_through_candidates_renormalises_after_each_refusal():
    # Without the renormalisation (accepting c_j with r(c_j) itself) the second candidate would come
    # (1 - r(c_1)) times too rarely: 0.5 * 0.4 = 0.2 instead of 0.4 here.
    probs = torch.tensor([0.5, 0.4, 0.1])
    generator = torch.Generator().manual_seed(2)
    second = sum(sample_through_candidates(probs, torch.tensor([0, 1]), generator)[0] == 1 for _ in range(CANDIDATE_DRAWS))
    assert abs(second / CANDIDATE_DRAWS - 0.4) < 0.02


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        (torch.tensor([1.0]), "Long tensor"),
        (torch.tensor([[1]]), "Long tensor"),
        (torch.tensor([12]), r"token ids in \[0, 12\)"),
        (torch.tensor([-1]), r"token ids in \[0, 12\)"),
        (torch.tensor([2, 2]), "distinct"),
    ],
)
def test_sampling_through_candidates_refuses_bad_candidates(candidates, message):
    with pytest.raises(ValueError, match=message):
        sample_through_candidates(torch.full((VOCAB,), 1 / VOCAB), candidates)
