"""The speculative decoding loop on tiny models: exactness, invariants, rollback, bad input."""

import functools
import itertools

import pytest
import torch

from chi_square import SIGNIFICANCE, goodness_of_fit_pvalue
from marks import needs_bf16
from tiny_models import anti_copy, noisy_copy, tiny_target
from verispec import DraftModel, SamplingParams, SpeculativeDecoder, logits_to_probs
from verispec.drafters import DraftContext, NgramDrafter, Proposal
from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from verispec.engine.gamma import AdaptiveGamma, StepCosts
from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels

PROMPTS = [[1, 2, 3], [7], [5, 17, 42, 9, 33, 60, 2, 11], list(range(10, 40))]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return DraftModel(noisy_copy(target, noise=0.2))


@functools.cache
def _hf_greedy(model, prompt, max_new_tokens):
    prompt = list(prompt)
    output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_is_token_identical_to_plain_and_transformers(target, drafter, gamma):
    plain = SpeculativeDecoder(target)
    speculative = SpeculativeDecoder(target, drafter, gamma=gamma)
    for prompt in PROMPTS:
        expected = _hf_greedy(target, tuple(prompt), 48)
        assert plain.generate(prompt, 48, stop=[]).token_ids == expected
        result = speculative.generate(prompt, 48, stop=[])
        assert result.token_ids == expected
        assert 0 < result.stats.acceptance_rate < 1  # a real mix of accepted and rejected drafts


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=5)],
    ids=["greedy", "sampled"],
)
def test_tokens_per_target_call_between_1_and_gamma_plus_1(target, drafter, sampling):
    gamma = 4
    steps = list(SpeculativeDecoder(target, drafter, gamma=gamma).stream([3, 1, 4], 80, sampling, stop=[]))
    for step in steps:
        assert 1 <= len(step.token_ids) <= gamma + 1
        assert step.num_accepted == len(step.token_ids) - 1
    stats = steps[-1].stats
    assert sum(len(step.token_ids) for step in steps) == stats.new_tokens == 80
    assert stats.target_calls == len(steps)
    assert 1 < stats.tokens_per_call <= gamma + 1


def test_identical_drafter_is_fully_accepted(target):
    same = DraftModel(target)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.7, top_p=0.8, seed=1)):
        result = SpeculativeDecoder(target, same, gamma=4).generate([9, 8, 7], 50, sampling, stop=[])
        # Every round but the length-limited last one takes gamma drafts plus the bonus.
        assert result.stats.emitted_per_round[:-1] == [5] * 9
        assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=10, seed=3)], ids=["greedy", "top_k"]
)
def test_disjoint_drafter_yields_one_token_per_call_and_the_right_output(target, sampling):
    anti = DraftModel(anti_copy(target))  # its top-10 is the target's bottom-10: disjoint supports
    result = SpeculativeDecoder(target, anti, gamma=4).generate([2, 7, 1], 30, sampling, stop=[])
    assert result.stats.emitted_per_round == [1] * 30
    assert result.stats.acceptance_rate == 0.0
    plain = SpeculativeDecoder(target).generate([2, 7, 1], 30, sampling, stop=[])
    if sampling.is_greedy:
        assert result.token_ids == plain.token_ids


class _CheckingDrafter:
    """Wraps a DraftModel; after each round checks both caches hold exactly the committed sequence.

    The target's cache is checked through the features the engine hands over: features computed
    incrementally through a cache that kept rejected drafts' entries would differ from a fresh
    full forward pass over the committed tokens.
    """

    name = "checking"
    needs_target_features = True

    def __init__(self, inner: DraftModel, target):
        self.inner, self.target = inner, target
        self.checked_rounds = 0
        self.closed = 0

    def start(self, prompt_ids, sampling):
        session = self.inner.start(prompt_ids, sampling)
        wrapper = self

        class Session:
            def propose(self, context: DraftContext, max_tokens, generator):
                wrapper._check_target(context)
                proposal = session.propose(context, max_tokens, generator)
                # The draft cache now holds the committed tokens plus all drafts but the last.
                assert session.lm.token_ids == context.token_ids + proposal.tokens[:-1]
                return proposal

            def close(self):
                wrapper.closed += 1
                session.close()

        return Session()

    def _check_target(self, context: DraftContext):
        if context.target_features is None:
            return
        with torch.no_grad():
            full = self.target.model(torch.tensor([context.token_ids[:-1]])).last_hidden_state[0]
        expected = full[context.features_start :]
        assert context.features_start + len(context.target_features) == len(context.token_ids) - 1
        torch.testing.assert_close(context.target_features, expected, atol=1e-4, rtol=1e-4)
        self.checked_rounds += 1


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=11)], ids=["greedy", "sampled"])
def test_caches_hold_exactly_the_committed_sequence_after_every_round(target, drafter, sampling):
    checking = _CheckingDrafter(drafter, target)
    result = SpeculativeDecoder(target, checking, gamma=4).generate([4, 4, 2, 9], 40, sampling, stop=[])
    assert checking.checked_rounds >= result.stats.target_calls - 1
    assert checking.closed == 1
    assert any(0 < n < 4 for n in result.stats.accepted_per_round)  # rollbacks really happened


def test_abandoned_stream_releases_the_drafter_session(target, drafter):
    checking = _CheckingDrafter(drafter, target)
    stream = SpeculativeDecoder(target, checking, gamma=3).stream([1, 2], 100, stop=[])
    next(stream)
    stream.close()
    assert checking.closed == 1


def test_stop_token_ends_generation_and_is_kept(target):
    full = SpeculativeDecoder(target).generate([1, 2, 3], 40, stop=[]).token_ids
    stop_token = full[10]
    first = full.index(stop_token)
    result = SpeculativeDecoder(target, DraftModel(target), gamma=4).generate([1, 2, 3], 40, stop=[stop_token])
    assert result.token_ids == full[: first + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_never_more_than_max_new_tokens(target, drafter, max_new_tokens):
    result = SpeculativeDecoder(target, drafter, gamma=8).generate([5, 6], max_new_tokens, stop=[])
    assert len(result.token_ids) == max_new_tokens and result.finish_reason == "length"


# --- distribution end to end: the exact law of the first two tokens can be enumerated -------------

SMALL_VOCAB = 6
RUNS = 3000


def _exact_first_two(model, prompt, sampling):
    """P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1), computed from the target directly."""
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)
        table = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
        for t1 in range(SMALL_VOCAB):
            second = logits_to_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1], sampling)
            table[t1] = first[t1] * second
    return table


def _sample_first_two(decoder, prompt, sampling, runs, max_new_tokens=2, branches_kept=None):
    """Counts of the first two generated tokens # [SMALL_VOCAB, SMALL_VOCAB] over ``runs`` seeds, and
    the drafts accepted; ``branches_kept`` (a list) gets each run's kept draft-tree branches."""
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    accepted = 0
    for seed in range(runs):
        params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)
        result = decoder.generate(prompt, max_new_tokens, params, stop=[])
        counts[result.token_ids[0], result.token_ids[1]] += 1
        accepted += result.stats.num_accepted
        if branches_kept is not None:
            branches_kept.append(result.stats.branches_accepted)
    return counts, accepted


def _eagle_head(target):
    torch.manual_seed(3)
    return EagleHead(EagleConfig.for_target(target.config, intermediate_size=16)).eval()


class _FixedCosts(StepCosts):
    def observe(self, *_):  # keep the given costs: timings of tiny models say nothing
        pass


@pytest.mark.parametrize(
    ("sampling", "drafter_kind"),
    [
        (SamplingParams(temperature=1.0), "draft-model"),
        (SamplingParams(temperature=0.8, top_k=3), "draft-model"),
        (SamplingParams(temperature=1.2, top_p=0.75), "draft-model"),
        (SamplingParams(temperature=1.0), "ngram"),
        (SamplingParams(temperature=1.0), "draft-model-confident"),
        (SamplingParams(temperature=1.0), "eagle"),
        (SamplingParams(temperature=0.9, top_p=0.8), "eagle-draft-vocab"),
        (SamplingParams(temperature=1.0), "draft-model-adaptive"),
        (SamplingParams(temperature=0.9, top_k=4), "draft-model-vocab"),
        (SamplingParams(temperature=1.0), "draft-model-path"),
        (SamplingParams(temperature=1.0), "eagle-path"),
    ],
    ids=["temperature", "top_k", "top_p", "ngram-deterministic", "confidence-stop", "eagle", "eagle-draft-vocab", "adaptive-gamma", "draft-model-draft-vocab", "path-stop", "eagle-path-stop"],
)
def test_generated_tokens_follow_the_target_distribution(sampling, drafter_kind):
    target = tiny_target(seed=4, vocab_size=SMALL_VOCAB, sharpness=1.5)
    prompt = [1, 3, 2, 1, 3, 2, 1]  # repeats, so prompt lookup always has a draft to offer
    expected = _exact_first_two(target, prompt, sampling)
    draft = noisy_copy(target, noise=0.5, seed=9)
    drafter = {
        "draft-model": lambda: DraftModel(draft),
        "draft-model-confident": lambda: DraftModel(draft, confidence_threshold=0.5),  # draft length varies
        "draft-model-path": lambda: DraftModel(draft, path_confidence=0.6),  # draft length varies with the path's probability
        "draft-model-adaptive": lambda: DraftModel(draft),
        "ngram": NgramDrafter,
        "eagle": lambda: EagleDrafter(target, _eagle_head(target)),
        "eagle-path": lambda: EagleDrafter(target, _eagle_head(target), path_confidence=0.6),  # draft length varies
        # Drafts only from tokens 1, 2, 4: zero draft mass on the others must stay exact.
        "eagle-draft-vocab": lambda: EagleDrafter(target, _eagle_head(target), draft_vocab=torch.tensor([1, 2, 4])),
        "draft-model-vocab": lambda: DraftModel(draft, draft_vocab=torch.tensor([1, 2, 4])),
    }[drafter_kind]()
    # Adaptive: fixed costs as if drafting were cheap, so the controller drafts or not by each text's acceptance.
    # With this prior one draft pays until a rejection, then plain rounds: the drafts depend on the history.
    costs = _FixedCosts(draft_step_s=0.3, verify_s={1: 1.0, 2: 1.2, 3: 1.4})
    adaptive = drafter_kind.endswith("-adaptive") and AdaptiveGamma(2, alpha_prior=0.6, costs=costs)
    decoder = SpeculativeDecoder(target, drafter, gamma=2, adaptive_gamma=adaptive)
    counts, accepted = _sample_first_two(decoder, prompt, sampling, RUNS, 3 if adaptive else 2)
    assert 0.1 * RUNS < accepted < RUNS  # the draft is neither always right nor always wrong
    assert goodness_of_fit_pvalue(counts.numpy(), expected.numpy()) > SIGNIFICANCE


class _UniformDrafter:
    """Drafts from a uniform q_draft and offers ``runner_ups`` beside every draft: against a peaked
    target most drafts are rejected and the residual sits on the runner-ups, so the tree rule runs
    in most passes (the real drafters' runner-ups are rescued far less often on tiny models)."""

    name, needs_target_features = "uniform", False

    def __init__(self, runner_ups: list[int]) -> None:
        self.runner_ups = runner_ups

    def start(self, prompt_ids, sampling):
        return self

    def propose(self, context, max_tokens, generator):
        probs = torch.full((max_tokens, SMALL_VOCAB), 1 / SMALL_VOCAB)  # [k, vocab]
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        alternatives = [(index, token, 0.5) for index in range(max_tokens) for token in self.runner_ups if token != tokens[index]]
        return Proposal(tokens, probs, alternatives=alternatives)

    def close(self):
        pass


@pytest.mark.skipif(panel_kernels_unavailable_reason() is not None, reason="draft trees need the panel kernels' fused stack")
@pytest.mark.parametrize(
    ("sampling", "drafter_kind"),
    [
        (SamplingParams(temperature=1.0), "uniform"),
        (SamplingParams(temperature=0.8, top_k=3), "uniform"),
        (SamplingParams(temperature=1.0), "draft-model"),
        (SamplingParams(temperature=0.9, top_k=4), "eagle"),
        (SamplingParams(temperature=1.2, top_p=0.8), "parallel"),
    ],
    ids=["uniform", "uniform-top_k", "draft-model", "eagle", "parallel"],
)
def test_sampling_with_draft_trees_follows_the_target_distribution(sampling, drafter_kind):
    # Runner-ups verified in spare rows of the pass: the recovered token is drawn through them, and
    # a taken one's own row gives the token after it. The first two tokens must follow the target.
    from verispec.drafters.parallel import ParallelConfig, ParallelDrafter, ParallelHead

    target = use_panel_kernels(tiny_target(seed=4, vocab_size=SMALL_VOCAB, sharpness=8.0))
    prompt = [1, 3, 2, 1, 3, 2, 1]
    expected = _exact_first_two(target, prompt, sampling)
    torch.manual_seed(3)
    drafter = {
        "uniform": lambda: _UniformDrafter(expected.sum(1).argsort(descending=True)[:2].tolist()),  # the target's likeliest first tokens
        "draft-model": lambda: DraftModel(noisy_copy(target, noise=0.5, seed=9), alternatives=2),
        "eagle": lambda: EagleDrafter(target, _eagle_head(target), alternatives=2),
        # A deterministic draft (the path), runner-ups from its other candidates.
        "parallel": lambda: ParallelDrafter(target, ParallelHead(ParallelConfig.for_target(target.config, 16, block_size=2)).eval(), candidates=3, alternatives=2),
    }[drafter_kind]()
    decoder = SpeculativeDecoder(target, drafter, gamma=2, tree_rows=7)
    kept: list[int] = []
    counts, _ = _sample_first_two(decoder, prompt, sampling, RUNS, max_new_tokens=3, branches_kept=kept)
    assert sum(kept) > (0.2 * RUNS if drafter_kind in ("uniform", "parallel") else 0)  # the runs took runner-ups
    assert goodness_of_fit_pvalue(counts.numpy(), expected.numpy()) > SIGNIFICANCE


def _served_first_two(model, prompt, sampling):
    """P(t1, t2) from the target as the engine serves it (its own passes, e.g. the lean bfloat16 forward)."""
    from verispec.engine.lean_lm import target_lm

    lm = target_lm(model)
    try:
        first = logits_to_probs(lm.extend(prompt, num_logits=1).logits[-1], sampling)
        table = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
        for t1 in range(SMALL_VOCAB):
            lm.crop(len(prompt))
            table[t1] = first[t1] * logits_to_probs(lm.extend([t1], num_logits=1).logits[-1], sampling)
    finally:
        lm.release()
    return table


@needs_bf16
def test_sampling_from_a_bfloat16_target_follows_its_own_distribution():
    # --target-dtype bfloat16: exactness is relative to the target actually served (bf16 weights on our
    # kernels, the lean forward), so speculative samples must follow ITS distribution.
    from verispec.models.panel_linear import use_panel_kernels

    target = tiny_target(seed=4, vocab_size=SMALL_VOCAB, sharpness=1.5).bfloat16()
    use_panel_kernels(target)
    prompt, sampling = [1, 3, 2, 1, 3, 2, 1], SamplingParams(temperature=0.9, top_p=0.9)
    expected = _served_first_two(target, prompt, sampling)
    drafter = DraftModel(noisy_copy(tiny_target(seed=4, vocab_size=SMALL_VOCAB, sharpness=1.5), noise=0.5, seed=9))
    counts, accepted = _sample_first_two(SpeculativeDecoder(target, drafter, gamma=2), prompt, sampling, RUNS)
    assert 0.1 * RUNS < accepted < RUNS
    assert goodness_of_fit_pvalue(counts.numpy(), expected.numpy()) > SIGNIFICANCE


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda d: d.generate([], 5), "input_ids"),
        (lambda d: d.generate([1, 2], 0), "max_new_tokens"),
        (lambda d: d.generate([1, 2], -3), "max_new_tokens"),
        (lambda d: d.generate([1, 10_000], 5), "input_ids"),
        (lambda d: d.stream([1, 2], 5, stop=["x"]), "stop strings need a tokenizer"),
        (lambda d: d.generate([1, 2], 5, SamplingParams(top_p=2.0)), "top_p"),
    ],
)
def test_bad_generate_arguments(target, drafter, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(SpeculativeDecoder(target, drafter, gamma=2))


@pytest.mark.parametrize("gamma", [0, -1, 2.5, True])
def test_bad_gamma(target, drafter, gamma):
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeDecoder(target, drafter, gamma=gamma)


def test_bad_models():
    with pytest.raises(ValueError, match="target"):
        SpeculativeDecoder("not a model")
    with pytest.raises(ValueError, match="DraftModel"):
        DraftModel(42)


def test_oversized_proposal_is_refused(target):
    class Greedy:
        name, needs_target_features = "too-many", False

        def start(self, prompt_ids, sampling):
            class Session:
                def propose(self, context, max_tokens, generator):
                    return Proposal(tokens=[1] * (max_tokens + 1), probs=None)

                def close(self):
                    pass

            return Session()

    with pytest.raises(RuntimeError, match="too-many"):
        SpeculativeDecoder(target, Greedy(), gamma=2).generate([1], 5, stop=[])


def test_deterministic_drafter_with_sampling_keeps_outputs_valid(target):
    """A model-free drafter (probs=None) goes through the deterministic-draft rule."""

    class Repeat:
        name, needs_target_features = "repeat-last", False

        def start(self, prompt_ids, sampling):
            class Session:
                def propose(self, context, max_tokens, generator):
                    return Proposal(tokens=[context.token_ids[-1]] * max_tokens, probs=None)

                def close(self):
                    pass

            return Session()

    for seed in range(3):
        result = SpeculativeDecoder(target, Repeat(), gamma=3).generate([1, 1, 1], 20, SamplingParams(temperature=1.0, seed=seed), stop=[])
        assert len(result.token_ids) == 20
        assert all(1 <= n <= 4 for n in result.stats.emitted_per_round)


def test_seeded_sampling_repeats(target, drafter):
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    assert decoder.generate([8, 9], 30, params, stop=[]).token_ids == decoder.generate([8, 9], 30, params, stop=[]).token_ids


def test_all_gammas_and_prompts_share_one_plain_reference(target, drafter):
    """Plain decoding through our loop never drafts and calls the target once per token."""
    for prompt, n in itertools.product(PROMPTS[:2], [1, 7]):
        result = SpeculativeDecoder(target).generate(prompt, n, stop=[])
        assert result.stats.target_calls == n and result.stats.draft_calls == 0


def test_mismatched_tokenizers_are_refused(target):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verispec.models import LoadedModel, TokenizerMismatchError

    def tokenizer(words):
        backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")

    words = ["[UNK]", "<eos>", "hello", "world", "def", "return"]
    swapped = ["[UNK]", "<eos>", "world", "hello", "def", "return"]
    target_model = LoadedModel(target, tokenizer(words), "tiny-target", None)
    draft_model = LoadedModel(target, tokenizer(swapped), "tiny-draft", None)
    with pytest.raises(TokenizerMismatchError, match="draft"):
        SpeculativeDecoder(target_model, DraftModel(draft_model))
    SpeculativeDecoder(target_model, DraftModel(LoadedModel(target, tokenizer(words), "same", None)))


def test_int8_quantized_draft_keeps_output_exact(target):
    """Whatever the drafter computes, verification keeps the target's output (int8 draft here)."""
    from verispec.models import quantize_int8

    quantized = quantize_int8(noisy_copy(target, noise=0.1))
    assert isinstance(quantized.lm_head, torch.ao.nn.quantized.dynamic.Linear)
    result = SpeculativeDecoder(target, DraftModel(quantized), gamma=4).generate([6, 1, 7], 40, stop=[])
    assert result.token_ids == SpeculativeDecoder(target).generate([6, 1, 7], 40, stop=[]).token_ids
    assert result.stats.acceptance_rate > 0.3


def test_int8_quantization_scales_each_output_row():
    """Rows with small weights keep their precision: one tensor-wide scale would round them to ~0."""
    from verispec.models import quantize_int8

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 4, bias=False))
    with torch.no_grad():
        layer[0].weight[1:] *= 1e-3  # rows 1..3 a thousand times smaller than row 0
    weight = layer[0].weight.detach().clone()  # [4, 64]
    quantized = quantize_int8(layer)[0]
    dequantized = quantized.weight().dequantize()  # [4, 64]
    relative_error = (dequantized - weight).norm(dim=1) / weight.norm(dim=1)  # [4]
    assert float(relative_error.max()) < 0.02, relative_error  # per-tensor scales: ~1.0 for rows 1..3


def test_mixed_precision_linear_multiplies_in_bfloat16_but_its_float32_columns():
    from verispec.models.quantize import MixedPrecisionLinear, linear_columns, quantize_int8

    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 5)
    mixed = MixedPrecisionLinear(linear, float32_columns=4)
    x = torch.randn(3, 7, 12)  # [batch, rows, in]
    out = mixed(x)
    assert out.dtype == torch.float32 and out.shape == (3, 7, 5)
    bf16_part = torch.nn.functional.linear(x[..., 4:].bfloat16(), linear.weight[:, 4:].bfloat16()).float()
    reference = bf16_part + torch.nn.functional.linear(x[..., :4], linear.weight[:, :4]) + linear.bias
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, linear(x), rtol=0.02, atol=0.02)  # bfloat16 rounding only
    # The float32 columns keep a small input's share of a large sum (bfloat16 sums would round it away).
    x[..., 4:] *= 300.0
    small_change = torch.zeros(12)
    small_change[:4] = 1e-3
    moved = mixed(x + small_change) - mixed(x)
    torch.testing.assert_close(moved, linear(x + small_change) - linear(x), rtol=1e-3, atol=1e-4)
    assert mixed.state_dict().keys() == linear.state_dict().keys()  # the part copies are not saved
    torch.testing.assert_close(mixed.weight, linear.weight, rtol=0, atol=0)
    # A linear over [a ; b] is the sum of its columns' parts plus the bias, in either precision.
    for layer in (linear, mixed):
        parts = linear_columns(layer, x[..., :4], slice(0, 4)) + linear_columns(layer, x[..., 4:], slice(4, None)) + layer.bias
        torch.testing.assert_close(parts, layer(x), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="parts only"):
        linear_columns(mixed, x[..., :3], slice(0, 3))
    with pytest.raises(ValueError, match="int8"):
        linear_columns(quantize_int8(torch.nn.Sequential(torch.nn.Linear(12, 5)))[0], x[..., :4], slice(0, 4))
    with pytest.raises(ValueError, match="float32_columns"):
        MixedPrecisionLinear(linear, float32_columns=13)


@pytest.mark.parametrize("rows", [1, 3, 10, 200])
def test_mixed_precision_linear_without_bfloat16_is_the_float32_layer_by_parts(rows):
    # Where bfloat16 products are emulated, fc stays float32 and runs by its two column parts, each
    # through our few-row kernels where they run (PyTorch's product past their rows): the same
    # layer up to float32 summation order, its parts as linear_columns gives them.
    from verispec.models.panel_linear import PanelLinear, panel_kernels_unavailable_reason
    from verispec.models.quantize import MixedPrecisionLinear, linear_columns

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 20)
    split = MixedPrecisionLinear(linear, float32_columns=16, bf16_rest=False)
    assert split.weight_rest_part.dtype == torch.float32
    if panel_kernels_unavailable_reason() is None:
        assert all(type(part) is PanelLinear for part in split._float32_products)
    x = 30 * torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-4)
        first, rest = linear_columns(split, x[:, :16], slice(0, 16)), linear_columns(split, x[:, 16:], slice(16, None))
        torch.testing.assert_close(first, x[:, :16] @ linear.weight[:, :16].T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(rest, x[:, 16:] @ linear.weight[:, 16:].T, rtol=1e-5, atol=1e-4)
    assert split.state_dict().keys() == linear.state_dict().keys()  # the parts and their kernels' copies are not saved


def test_native_bf16_products_can_be_switched_off(monkeypatch):
    from verispec.models.quantize import native_bf16_products

    native_bf16_products.cache_clear()
    monkeypatch.setenv("VERISPEC_NO_BF16", "1")
    try:
        assert native_bf16_products() is False
    finally:
        native_bf16_products.cache_clear()


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_reduced_draft_vocabulary_drafts_only_from_it_and_stays_exact(target, quantized):
    from verispec.models import quantize_int8

    draft = noisy_copy(target, noise=0.1)
    draft.generation_config.eos_token_id = 90  # a special id past the first N: always kept
    draft = quantize_int8(draft) if quantized else draft
    drafter = DraftModel(draft, draft_vocab=48)
    head = getattr(drafter.lm_head, "source", drafter.lm_head)  # an int8 head wrapped for our kernels keeps its source
    rows = head.weight() if quantized else head.weight  # [49, hidden]
    assert drafter.vocab_ids.tolist() == [*range(48), 90] and rows.shape[0] == 49
    assert ("quantized" in type(head).__module__) == quantized  # the rows keep the model head's precision
    prompt = list(range(10, 30))
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        result = SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, 40, sampling, stop=[])
        assert result.stats.num_drafted > 0
        if sampling.is_greedy:
            assert result.token_ids == SpeculativeDecoder(target).generate(prompt, 40, stop=[]).token_ids
    session = drafter.start(prompt, SamplingParams(temperature=1.0))
    proposal = session.propose(DraftContext(prompt), 6, torch.Generator().manual_seed(0))
    assert set(proposal.tokens) <= set(drafter.vocab_ids.tolist())
    assert proposal.probs.shape == (len(proposal.tokens), 96) and float(proposal.probs[:, 48:90].sum()) == 0.0
    with pytest.raises(ValueError, match="draft_vocab"):
        DraftModel(draft, draft_vocab=0)
    with pytest.raises(ValueError, match="draft_vocab"):
        DraftModel(draft, draft_vocab=[1, 2])


@pytest.mark.parametrize("stop_rule", [{"confidence_threshold": 0.9}, {"path_confidence": 0.5}], ids=["per-token", "path"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=4)], ids=["greedy", "sampled"])
def test_stopping_rules_shorten_drafts_and_stay_exact(target, sampling, stop_rule):
    draft = noisy_copy(target, noise=0.2)
    eager = SpeculativeDecoder(target, DraftModel(draft), gamma=8).generate([2, 9, 4], 50, sampling, stop=[])
    careful = SpeculativeDecoder(target, DraftModel(draft, **stop_rule), gamma=8).generate([2, 9, 4], 50, sampling, stop=[])
    assert careful.stats.num_drafted < eager.stats.num_drafted
    assert careful.stats.acceptance_rate > eager.stats.acceptance_rate
    assert any(0 < d < 8 for d in careful.stats.drafted_per_round)
    if sampling.is_greedy:
        assert careful.token_ids == eager.token_ids


def test_confidence_threshold_is_validated(target):
    with pytest.raises(ValueError, match="confidence_threshold"):
        DraftModel(target, confidence_threshold=1.5)
    with pytest.raises(ValueError, match="path_confidence"):
        DraftModel(target, path_confidence=-0.1)


def _path_probs(draft, context: list[int], tokens: list[int]) -> list[float]:
    """The draft's probability of each of ``tokens`` after ``context`` + the tokens before it (greedy drafts)."""
    with torch.no_grad():
        logits = draft(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1]  # [len(tokens), vocab]
    probs = torch.softmax(logits.float(), -1)
    return [float(probs[i, token]) for i, token in enumerate(tokens)]


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_path_confidence_stops_where_the_draft_path_probability_falls_below_it(target, threshold):
    draft = noisy_copy(target, noise=0.6, seed=3)
    prompt = [2, 9, 4, 7]
    free = DraftModel(draft).start(prompt, SamplingParams()).propose(DraftContext(prompt), 12, torch.Generator())
    stopped = DraftModel(draft, path_confidence=threshold).start(prompt, SamplingParams()).propose(DraftContext(prompt), 12, torch.Generator())
    products = torch.tensor(_path_probs(draft, prompt, free.tokens)).cumprod(0).tolist()
    # The rule drafts up to and including the first token whose path product drops below the threshold.
    expected = next((i + 1 for i, product in enumerate(products) if product < threshold), len(free.tokens))
    assert stopped.tokens == free.tokens[:expected]
    assert 1 <= len(stopped.tokens) <= 12


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5)], ids=["greedy", "sampled"])
def test_a_draft_seeing_only_the_last_tokens_of_the_prompt_keeps_the_output_exact(target, sampling):
    # context_window: the draft's text starts 6 tokens before the prompt's end. Its cache holds
    # exactly that window plus what came after it, its proposals are what the draft computes on the
    # window alone, and the decoded output is the target's as with the whole prompt.
    draft = noisy_copy(target, noise=0.2)
    prompt = [2, 9, 4, 7, 11, 3, 8, 5, 6, 12, 10, 13]
    windowed = DraftModel(draft, context_window=6)
    session = windowed.start(prompt, SamplingParams())
    proposal = session.propose(DraftContext(prompt), 5, torch.Generator())
    assert session.lm.token_ids == prompt[-6:] + proposal.tokens[:-1]
    alone = DraftModel(draft).start(prompt[-6:], SamplingParams()).propose(DraftContext(prompt[-6:]), 5, torch.Generator())
    assert proposal.tokens == alone.tokens
    whole = SpeculativeDecoder(target, DraftModel(draft), gamma=4).generate(prompt, 40, sampling, stop=[])
    window = SpeculativeDecoder(target, windowed, gamma=4).generate(prompt, 40, sampling, stop=[])
    if sampling.is_greedy:
        assert window.token_ids == whole.token_ids == SpeculativeDecoder(target).generate(prompt, 40, sampling, stop=[]).token_ids
    assert len(window.token_ids) == 40 and all(1 <= n <= 5 for n in window.stats.emitted_per_round)
    short = DraftModel(draft, context_window=50).start(prompt, SamplingParams())  # a window longer than the prompt: all of it
    short.propose(DraftContext(prompt), 2, torch.Generator())
    assert short.lm.token_ids[: len(prompt)] == prompt
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="context_window"):
            DraftModel(draft, context_window=bad)
