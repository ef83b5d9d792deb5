"""Parallel drafting (DCOCO): lattice paths, the head's one-pass block, the drafter on the engine, training."""

import dataclasses
import itertools
import math

import pytest
import torch

from chi_square import SIGNIFICANCE, goodness_of_fit_pvalue
from test_eagle import documents, fresh_head, trained_head, words_tokenizer  # noqa: F401 - trained_head: a fixture
from test_engine import RUNS, SMALL_VOCAB, _exact_first_two, _sample_first_two
from tiny_models import noisy_copy, tiny_target
from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import DraftContext
from verispec.drafters.eagle import EagleDrafter, EagleHead, EagleHeadMismatchError, save_head, target_fingerprint
from verispec.drafters.eagle.extract import ExtractSettings, extract_features
from verispec.engine.kv_cache import LayerKVCache
from verispec.drafters.parallel import ParallelConfig, ParallelDrafter, ParallelHead, best_path, load_parallel_head, save_parallel_head, top_paths
from verispec.drafters.parallel.acceptance import accepted_from_every_start
from verispec.drafters.parallel.drafter import PARALLEL_PATH_RULE, SUCCESSOR_CANDIDATES, _pair_fit, _successor_fit, draft_paths, path_lengths, path_runner_ups
from verispec.drafters.parallel.head import cached
from verispec.drafters.parallel.train import BlockObjective, ParallelTrainSettings, train_parallel_head
from verispec.models import LoadedModel
from verispec.models.rotary import apply_rotary, rotary_cos_sin

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=VOCAB)


def parallel_head(target, block_size=4, num_layers=1, seed=0, slot_input="fc") -> ParallelHead:
    torch.manual_seed(seed)
    config = ParallelConfig.for_target(target.config, 24, block_size=block_size, num_layers=num_layers, slot_input=slot_input)
    return ParallelHead(config).eval().requires_grad_(False)


def path_rule(correction) -> str:
    """A test's ``correction`` mode: False (none), True (the head's own fit), "eagle" (EAGLE fit,
    lattice path) or "successor" (EAGLE fit, the corrector's successors)."""
    return "successor" if correction == "successor" else "lattice"


def corrector_for(correction, head):
    return head if correction in ("eagle", "successor") else None


# --- the lattice ---------------------------------------------------------------------------------------


def brute_force(unary, pair):
    """Every path with its score S, best first."""
    length, width = unary.shape
    scored = []
    for path in itertools.product(range(width), repeat=length):
        score = sum(float(unary[i, c]) for i, c in enumerate(path)) + sum(float(pair[i, path[i], path[i + 1]]) for i in range(length - 1))
        scored.append((score, path))
    return sorted(scored, reverse=True)


@pytest.mark.parametrize(("length", "width"), [(1, 4), (2, 3), (3, 3), (4, 2), (5, 3)])
def test_lattice_paths_match_brute_force(length, width):
    generator = torch.Generator().manual_seed(length * 10 + width)
    for _ in range(5):
        unary, pair = torch.randn(length, width, generator=generator), torch.randn(length - 1, width, width, generator=generator)
        expected = brute_force(unary, pair)
        path, score = best_path(unary, pair)
        assert tuple(path.tolist()) == expected[0][1]
        assert float(score) == pytest.approx(expected[0][0], abs=1e-5)
        paths, scores = top_paths(unary, pair, 6)
        assert len(paths) == min(6, width**length)
        assert [tuple(p) for p in paths.tolist()] == [p for _, p in expected[: len(paths)]]
        torch.testing.assert_close(scores, torch.tensor([s for s, _ in expected[: len(paths)]]), atol=1e-5, rtol=0)


def test_pair_fit_can_overrule_the_per_position_favourite():
    unary = torch.log(torch.tensor([[0.9, 0.1], [0.6, 0.4]]))
    pair = torch.log(torch.tensor([[[0.05, 0.95], [0.5, 0.5]]]))  # after candidate 0, candidate 1 fits
    assert best_path(unary, pair)[0].tolist() == [0, 1]
    assert best_path(unary, torch.zeros(1, 2, 2))[0].tolist() == [0, 0]  # no pair information: top-1 each


@pytest.mark.parametrize(
    ("unary", "pair", "num_paths", "argument"),
    [
        (torch.zeros(3), torch.zeros(2, 1, 1), 1, "unary"),
        (torch.zeros(3, 2), torch.zeros(3, 2, 2), 1, "pair"),
        (torch.zeros(3, 2), torch.zeros(2, 2, 2), 0, "num_paths"),
    ],
)
def test_lattice_bad_shapes_name_the_argument(unary, pair, num_paths, argument):
    with pytest.raises(ValueError, match=argument):
        top_paths(unary, pair, num_paths)


# --- the head -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 2])
def test_cached_drafting_blocks_equal_the_training_computation(target, num_layers):
    # Training encodes a whole sequence once and masks the context per cut point; drafting
    # encodes it incrementally into caches. Both must give the same block for the same cut.
    head = parallel_head(target, block_size=3, num_layers=num_layers)
    hidden = target.config.hidden_size
    features, embeds = torch.randn(1, 12, hidden), torch.randn(1, 12, hidden)
    known_embeds, known = torch.randn(2, 3, hidden), torch.tensor([[False, True, False], [False, False, False]])
    cuts = torch.tensor([4, 9])  # context positions 0..t visible, block at t+1
    whole, outputs = head.encode_context(features, embeds)
    visible = torch.arange(12)[None] <= cuts[:, None]
    trained = head.draft_block(whole, outputs[0, cuts], cuts + 1, known_embeds, known, visible)
    caches = [LayerKVCache() for _ in range(num_layers)]
    head.encode_context(features[:, :3], embeds[:, :3], start=0, caches=caches)
    _, last = head.encode_context(features[:, 3:5], embeds[:, 3:5], start=3, caches=caches)
    first = head.draft_block([cached(c) for c in caches], last[:, -1], torch.tensor([5]), known_embeds[:1], known[:1])
    _, last = head.encode_context(features[:, 5:10], embeds[:, 5:10], start=5, caches=caches)
    second = head.draft_block([cached(c) for c in caches], last[:, -1], torch.tensor([10]), known_embeds[1:], known[1:])
    torch.testing.assert_close(torch.cat([first, second]), trained, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="position"):
        head.encode_context(features[:, :1], embeds[:, :1], start=3, caches=caches)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("mode", [None, "local", "fold"])
def test_last_only_catch_up_gives_the_last_output_and_the_same_caches(target, mode, num_layers):
    # A round's (and a prompt's) catch-up reads only the last row's output, the anchor: a one-layer
    # head gives the other rows keys and values only. The anchor and every cache must be what the
    # full catch-up leaves, so the next block (and the next catch-up) is unchanged.
    from verispec.drafters.far_memory import FarMemoryConfig

    head = parallel_head(target, block_size=3, num_layers=num_layers, seed=2)
    hidden = target.config.hidden_size
    far_memory = None if mode is None else FarMemoryConfig(mode, local_window=3, memory_temperature=0.5, memory_weight=2.0)
    generator = torch.Generator().manual_seed(3)
    features, embeds = torch.randn(1, 12, hidden, generator=generator), torch.randn(1, 12, hidden, generator=generator)
    full_caches, lean_caches = [LayerKVCache() for _ in head.layers], [LayerKVCache() for _ in head.layers]
    for first, end in ((0, 1), (1, 8), (8, 12)):  # a one-row prompt, then catch-ups of 7 and 4 rows
        _, full = head.encode_context(features[:, first:end], embeds[:, first:end], first, full_caches, far_memory=far_memory)
        context, lean = head.encode_context(features[:, first:end], embeds[:, first:end], first, lean_caches, far_memory=far_memory, last_only=True)
        assert lean.shape == (1, 1, hidden)
        torch.testing.assert_close(lean, full[:, -1:], atol=1e-5, rtol=1e-5)
        for full_cache, lean_cache in zip(full_caches, lean_caches):
            assert lean_cache.length == full_cache.length == end
            torch.testing.assert_close(lean_cache.keys[:, :end], full_cache.keys[:, :end], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lean_cache.values[:, :end], full_cache.values[:, :end], atol=1e-6, rtol=1e-6)
    blocks = [head.draft_block([cached(cache) for cache in caches], anchor[:, -1], torch.tensor([12]), far_memory=far_memory) for caches, anchor in ((full_caches, full), (lean_caches, lean))]
    torch.testing.assert_close(blocks[1], blocks[0], atol=1e-5, rtol=1e-5)
    assert len(context) == num_layers
    with pytest.raises(ValueError, match="last_only"):
        head.encode_context(features, embeds, last_only=True)


@pytest.mark.parametrize("slot_input", ["fc", "add"])
def test_a_known_slot_changes_its_neighbours_only_through_attention(target, slot_input):
    head = parallel_head(target, block_size=3, slot_input=slot_input)
    hidden = target.config.hidden_size
    context, outputs = head.encode_context(torch.randn(1, 5, hidden), torch.randn(1, 5, hidden))
    start, anchor = torch.tensor([5, 5]), outputs[:, -1]
    known = torch.tensor([[False, False, False], [True, False, False]])
    out = head.draft_block(context, anchor, start, torch.randn(2, 3, hidden), known)
    assert not torch.allclose(out[0, 1], out[1, 1])  # slot 1 reads the known token at slot 0
    torch.testing.assert_close(head.draft_block(context, anchor, start[:1])[0], out[0])  # no known slot: no effect


def test_slots_enter_through_fc_as_context_rows_do(target):
    # slot_input "fc": slot j's input is fc([token or mask embedding ; norm(anchor)]), the same
    # layer a context row (embed(x_{i+1}), f_i) goes through; a known slot carries its token's
    # embedding there. Files written before the key existed mean "add" (the old summed input).
    head = parallel_head(target, block_size=3)
    assert not hasattr(head, "known")
    hidden = target.config.hidden_size
    context, outputs = head.encode_context(torch.randn(1, 5, hidden), torch.randn(1, 5, hidden))
    anchor, token = outputs[:, -1], torch.randn(1, 3, hidden)
    known = torch.tensor([[False, True, False]])
    captured = []
    hook = head.layers[0].register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        head.draft_block(context, anchor, torch.tensor([5]), token, known)
    finally:
        hook.remove()
    guess = head.norm(anchor)[0]
    expected = head.fc(torch.stack([torch.cat((head.mask_embeds[0], guess)), torch.cat((token[0, 1], guess)), torch.cat((head.mask_embeds[2], guess))]))
    torch.testing.assert_close(captured[0][0], expected)
    fields = dataclasses.asdict(head.config)
    del fields["slot_input"]
    assert ParallelConfig(**fields).slot_input == "add" and hasattr(parallel_head(target, slot_input="add"), "known")


def test_slot_inputs_take_fc_in_its_own_precision(target):
    # A drafting copy's fc multiplies the feature half in bfloat16 (MixedPrecisionLinear): the
    # block's slot inputs must be that layer's output (its parts), not a float32 product of the
    # copy's float32 weight, and the mask slots' half kept from the float32 fc must not survive
    # the swap to the new layer.
    from verispec.models.quantize import MixedPrecisionLinear

    head = parallel_head(target, block_size=3)
    hidden = target.config.hidden_size
    context, outputs = head.encode_context(torch.randn(1, 5, hidden), torch.randn(1, 5, hidden))
    anchor = outputs[:, -1] * 40  # features this large are where bfloat16 and float32 products part
    with torch.no_grad():
        float_inputs = head._slot_inputs(anchor, 1, None, None)
        head.fc = MixedPrecisionLinear(head.fc, float32_columns=hidden)
        mixed = head._slot_inputs(anchor, 1, None, None)
        guess = head.norm(anchor)[0]
        expected = head.fc(torch.stack([torch.cat((head.mask_embeds[j], guess)) for j in range(3)]))[None]
    torch.testing.assert_close(mixed, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed, float_inputs, atol=1e-5, rtol=1e-5)


def test_slot_inputs_follow_the_weights(target):
    # fc is computed by halves (the mask slots' half separately): changed weights (an optimiser
    # step, load_state_dict) must show in the next block, and gradients must reach the masks —
    # anything that keeps W_e·m between blocks must follow the weights.
    head = parallel_head(target, block_size=3).requires_grad_(True)
    hidden = target.config.hidden_size
    context, outputs = head.encode_context(torch.randn(1, 5, hidden), torch.randn(1, 5, hidden))
    context, anchor, start = [(k.detach(), v.detach()) for k, v in context], outputs[:, -1].detach(), torch.tensor([5])
    with torch.inference_mode():
        before = head.draft_block(context, anchor, start)
        assert torch.equal(head.draft_block(context, anchor, start), before)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    head.draft_block(context, anchor, start).square().sum().backward()
    assert head.mask_embeds.grad is not None and head.mask_embeds.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        stepped = head.draft_block(context, anchor, start)
        assert not torch.allclose(stepped, before)
        fresh = parallel_head(target, block_size=3, seed=1)  # a head that never drafted
        fresh.load_state_dict(head.state_dict())
        torch.testing.assert_close(stepped, fresh.draft_block(context, anchor, start))
        other = parallel_head(target, block_size=3, seed=2)
        head.load_state_dict(other.state_dict())
        torch.testing.assert_close(head.draft_block(context, anchor, start), other.draft_block(context, anchor, start))
    # A fused AdamW step (what training runs) leaves the weights' in-place version as it was, so a
    # head being trained must not keep the rows even in its no-grad validation...
    optimizer = torch.optim.AdamW(head.parameters(), lr=0.5, fused=True)
    with torch.no_grad():
        before = head.draft_block(context, anchor, start)
    head.draft_block(context, anchor, start).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        fresh = parallel_head(target, block_size=3, seed=1)
        fresh.load_state_dict(head.state_dict())
        torch.testing.assert_close(head.draft_block(context, anchor, start), fresh.draft_block(context, anchor, start))
        assert not torch.allclose(head.draft_block(context, anchor, start), before)
        # ...while a frozen (drafting) head keeps them, and still follows load_state_dict.
        head.requires_grad_(False)
        kept = head.draft_block(context, anchor, start)
        assert head._mask_rows is not None and torch.equal(head.draft_block(context, anchor, start), kept)
        head.load_state_dict(other.state_dict())
        torch.testing.assert_close(head.draft_block(context, anchor, start), other.draft_block(context, anchor, start))


@pytest.mark.parametrize(("field", "value"), [("block_size", 0), ("num_layers", 3), ("slot_input", "concat")])
def test_bad_parallel_config_names_the_field(field, value):
    good = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=16, vocab_size=10)
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**good, **{field: value})


# --- the drafter on the engine ----------------------------------------------------------------------


@pytest.mark.parametrize(("block_size", "candidates", "correction"), [(1, 1, False), (4, 1, False), (4, 3, True), (3, 4, True), (4, 3, "eagle"), (4, 3, "successor"), (3, 96, "successor")])
def test_greedy_output_is_token_identical_to_plain(target, block_size, candidates, correction):
    corrector = fresh_head(target) if correction in ("eagle", "successor") else None
    drafter = ParallelDrafter(target, parallel_head(target, block_size=4), block_size=block_size, candidates=candidates, correction=bool(correction), corrector=corrector, path_rule=path_rule(correction))
    plain = SpeculativeDecoder(target)
    for gamma in (2, 5):
        decoder = SpeculativeDecoder(target, drafter, gamma=gamma)
        for prompt in ([7], list(range(10, 40))):  # a 1-token prompt has no features in its first round
            result = decoder.generate(prompt, 24, stop=[])
            assert result.token_ids == plain.generate(prompt, 24, stop=[]).token_ids
            assert all(0 <= a <= d <= min(gamma, block_size) for d, a in zip(result.stats.drafted_per_round, result.stats.accepted_per_round))
            assert all(1 <= a + 1 <= gamma + 1 for a in result.stats.accepted_per_round)  # 1..gamma+1 tokens per call


def test_draft_vocab_restricts_the_drafts_and_stays_exact(target):
    subset = torch.tensor([2, 5, 11, 40, 41, 60])
    drafter = ParallelDrafter(target, parallel_head(target), draft_vocab=subset, candidates=3)
    session = drafter.start([1, 2, 3], SamplingParams())
    with torch.no_grad():
        features = target.model(torch.tensor([[1, 2]])).last_hidden_state[0]
    proposal = session.propose(DraftContext([1, 2, 3], features, 0), 4, torch.Generator())
    assert len(proposal.tokens) == 4 and set(proposal.tokens) <= set(subset.tolist()) and proposal.probs is None
    prompt = list(range(20, 35))
    assert SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, 25, stop=[]).token_ids == SpeculativeDecoder(target).generate(prompt, 25, stop=[]).token_ids


def test_first_draft_from_the_anchor_is_eagles_readout_and_stays_exact(target):
    head = parallel_head(target, block_size=4)
    anchored = ParallelHead(dataclasses.replace(head.config, first_from_anchor=True))
    anchored.load_state_dict(head.state_dict())
    anchored.eval().requires_grad_(False)
    tokens = list(range(10, 30))
    with torch.no_grad():
        features = target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # f_0 .. f_{L-2}
        _, outputs = anchored.encode_context(features[None], target.get_input_embeddings()(torch.tensor([tokens[1:]])))
        expected_first = int(target.lm_head(anchored.norm(outputs[0, -1])).argmax())  # EAGLE's first draft

    def block(drafter):
        return drafter.start(tokens, SamplingParams()).propose(DraftContext(tokens, features, 0), 4, torch.Generator()).tokens

    from_anchor, from_slots = block(ParallelDrafter(target, anchored, correction=False)), block(ParallelDrafter(target, head, correction=False))
    assert from_anchor[0] == expected_first and from_anchor[1:] == from_slots[1:]  # only the first draft's source changes
    prompt = list(range(40, 60))
    for correction in (False, True):
        result = SpeculativeDecoder(target, ParallelDrafter(target, anchored, candidates=3, correction=correction), gamma=4).generate(prompt, 24, stop=[])
        assert result.token_ids == SpeculativeDecoder(target).generate(prompt, 24, stop=[]).token_ids


def test_int8_head_is_a_quantised_copy_and_stays_exact(target):
    head = parallel_head(target, block_size=4)
    drafter = ParallelDrafter(target, head, draft_vocab=torch.arange(0, VOCAB, 2), candidates=3, quantize=True)
    assert type(head.layers[0].q_proj) is torch.nn.Linear  # the caller's head is untouched
    assert "quantized" in type(drafter.head.layers[0].q_proj).__module__ and "quantized" in type(drafter.lm_head).__module__
    decoder = SpeculativeDecoder(target, drafter, gamma=4)
    prompt = list(range(20, 35))
    result = decoder.generate(prompt, 25, stop=[])
    assert result.token_ids == SpeculativeDecoder(target).generate(prompt, 25, stop=[]).token_ids
    assert result.stats.num_drafted > 0 and set(result.stats.drafted_per_round) - {0}


@pytest.mark.parametrize(("correction", "block_passes", "catch_up_passes"), [(False, 1, 1), (True, 2, 1), ("eagle", 2, 2)])
def test_one_block_pass_per_round_plus_one_for_correction(target, correction, block_passes, catch_up_passes):
    head, corrector = parallel_head(target, block_size=4), fresh_head(target) if correction == "eagle" else None
    calls, predictions = [], []
    hooks = [head.layers[0].input_norm.register_forward_hook(lambda *args: calls.append(1))]  # one per head pass (a catch-up needs no more than the layer's projections)
    if corrector is not None:  # one per corrector call: its catch-up, its batched pair-fit steps
        hooks.append(corrector.fc.register_forward_hook(lambda *args: calls.append(1)))
        hooks.append(corrector.o_proj.register_forward_hook(lambda *args: predictions.append(1)))  # the catch-up caches keys/values only
    try:
        session = ParallelDrafter(target, head, candidates=3, correction=bool(correction), corrector=corrector, path_rule="lattice").start([1, 2, 3, 4], SamplingParams())
        with torch.no_grad():
            features = target.model(torch.tensor([[1, 2, 3, 4, 5]])).last_hidden_state[0]
        first = session.propose(DraftContext([1, 2, 3, 4], features[:3], 0), 4, torch.Generator())
        assert len(first.tokens) == 4
        assert first.num_forward_passes == len(calls) == catch_up_passes + block_passes  # catch-up, then the block (+ correction)
        calls.clear()
        again = session.propose(DraftContext([1, 2, 3, 4, 5, 6], features[3:5], 3), 4, torch.Generator())
        assert again.num_forward_passes == len(calls) == catch_up_passes + block_passes
        assert len(predictions) == (2 if corrector is not None else 0)  # one pair fit a round, no catch-up prediction
        calls.clear()
        nothing_new = session.propose(DraftContext([1, 2, 3, 4, 5, 6]), 4, torch.Generator())
        assert nothing_new.num_forward_passes == len(calls) == block_passes  # no catch-up without new features
        assert len(session.propose(DraftContext([1, 2, 3, 4, 5, 6]), 1, torch.Generator()).tokens) == 1  # one draft: nothing to correct
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("correction", [True, "eagle"])
def test_path_stop_corrects_only_the_positions_it_could_keep(target, correction):
    # No path is likelier than the top-1 one: correction past where that falls below the threshold
    # would choose drafts nobody verifies. Rows the correction pass runs (head blocks or EAGLE steps)
    # are counted; a threshold no top-1 path reaches drafts exactly as without the stop.
    head, corrector = parallel_head(target, block_size=4), fresh_head(target) if correction == "eagle" else None
    with torch.no_grad():
        features = target.model(torch.tensor([[1, 2, 3, 4, 5]])).last_hidden_state[0]

    def propose(path_confidence, correction=True):
        drafter = ParallelDrafter(target, head, candidates=3, correction=correction, corrector=corrector if correction else None, path_confidence=path_confidence, path_rule="lattice")
        session = drafter.start([1, 2, 3, 4], SamplingParams())
        session.propose(DraftContext([1, 2, 3, 4], features[:3], 0), 4, torch.Generator())  # the catch-up
        rows = []
        module = corrector.o_proj if corrector is not None else head.layers[0]
        hook = module.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[0]))
        try:
            proposal = session.propose(DraftContext([1, 2, 3, 4]), 4, torch.Generator())
        finally:
            hook.remove()
        return proposal, rows[-1] if rows and (corrector is not None or len(rows) > 1) else 0  # the correction pass's rows

    unstopped, unstopped_rows = propose(None)
    assert unstopped_rows == 3 * 3 and len(unstopped.tokens) == 4  # (K-1)·m: every pair
    loose, loose_rows = propose(1e-30)
    assert loose.tokens == unstopped.tokens and loose_rows == unstopped_rows
    strict, strict_rows = propose(0.999999)  # the top-1 path falls below it at once: one draft, nothing to correct
    top_1, _ = propose(None, correction=False)
    assert strict.tokens == top_1.tokens[:1] and strict_rows == 0 and strict.num_forward_passes == 1


def session_with_caches_filled(target, drafter, drafts):
    """A session of ``drafter`` after one proposal of up to ``drafts`` on the context 1, 2, 3: its
    head's (and corrector's) caches hold those 3 rows, read by the pair-fit tests."""
    session = drafter.start([1, 2, 3], SamplingParams())
    with torch.no_grad():
        features = target.model(torch.tensor([[1, 2, 3, 4]])).last_hidden_state[0]
        session.propose(DraftContext([1, 2, 3, 4], features[:3], 0), drafts, torch.Generator())
    return session


def test_pair_fit_is_what_each_known_candidate_row_gives_alone(target):
    head = parallel_head(target, block_size=3)
    drafter = ParallelDrafter(target, head, candidates=2)
    session = session_with_caches_filled(target, drafter, 3)
    encoded, start = [cached(c) for c in session.caches], torch.tensor([3])
    index = torch.tensor([[5, 9], [1, 7], [3, 2]])  # candidates per position
    pair = _pair_fit(drafter, encoded, session.anchor, start, index[None], None)[0]
    for i, c in itertools.product(range(2), range(2)):
        known = torch.zeros(1, 3, dtype=torch.bool)
        known[0, i] = True
        embeds = torch.zeros(1, 3, target.config.hidden_size)
        embeds[0, i] = drafter.embed(index[i, c])
        following = head.draft_block(encoded, session.anchor, start, embeds, known)[0, i + 1]
        expected = (drafter.lm_head.weight[index[i + 1]] @ following).log_softmax(-1)
        torch.testing.assert_close(pair[i, c], expected, atol=1e-5, rtol=1e-5)


def eagle_step_by_hand(head, context_keys, context_values, feature, embed, position):
    """One EAGLE row at ``position`` attending to cached rows and itself, from the head's parts."""
    hidden = head.fc(torch.cat((embed, feature))[None])  # [1, hidden]
    normed = head.input_norm(hidden)
    config = head.config
    cos, sin = rotary_cos_sin(torch.tensor([float(position)]), head.inv_freq)
    query = apply_rotary(head.q_proj(normed).view(1, config.num_heads, config.head_dim).transpose(0, 1), cos, sin)  # [heads, 1, d]
    key = apply_rotary(head.k_proj(normed).view(1, config.num_kv_heads, config.head_dim).transpose(0, 1), cos, sin)
    value = head.v_proj(normed).view(1, config.num_kv_heads, config.head_dim).transpose(0, 1)
    keys, values = torch.cat((context_keys, key), 1), torch.cat((context_values, value), 1)  # [kv_heads, P+1, d]
    group = config.num_heads // config.num_kv_heads
    weights = (query @ keys.repeat_interleave(group, 0).transpose(-1, -2) / config.head_dim**0.5).softmax(-1)
    attended = (weights @ values.repeat_interleave(group, 0)).transpose(0, 1).reshape(1, -1)
    hidden = hidden + head.o_proj(attended)
    normed = head.post_attention_norm(hidden)
    return head.norm(hidden + head.down_proj(torch.nn.functional.silu(head.gate_proj(normed)) * head.up_proj(normed)))[0]


def test_eagle_corrector_scores_each_candidate_as_the_token_one_step_ahead(target):
    # pair[i, c, :] = the m candidates at i+1 read through the EAGLE step on (ĥ_i, embed(cand[i, c]))
    # at position L+i over the real context — computed here by hand; the i = 0 rows are also exactly
    # what the EAGLE drafter's own cached step gives.
    corrector = fresh_head(target, seed=4)
    drafter = ParallelDrafter(target, parallel_head(target, block_size=3), candidates=2, corrector=corrector, path_rule="lattice")
    session = session_with_caches_filled(target, drafter, 3)
    with torch.no_grad():
        context_keys, context_values = session.corrector_cache.keys[:, :3], session.corrector_cache.values[:, :3]
        slots = torch.randn(1, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(2))  # ĥ_i
        index = torch.tensor([[5, 9], [1, 7], [3, 2]])
        pair = _successor_fit(drafter, cached(session.corrector_cache), slots, torch.tensor([3]), index[None], None)[0]
        for i, c in itertools.product(range(2), range(2)):
            embed = drafter.embed(index[i, c]).float()
            following = eagle_step_by_hand(corrector, context_keys, context_values, slots[0, i], embed, 3 + i)
            expected = (target.lm_head.weight[index[i + 1]] @ following).log_softmax(-1)
            torch.testing.assert_close(pair[i, c], expected, atol=1e-5, rtol=1e-5)
            if i == 0:  # the drafting step proper: EagleHead.forward on a copy of the cache
                cache = LayerKVCache()
                cache.append(context_keys.clone(), context_values.clone())
                step = corrector(slots[:, :1], embed[None, None], start=3, cache=cache)[0, 0]
                torch.testing.assert_close((target.lm_head.weight[index[1]] @ step).log_softmax(-1), expected, atol=1e-5, rtol=1e-5)
        # a row sees only its visible context rows: hiding row 2 equals a 2-row context
        hidden_row = _successor_fit(drafter, cached(session.corrector_cache), slots, torch.tensor([3]), index[None], torch.tensor([[True, True, False]]))[0]
        short = (session.corrector_cache.keys[None, :, :2], session.corrector_cache.values[None, :, :2])
        torch.testing.assert_close(hidden_row, _successor_fit(drafter, short, slots, torch.tensor([3]), index[None], None)[0])


@pytest.mark.parametrize(("candidates", "first_from_anchor", "stop"), [(2, True, None), (VOCAB, True, None), (VOCAB, False, None), (VOCAB, True, 0.05)])
def test_successor_paths_follow_the_correctors_best_next_token_by_hand(target, candidates, first_from_anchor, stop):
    # path_rule "successor": path_0 is the block's top-1 at position 0; path_{i+1} = argmax over the
    # draft vocabulary of the LM head on the EAGLE step (ĥ_i, embed(path_i)) at position L+i — while
    # path_i is one of the block's m candidates at i (it has a fit row); the stop reads the path's
    # probability as q_0(path_0) · ∏ q(path_{i+1} | path_i). Runner-ups at i >= 1 are that successor
    # distribution's next best. Here every step is computed by hand from the head's parts.
    corrector = fresh_head(target, seed=4)
    torch.manual_seed(0)
    config = ParallelConfig.for_target(target.config, 24, block_size=4, first_from_anchor=first_from_anchor)
    head = ParallelHead(config).eval().requires_grad_(False)
    drafter = ParallelDrafter(target, head, candidates=candidates, corrector=corrector, path_rule="successor", path_confidence=stop)
    session = session_with_caches_filled(target, drafter, 4)
    keys, values = session.corrector_cache.keys[:, :3], session.corrector_cache.values[:, :3]
    encoded = [cached(cache) for cache in session.caches]
    with torch.no_grad():
        drafts = draft_paths(drafter, encoded, session.anchor, torch.tensor([3]), 4, width=3, corrector_context=cached(session.corrector_cache))
        hidden = head.draft_block(encoded, session.anchor, torch.tensor([3]))[0]  # [K, hidden]: ĥ_i
        if first_from_anchor:
            hidden = torch.cat((head.norm(session.anchor), hidden[1:]))
        block = (hidden @ target.lm_head.weight.T).log_softmax(-1)  # [K, vocab]: the block's q_i
        lattice = block.topk(candidates, dim=-1).indices  # [K, m]
        shortlist = block.topk(max(SUCCESSOR_CANDIDATES, candidates), dim=-1)  # [K, S]: the block's S likeliest
        path, log_probs, runner_ups = [int(block[0].argmax())], [float(block[0].max())], []
        while len(path) < 4 and path[-1] in lattice[len(path) - 1].tolist():
            i = len(path) - 1
            step = eagle_step_by_hand(corrector, keys, values, hidden[i], drafter.embed(torch.tensor(path[i])).float(), 3 + i)
            tokens = shortlist.indices[i + 1]
            # q(x | path_i) over the shortlist, weighted by the block's mass on it (all of it when S = vocab)
            successor = (target.lm_head.weight[tokens] @ step).log_softmax(-1) + shortlist.values[i + 1].logsumexp(-1)
            ranked = successor.topk(3)
            runner_ups += [(i + 1, int(tokens[j]), math.exp(sum(log_probs) + float(score))) for score, j in zip(ranked.values[1:], ranked.indices[1:])]
            path.append(int(tokens[ranked.indices[0]]))
            log_probs.append(float(ranked.values[0]))
    kept = len(path) if stop is None else next((n + 1 for n in range(len(path)) if sum(log_probs[: n + 1]) < math.log(stop)), len(path))
    assert int(drafts.lengths[0]) == kept
    assert drafts.tokens[0, :kept].tolist() == path[:kept]
    offered = path_runner_ups(drafts, 0, 2)[2:]  # after position 0's (the block's own runner-ups)
    expected = [r for r in runner_ups if r[0] < kept]
    assert [(i, token) for i, token, _ in offered] == [(i, token) for i, token, _ in expected]
    assert [score for *_, score in offered] == pytest.approx([score for *_, score in expected], rel=1e-4)
    if candidates == 2:
        assert len(path) < 4  # a successor outside the block's candidates ended the chain (this head, seed: at draft 2 or 3)
    if candidates == VOCAB:
        assert len(path) == 4  # every token has a row: the chain runs the block's length


@pytest.mark.parametrize("corrector_seed", [None, 4])
def test_a_pinned_first_draft_fits_one_row_at_position_0_and_picks_the_same_paths(target, corrector_seed):
    # With first_from_anchor the path keeps position 0's top-1, so of position 0's m fit rows only
    # candidate 0's is ever followed: computing it alone must leave every live score (pair[0, 0] and
    # all later positions) as it was, run (K-2)·m + 1 rows instead of (K-1)·m, and choose the same paths.
    corrector = None if corrector_seed is None else fresh_head(target, seed=corrector_seed)
    head = parallel_head(target, block_size=4)
    drafter = ParallelDrafter(target, head, candidates=3, corrector=corrector, path_rule="lattice")
    session = session_with_caches_filled(target, drafter, 4)
    with torch.no_grad():
        index = torch.tensor([[[5, 9, 2], [1, 7, 4], [3, 2, 8], [6, 0, 11]], [[8, 1, 3], [2, 9, 5], [7, 4, 1], [10, 3, 6]]])  # [B=2, K=4, m=3]
        starts = torch.tensor([3, 3])
        rows = []
        module = corrector.o_proj if corrector is not None else head.layers[0]
        hook = module.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[0]))
        try:
            if corrector is None:
                encoded, anchors = [cached(c) for c in session.caches], session.anchor.expand(2, -1)
                full, pinned = (_pair_fit(drafter, encoded, anchors, starts, index, None, first_pinned=flag) for flag in (False, True))
            else:
                slots = torch.randn(2, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(2))  # ĥ_i
                context = cached(session.corrector_cache)
                full, pinned = (_successor_fit(drafter, context, slots, starts, index, None, first_pinned=flag) for flag in (False, True))
        finally:
            hook.remove()
    assert rows == [2 * 3 * 3, 2 * (2 * 3 + 1)]
    torch.testing.assert_close(pinned[:, 1:], full[:, 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pinned[:, 0, 0], full[:, 0, 0], atol=1e-5, rtol=1e-5)
    generator = torch.Generator().manual_seed(7)
    for row in range(2):
        for _ in range(20):
            unary = torch.randn(4, 3, generator=generator)
            unary[0, 1:] = -math.inf  # pinned: draft_paths' rule
            assert best_path(unary, pinned[row])[0].tolist() == best_path(unary, full[row])[0].tolist()


@pytest.mark.parametrize(
    ("correction", "candidates", "path"),
    [(False, 1, None), (True, 3, None), ("eagle", 3, None), (False, 1, 0.9), ("eagle", 3, 0.9), ("successor", 3, None), ("successor", 3, 0.9)],
)
def test_replayed_rounds_are_the_rounds_greedy_decoding_runs(target, trained_head, correction, candidates, path):
    # Teacher-forced replay (parallel eval) must count exactly the drafts the engine accepts on
    # the target's own greedy answer: same rounds, same drafted and accepted per round — also
    # where the path stop ends rounds early (path 0.9: most rounds).
    from verispec.drafters.eagle.acceptance import replay_rounds, target_choices

    torch.manual_seed(3)
    config = ParallelConfig.for_target(target.config, trained_head.config.intermediate_size, block_size=3, first_from_anchor=True)
    head = ParallelHead(config)
    head.load_eagle(trained_head)  # drafts the first token as the trained EAGLE head does: some rounds accept
    drafter = ParallelDrafter(
        target, head.eval().requires_grad_(False), candidates=candidates, correction=bool(correction), corrector=corrector_for(correction, trained_head), path_confidence=path,
        path_rule=path_rule(correction),
    )  # fmt: skip
    prompt = [5, 17, 3, 40, 22, 9, 31]
    result = SpeculativeDecoder(target, drafter, gamma=3).generate(prompt, 30, stop=[])
    text = prompt + result.token_ids[:-1]  # the last token is emitted, never fed
    with torch.no_grad():
        features = target.model(torch.tensor([text])).last_hidden_state[0]
    choice = target_choices(features, target.get_output_embeddings().weight)
    drafted, accepted = accepted_from_every_start(drafter, torch.tensor(text), features, 3, choice, starts_per_call=4)
    later = accepted_from_every_start(drafter, torch.tensor(text), features, 3, choice, first_row=len(prompt) - 2)
    assert all(torch.equal(part[len(prompt) - 2 :], whole[len(prompt) - 2 :]) for part, whole in zip(later, (drafted, accepted)))
    rounds = replay_rounds(accepted, len(prompt) - 2, len(text) + 1, 3, drafted)
    engine_rounds = list(zip(result.stats.drafted_per_round, result.stats.accepted_per_round))
    assert rounds == engine_rounds
    assert sum(accepted for _, accepted in rounds) > 0  # the test sees acceptance, not only rejections
    full_rounds = sum(1 for num_drafted, _ in rounds[:-3] if num_drafted == 3)  # the last rounds may be cut by the text's end
    # (a successor chain also ends where its token is not one of the block's candidates)
    assert (full_rounds < len(rounds) - 3) if path is not None or correction == "successor" else (full_rounds == len(rounds) - 3)
    with pytest.raises(ValueError, match="gamma"):
        accepted_from_every_start(drafter, torch.tensor(text), features, 0, choice)


def test_sampled_tokens_follow_the_target_distribution():
    # The corrected path is a deterministic draft: the verifier's one-hot rule keeps the output exact.
    sampling = SamplingParams(temperature=0.9, top_p=0.9)
    target = tiny_target(seed=4, vocab_size=SMALL_VOCAB, sharpness=1.5)
    prompt = [1, 3, 2, 1, 3, 2, 1]
    expected = _exact_first_two(target, prompt, sampling)
    decoder = SpeculativeDecoder(target, ParallelDrafter(target, parallel_head(target, block_size=2, seed=3), candidates=3), gamma=2)
    runs = RUNS // 2  # half the engine's runs keep this under a minute; a biased rule still fails by far
    counts, accepted = _sample_first_two(decoder, prompt, sampling, runs)
    assert 0.05 * runs < accepted < runs  # the drafts are neither always right nor always wrong
    assert goodness_of_fit_pvalue(counts.numpy(), expected.numpy()) > SIGNIFICANCE


def test_path_stop_keeps_the_path_up_to_its_first_draft_below_the_threshold():
    # Path probabilities 0.5, 0.25, 0.225 (row 0) and 0.9, 0.81, 0.729 (row 1): the draft that takes
    # the path below the threshold is kept (as the EAGLE head's rule), nothing after it.
    path_log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.9, 0.9, 0.9]])).cumsum(-1)
    assert path_lengths(path_log_probs, 0.3).tolist() == [2, 3]
    assert path_lengths(path_log_probs, 0.6).tolist() == [1, 3]
    assert path_lengths(path_log_probs, 0.85).tolist() == [1, 2]
    assert path_lengths(path_log_probs, 0.95).tolist() == [1, 1]  # at least one draft
    assert path_lengths(path_log_probs, None).tolist() == [3, 3]


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"block_size": 5}, "block_size"), ({"block_size": 0}, "block_size"), ({"candidates": 0}, "candidates"), ({"candidates": 97}, "candidates"),
        ({"path_confidence": 1.0}, "path_confidence"), ({"path_confidence": -0.1}, "path_confidence"),
        ({"path_rule": "viterbi"}, "path_rule"), ({"path_rule": "successor"}, "path_rule 'successor' .* corrector"),
    ],  # fmt: skip
)
def test_bad_drafter_options_name_the_option(target, options, argument):
    with pytest.raises(ValueError, match=argument):
        ParallelDrafter(target, parallel_head(target, block_size=4), **options)


def test_feature_drafters_refuse_a_head_of_the_wrong_kind_or_width(target):
    with pytest.raises(ValueError, match="instance of ParallelHead"):
        ParallelDrafter(target, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="instance of EagleHead"):
        EagleDrafter(target, parallel_head(target))
    wide = ParallelHead(dataclasses.replace(parallel_head(target).config, hidden_size=2 * target.config.hidden_size))
    with pytest.raises(ValueError, match="does not match the target"):
        ParallelDrafter(target, wide)
    with pytest.raises(ValueError, match="instance of EagleHead"):
        ParallelDrafter(target, parallel_head(target), corrector=parallel_head(target))
    with pytest.raises(ValueError, match="does not match the target"):
        ParallelDrafter(target, parallel_head(target), corrector=EagleHead(dataclasses.replace(fresh_head(target).config, hidden_size=2 * target.config.hidden_size)))
    with pytest.raises(ValueError, match="corrector .*correction=True"):
        ParallelDrafter(target, parallel_head(target), correction=False, corrector=fresh_head(target))
    # The path rule unless told: successors with an EAGLE corrector, the lattice without one.
    assert ParallelDrafter(target, parallel_head(target), corrector=fresh_head(target)).path_rule == PARALLEL_PATH_RULE == "successor"
    assert ParallelDrafter(target, parallel_head(target)).path_rule == "lattice"


# --- checkpoints and training ---------------------------------------------------------------------------


@pytest.mark.parametrize("slot_input", ["fc", "add"])
def test_checkpoint_round_trip_and_refusals(target, tmp_path, slot_input):
    head = parallel_head(target, block_size=3, num_layers=2, slot_input=slot_input)
    path = save_parallel_head(tmp_path / "parallel.safetensors", head, draft_vocab=torch.arange(10), fingerprint=target_fingerprint(target))
    loaded, vocab = load_parallel_head(path, target)
    torch.testing.assert_close(loaded.state_dict(), head.state_dict())
    assert loaded.config == head.config and vocab.tolist() == list(range(10))
    with pytest.raises(EagleHeadMismatchError, match="different target"):
        load_parallel_head(path, noisy_copy(target, noise=0.05))
    with pytest.raises(EagleHeadMismatchError, match="vocab_size"):
        ParallelDrafter(tiny_target(vocab_size=VOCAB + 4), path)
    eagle = save_head(tmp_path / "eagle.safetensors", fresh_head(target), draft_vocab=None, fingerprint=target_fingerprint(target))
    with pytest.raises(ValueError, match="not a verispec parallel head"):
        load_parallel_head(eagle, target)


def test_default_parallel_head_is_the_one_trained_here_else_the_bundled_one(tmp_path):
    from verispec.drafters.parallel import bundled_parallel_path, default_parallel_path, existing_parallel_path

    cache, bundled = tmp_path / "cache", tmp_path / "bundled"
    with pytest.raises(FileNotFoundError, match="none bundled.*parallel train --target tiny"):
        existing_parallel_path(None, "tiny", cache, bundled)
    bundled.mkdir()
    (bundled / "tiny.safetensors").write_bytes(b"eagle")  # the bundled EAGLE head is not a parallel head
    with pytest.raises(FileNotFoundError, match="none bundled"):
        existing_parallel_path(None, "tiny", cache, bundled)
    bundled_parallel_path("tiny", bundled).write_bytes(b"parallel")
    assert existing_parallel_path(None, "tiny", cache, bundled) == bundled / "tiny.parallel.safetensors"
    trained = default_parallel_path("tiny", cache)
    trained.parent.mkdir(parents=True)
    trained.write_bytes(b"parallel")
    assert existing_parallel_path(None, "tiny", cache, bundled) == trained  # the user's own head wins
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        existing_parallel_path(tmp_path / "nowhere.safetensors", "tiny", cache, bundled)


def test_the_bundled_parallel_head_is_a_bfloat16_head_sharing_the_bundled_eagle_heads_vocabulary():
    from test_eagle import read_bundled_head
    from verispec.drafters.eagle.checkpoint import bundled_head_path
    from verispec.drafters.parallel import bundled_parallel_path
    from verispec.models import DEFAULT_TARGET

    config, draft_vocab = read_bundled_head(bundled_parallel_path(DEFAULT_TARGET), "verispec-parallel-1")
    config = ParallelConfig(**config)
    assert (config.hidden_size, config.vocab_size, config.block_size, config.first_from_anchor) == (1536, 151936, 5, True)
    _, eagle_vocab = read_bundled_head(bundled_head_path(DEFAULT_TARGET), "verispec-eagle-1")
    assert torch.equal(draft_vocab, eagle_vocab)  # the EAGLE pair fit reads the same tokens


def test_anchor_loss_is_eagles_objective_on_each_blocks_anchor(target):
    """The block loss plus anchor_weight x (CE + feature_weight x SmoothL1) of norm(h_t) against f_{t+1}."""
    head = parallel_head(target, block_size=3)
    rows = target.get_output_embeddings().weight[: VOCAB // 2]  # a reduced draft vocabulary
    tokens = torch.arange(10, 40)
    with torch.no_grad():
        features = target.model(tokens[None]).last_hidden_state[0]  # [30, hidden]
    losses, metrics = {}, {}
    for weight in (0.0, 2.0):
        settings = ParallelTrainSettings(block_size=3, cuts_per_sequence=6, anchor_weight=weight)
        objective = BlockObjective(head, target.get_input_embeddings(), rows, settings)
        losses[weight], metrics[weight] = objective(tokens, features, None)  # evenly spaced cuts, no known slots
    cuts = torch.linspace(0, len(tokens) - 2 - 3, 6).round().long().unique()
    with torch.no_grad():
        _, outputs = head.encode_context(features[None, :-1], target.get_input_embeddings()(tokens[None, 1:]))
        anchor = head.norm(outputs[0, cuts])
        expected_ce = -(torch.softmax(features[cuts + 1] @ rows.T, -1) * torch.log_softmax(anchor @ rows.T, -1)).sum(-1)
        expected = expected_ce + 0.1 * torch.nn.functional.smooth_l1_loss(anchor, features[cuts + 1], reduction="none").mean(-1)
        expected_agree = ((anchor @ rows.T).argmax(-1) == (features[cuts + 1] @ rows.T).argmax(-1)).float().sum()
    assert float(losses[2.0] - losses[0.0]) == pytest.approx(2.0 * float(expected.mean()), rel=1e-4)
    assert metrics[0.0]["anchor_agree"] == metrics[2.0]["anchor_agree"] == float(expected_agree) and metrics[2.0]["anchors"] == len(cuts)
    with pytest.raises(ValueError, match="anchor_weight"):
        ParallelTrainSettings(anchor_weight=-1.0)


def test_training_lowers_the_loss_resumes_and_drafts(target, tmp_path):
    loaded = LoadedModel(target, words_tokenizer(), "tiny", None)
    extract_features(loaded, documents(40), tmp_path / "features", ExtractSettings(max_tokens=1600), progress=False)
    eagle_path = save_head(tmp_path / "eagle.safetensors", fresh_head(target, intermediate_size=32), draft_vocab=torch.arange(0, VOCAB, 2), fingerprint=target_fingerprint(target))
    settings = ParallelTrainSettings(
        epochs=3, lr=1e-2, warmup_steps=2, sequences_per_step=2, cuts_per_sequence=16, block_size=3, intermediate_size=32,
        init_from_eagle=True, checkpoint_every=5, validation_fraction=0.1,
    )  # fmt: skip
    out = tmp_path / "parallel.safetensors"
    result = train_parallel_head(target, tmp_path / "features", out, settings, eagle_head=eagle_path, progress=False)
    before, after = result["validation_before"], result["validation"]
    assert after["kl"] < 0.7 * before["kl"]  # KL(p_target || q_draft): the loss above its floor
    assert sum(after["top1_by_slot"]) > sum(before["top1_by_slot"]) and len(after["top1_by_slot"]) == 3
    assert 0.0 <= after["top1_anchor"] <= 1.0
    head, vocab = load_parallel_head(out, target)
    assert vocab.tolist() == list(range(0, VOCAB, 2))  # the EAGLE head's draft vocabulary
    assert head.config.first_from_anchor  # trained with the anchor loss: drafts its first token from the anchor
    again = train_parallel_head(target, tmp_path / "features", out, settings, eagle_head=eagle_path, progress=False)
    assert again["steps"] == result["steps"] and again["validation"]["loss"] == pytest.approx(after["loss"])  # finished: resumed, not redone
    with pytest.raises(ValueError, match="other settings"):
        train_parallel_head(target, tmp_path / "features", out, ParallelTrainSettings(**{**settings.__dict__, "lr": 1e-3}), eagle_head=eagle_path, progress=False)
    with pytest.raises(ValueError, match="init_from_eagle"):
        train_parallel_head(target, tmp_path / "features", tmp_path / "other.safetensors", settings, progress=False)
    decoder = SpeculativeDecoder(target, ParallelDrafter(target, head, candidates=2), gamma=3)
    assert decoder.generate([1, 2, 3], 20, stop=[]).token_ids == SpeculativeDecoder(target).generate([1, 2, 3], 20, stop=[]).token_ids


@pytest.mark.parametrize(("field", "value"), [("block_size", 0), ("known_fraction", 1.0), ("num_layers", 3), ("cuts_per_sequence", 0)])
def test_bad_train_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ParallelTrainSettings(**{field: value})


# --- command line and costs ----------------------------------------------------------------------------


def test_cli_drafts_with_a_parallel_head_and_refuses_bad_options(tmp_path, capsys):
    from tiny_models import write_tiny_qwen2_gguf
    from verispec.cli import main
    from verispec.models import load_model

    gguf = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(gguf)
    model = load_model(str(gguf)).model
    head = parallel_head(model, block_size=3)
    path = save_parallel_head(tmp_path / "parallel.safetensors", head, draft_vocab=None, fingerprint=target_fingerprint(model))
    common = ["generate", "--target", str(gguf), "--max-new-tokens", "10", "--raw", "hello the"]
    assert main([*common, "--draft", "none"]) == 0
    plain = capsys.readouterr().out
    eagle = save_head(tmp_path / "eagle.safetensors", fresh_head(model), draft_vocab=None, fingerprint=target_fingerprint(model))
    by_eagle = ["--pair-fit", "eagle", "--eagle-head", str(eagle)]
    fold = ["--draft-attention", "fold", "--local-window", "2"]  # far memory for the head and its corrector
    for extra in ([], ["--no-correction"], ["--block-size", "2", "--candidates", "2"], by_eagle, [*by_eagle, *fold], [*by_eagle, "--path-rule", "lattice"]):
        assert main([*common, "--drafter", "parallel", "--parallel-head", str(path), *extra]) == 0
        assert capsys.readouterr().out == plain
    refused = (
        (["--block-size", "4"], "block_size"), (["--candidates", "0"], "--candidates"), (["--parallel-head", str(tmp_path / "none")], "parallel head"),
        ([*by_eagle, "--no-correction"], "--pair-fit eagle"), (["--pair-fit", "eagle", "--eagle-head", str(tmp_path / "none")], "none"),
        (["--pair-fit", "parallel", "--path-rule", "successor"], "--path-rule successor"), ([*by_eagle, "--path-rule", "best"], "--path-rule"),
    )  # fmt: skip
    for extra, message in refused:
        arguments = [*common, "--drafter", "parallel", "--parallel-head", str(path), *extra]
        try:
            code = main(arguments)
        except SystemExit as exit_:  # refused by argparse at parse time
            code = exit_.code
        assert code == 2
        err = capsys.readouterr().err
        assert "error:" in err and message in err and "Traceback" not in err
    # `verispec parallel eval`: replayed tau per drafter on the target's recorded answers.
    evaluate = ["parallel", "eval", "--target", str(gguf), "--cache-dir", str(tmp_path), "--parallel-head", str(path), "--num-prompts", "2", "--max-new-tokens", "8", "--gamma", "5"]
    assert main([*evaluate, "--no-eagle"]) == 0
    out, err = capsys.readouterr()
    assert "answers: 0 read from" in err and "2 recorded there" in err
    assert "parallel (parallel.safetensors), up to 3 drafts a round, 8 new tokens" in out and "parallel-corrected (m=3)" in out and "eagle" not in out
    assert out.count("2 prompts  tau") == 2
    assert main([*evaluate, "--eagle-head", str(eagle)]) == 0
    out, err = capsys.readouterr()
    assert "answers: 2 read from" in err and "0 recorded there" in err  # the first evaluation's recordings
    assert "parallel-corrected, EAGLE pair fit (m=3)" in out and "parallel-corrected, EAGLE successors (m=3)" in out
    assert "eagle (eagle.safetensors), up to 5 drafts a round" in out
    assert out.count("2 prompts  tau") == 5
    assert main([*evaluate, "--no-eagle", "--path-confidence", "0.5"]) == 0  # the parallel drafters' path stop
    out = capsys.readouterr().out
    assert "up to 3 drafts a round (path stop 0.5)" in out and "drafts/round" in out
    for extra, message in ((["--gamma", "0"], "--gamma"), (["--eagle-head", str(tmp_path / "none")], "--eagle-head"), (["--path-confidence", "1"], "--path-confidence")):
        assert main([*evaluate, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # `verispec costs` times the head's drafting per proposed token, float32 and int8, with and without correction.
    costs = ["costs", "--target", str(gguf), "--draft", "none", "--parallel-head", str(path), "--cache-dir", str(tmp_path),
             "--context", "8", "--tokens", "1", "--repeats", "1"]  # fmt: skip
    assert main(costs) == 0
    out = capsys.readouterr().out
    assert "rounds of 3 drafts" in out
    assert all(f"{name}, {precision}" in out for name in ("parallel", "parallel-corrected") for precision in ("float32", "int8"))
    assert main([*costs, "--eagle-head", str(eagle)]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}, {precision}" in out for name in ("parallel-corrected-eagle", "eagle") for precision in ("float32", "int8"))


def test_pair_fit_auto_takes_the_eagle_head_when_the_target_has_one(tmp_path, capsys):
    import argparse

    from verispec.parallel_cli import parallel_corrector_path

    eagle = tmp_path / "eagle.safetensors"
    eagle.write_bytes(b"")  # only looked up here, never loaded

    def corrector(pair_fit: str, eagle_head=None, correction: bool = True, drafter: str = "parallel"):
        args = argparse.Namespace(drafter=drafter, pair_fit=pair_fit, correction=correction, eagle_head=eagle_head, target=str(tmp_path / "tiny.gguf"), cache_dir=tmp_path)
        return parallel_corrector_path(args)

    assert corrector("auto", eagle) == eagle and corrector("eagle", eagle) == eagle
    assert corrector("auto") is None  # no EAGLE head for this target anywhere: the parallel head's own fit, said so
    assert "scores its pair fit with the parallel head" in capsys.readouterr().err
    assert corrector("parallel", eagle) is None and corrector("auto", eagle, correction=False) is None and corrector("auto", eagle, drafter="eagle") is None
    with pytest.raises(ValueError, match="--pair-fit eagle"):
        corrector("eagle", eagle, correction=False)
    with pytest.raises(FileNotFoundError):
        corrector("eagle")  # asked for by name: no head is an error, not a fallback
    with pytest.raises(FileNotFoundError):
        corrector("auto", tmp_path / "missing.safetensors")  # a named head must exist


def test_proposal_cost_times_drafting_only(target):
    from verispec.bench.costs import proposal_cost

    head = parallel_head(target, block_size=4)
    calls = []
    hook = head.layers[0].input_norm.register_forward_hook(lambda *args: calls.append(1))  # one per head pass
    try:
        seconds = proposal_cost(ParallelDrafter(target, head, correction=False), context_tokens=20, num_drafts=4, repeats=3)
    finally:
        hook.remove()
    assert seconds > 0
    assert len(calls) == 2 + 4  # the untimed catch-up round (catch-up + block), then warm-up + 3 timed block passes
    assert proposal_cost(EagleDrafter(target, fresh_head(target)), context_tokens=20, num_drafts=4, repeats=3) > 0


# --- served in batches ------------------------------------------------------------------------------


def _anchored_drafter(target, trained_head, correction, far_memory=None):
    """A parallel drafter whose head starts from the trained EAGLE head (first drafts from the
    anchor: some rounds accept); ``correction`` False, True (its own pair fit) or "eagle"."""
    config = ParallelConfig.for_target(target.config, trained_head.config.intermediate_size, block_size=3, first_from_anchor=True)
    torch.manual_seed(3)  # the same mask slots in every drafter built here
    head = ParallelHead(config)
    head.load_eagle(trained_head)
    return ParallelDrafter(
        target, head.eval().requires_grad_(False), candidates=3, correction=bool(correction), corrector=corrector_for(correction, trained_head), far_memory=far_memory,
        path_rule=path_rule(correction),
    )  # fmt: skip


def _feature_drafter(kind, model, trained_head):
    from verispec.drafters import lookup_then_model

    if kind == "eagle":
        return EagleDrafter(model, trained_head)
    if kind == "ngram+eagle":
        return lookup_then_model(EagleDrafter(model, trained_head))
    return _anchored_drafter(model, trained_head, {"parallel-corrected-eagle": "eagle", "parallel-successor": "successor"}.get(kind, True))


@pytest.mark.parametrize("batching", ["masked", "lean"])
@pytest.mark.parametrize("kind", ["eagle", "ngram+eagle", "parallel", "parallel-corrected-eagle", "parallel-successor"])
def test_served_in_batches_every_request_gets_its_greedy_text_alone(target, trained_head, kind, batching):
    # `verispec serve --drafter eagle|ngram+eagle|parallel`: rows of different lengths join and share
    # every verification pass, each hands its own drafter session the features of its own rows.
    from scheduling import serve_all

    from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels
    from verispec.serving import BatchGammaPolicy, LeanBatchedTarget, Scheduler, SchedulerConfig

    if batching == "lean":
        if panel_kernels_unavailable_reason() is not None:
            pytest.skip(f"panel kernels: {panel_kernels_unavailable_reason()}")
        model = use_panel_kernels(tiny_target(vocab_size=VOCAB))  # the same weights as `target`, own instance
    else:
        model = target
    prompts = [[(7 * i + k) % VOCAB for k in range(3 + i % 4)] for i in (1, 4, 6)] + [[(7 * 2 + k) % VOCAB for k in range(3)] * 3]
    plain = SpeculativeDecoder(model)
    expected = [plain.generate(prompt, 24, stop=[]).token_ids for prompt in prompts]
    config = SchedulerConfig(gamma=3, gamma_policy=BatchGammaPolicy(full_until=8, off_from=40), adaptive_gamma=False)
    scheduler = Scheduler(model, _feature_drafter(kind, model, trained_head), None, config)
    assert isinstance(scheduler.target, LeanBatchedTarget) == (batching == "lean")
    try:
        answers = serve_all(scheduler, prompts, 24)
    finally:
        scheduler.stop()
    assert [tokens for tokens, _ in answers] == expected
    stats = [step.stats for _, step in answers]
    assert all(1 <= accepted + 1 <= 4 for s in stats for accepted in s.accepted_per_round)
    assert sum(s.num_drafted for s in stats) > 0 and sum(s.num_accepted for s in stats) > 0  # drafts were verified and some kept


def test_sequence_prefixes_attend_each_entry_to_its_own_prefix_and_a_shared_prefix_is_read_once():
    from verispec.drafters.shared_prefix import SequencePrefixes, for_rows, shared_prefix_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, rows = 4, 2, 8, 3
    prefixes = [(torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)) for length in (5, 0, 9)]
    counts = [2, 1, 3]
    query = torch.randn(sum(counts), heads, rows, dim)
    own = (torch.randn(sum(counts), kv_heads, rows, dim), torch.randn(sum(counts), kv_heads, rows, dim))
    for causal in (False, True):
        together = shared_prefix_attention(query, SequencePrefixes(prefixes, counts), None, own, causal)
        first = 0
        for prefix, count in zip(prefixes, counts):
            entries = slice(first, first + count)
            alone = shared_prefix_attention(query[entries], prefix if prefix[0].shape[2] else None, None, (own[0][entries], own[1][entries]), causal)
            torch.testing.assert_close(together[entries], alone, atol=1e-6, rtol=1e-6)
            first += count
        # one prefix for the whole batch (stacked rows, one product): as each entry with its own copy
        shared = prefixes[2]
        visible = torch.rand(sum(counts), 1, 1, 9) > 0.3
        visible[:, :, :, 0] = True
        once = shared_prefix_attention(query, shared, visible, own, causal)
        for entry in range(sum(counts)):
            each = shared_prefix_attention(query[entry : entry + 1], shared, visible[entry : entry + 1], (own[0][entry : entry + 1], own[1][entry : entry + 1]), causal)
            torch.testing.assert_close(once[entry : entry + 1], each, atol=1e-6, rtol=1e-6)
    assert for_rows(SequencePrefixes(prefixes, counts), 4).counts == [8, 4, 12] and for_rows(shared, 4) is shared
    with pytest.raises(ValueError, match="do not add up"):
        shared_prefix_attention(query, SequencePrefixes(prefixes, [1, 1, 1]), None, own, False)
    with pytest.raises(ValueError, match="prefix_visible must be None"):
        shared_prefix_attention(query, SequencePrefixes(prefixes, counts), visible, own, False)
    with pytest.raises(ValueError, match="one prefix per sequence"):
        SequencePrefixes(prefixes, [2, 1])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_head_encodes_many_sequences_as_each_alone(target, num_layers):
    head = parallel_head(target, num_layers=num_layers, seed=2)
    hidden = target.config.hidden_size
    lengths, new_rows = (3, 1, 6), (1, 3, 2)
    caches = [[LayerKVCache() for _ in head.layers] for _ in lengths]
    alone_caches = [[LayerKVCache() for _ in head.layers] for _ in lengths]
    for length, mine, theirs in zip(lengths, caches, alone_caches):  # three sequences, each with caches of its own length
        features, embeds = torch.randn(1, length, hidden), torch.randn(1, length, hidden)
        head.encode_context(features, embeds, 0, mine)
        head.encode_context(features, embeds, 0, theirs)
    features = [torch.randn(count, hidden) for count in new_rows]
    embeds = [torch.randn(count, hidden) for count in new_rows]
    together = head.encode_many(features, embeds, caches)  # [3, hidden]: each sequence's last output
    for row, (length, layers) in enumerate(zip(lengths, alone_caches)):
        _, outputs = head.encode_context(features[row][None], embeds[row][None], length, layers)
        torch.testing.assert_close(together[row], outputs[0, -1], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(caches[row], layers):
            assert mine.length == theirs.length == length + new_rows[row]
            torch.testing.assert_close(mine.keys[:, : mine.length], theirs.keys[:, : theirs.length], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values[:, : mine.length], theirs.values[:, : theirs.length], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="1\\+ rows"):
        head.encode_many(features, embeds, caches[:2])
    with pytest.raises(ValueError, match="1\\+ rows"):
        head.encode_many([features[0], torch.randn(0, hidden)], embeds[:2], caches[:2])


def test_lockstep_groups_keep_seeded_sampling_and_far_memory_alone_unless_the_drafter_takes_it():
    from types import SimpleNamespace

    from verispec.drafters.base import lockstep_groups
    from verispec.drafters.far_memory import FarMemoryConfig

    one, other = object(), object()
    session = lambda drafter, far_memory=None, sampling=SamplingParams(): SimpleNamespace(drafter=drafter, far_memory=far_memory, sampling=sampling)  # noqa: E731
    sessions = [
        session(one),
        session(other),
        session(one, FarMemoryConfig("fold")),  # its own attention path: alone
        session(one, FarMemoryConfig("full")),  # attends as trained: together
        session(one, sampling=SamplingParams(temperature=0.8, seed=3)),  # seeded sampled: alone
        session(one, sampling=SamplingParams(temperature=0.8)),
        session(other, sampling=SamplingParams(seed=3)),  # greedy: a seed changes nothing
    ]
    assert sorted(lockstep_groups(sessions)) == [[0, 3, 5], [1, 6], [2], [4]]
    # A drafter whose batched calls attend each session as it attends alone (EAGLE's) takes far memory along.
    assert sorted(lockstep_groups(sessions, far_memory_together=True)) == [[0, 2, 3, 5], [1, 6], [4]]


def _round_contexts(target, prompts, extra):
    """Each prompt's first round (its features so far), and a second round after ``extra`` more tokens."""
    with torch.no_grad():
        first = [DraftContext(p, target.model(torch.tensor([p[:-1]])).last_hidden_state[0] if len(p) > 1 else None, 0) for p in prompts]
        second = []
        for prompt, more in zip(prompts, extra):
            tokens = prompt + more
            features = target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
            start = max(0, len(prompt) - 1)
            second.append(DraftContext(tokens, features[start:], start))
    return first, second


@pytest.mark.parametrize(("correction", "quantize"), [(False, False), (True, False), ("eagle", False), ("successor", False), (True, True)])
def test_sessions_drafted_together_propose_what_each_proposes_alone(target, trained_head, correction, quantize):
    from verispec.drafters.base import propose_batch

    config = ParallelConfig.for_target(target.config, trained_head.config.intermediate_size, block_size=3, first_from_anchor=True)
    torch.manual_seed(3)
    head = ParallelHead(config)
    head.load_eagle(trained_head)
    drafter = ParallelDrafter(
        target, head.eval().requires_grad_(False), candidates=3, correction=bool(correction), corrector=corrector_for(correction, trained_head), alternatives=1, quantize=quantize,
        path_rule=path_rule(correction),
    )  # fmt: skip
    long_prompt = [(5 * k + 1) % VOCAB for k in range(70)]  # more rows than a round's: its catch-up runs alone
    prompts = [[1, 2, 3, 4], [7, 8], long_prompt, [20, 21, 22], [30]]
    samplings = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    rounds = _round_contexts(target, prompts, [[40, 41], [42], [43, 44, 45], [46, 47], [48, 49]])
    budgets = [[3, 2, 3, 3, 3], [1, 3, 2, 3, 3]]  # the planner gives each request its own number of drafts
    runs = []
    for together in (False, True):
        sessions = [drafter.start(p, sampling) for p, sampling in zip(prompts, samplings)]
        generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        run = []
        for contexts, max_tokens in zip(rounds, budgets):
            if together:
                proposals = propose_batch(sessions, contexts, max_tokens, generators)
            else:
                proposals = [s.propose(c, m, g) for s, c, m, g in zip(sessions, contexts, max_tokens, generators)]
            state = [(s.num_real, [c.length for c in s.caches], s.corrector_cache.length) for s in sessions]
            run.append((proposals, state, [s.anchor for s in sessions]))
        runs.append(run)
        for session in sessions:
            session.close()
    for (alone, alone_state, alone_anchors), (batched, batched_state, batched_anchors), max_tokens in zip(*runs, budgets):
        assert batched_state == alone_state  # every session read each of its features once
        assert [p.num_forward_passes for p in batched] == [p.num_forward_passes for p in alone]
        assert all(len(p.tokens) <= m and p.probs is None for p, m in zip(batched, max_tokens))
        assert batched[3] == alone[3]  # seeded sampled: drafts alone, bit for bit
        for one, many in zip(alone_anchors, batched_anchors):
            assert (one is None) == (many is None)
            if one is not None and quantize:  # PyTorch's int8 dynamic linears scale all rows of a product together
                assert float((many - one).norm() / one.norm()) < 0.05
            elif one is not None:
                torch.testing.assert_close(many, one, atol=1e-4, rtol=1e-4)
        if not quantize:  # float32 rows compute as alone up to rounding: the same paths and runner-ups
            assert [p.tokens for p in batched] == [p.tokens for p in alone]
            assert [[(i, token) for i, token, _ in p.alternatives] for p in batched] == [[(i, token) for i, token, _ in p.alternatives] for p in alone]
            for one, many in zip(alone, batched):
                assert [score for *_, score in many.alternatives] == pytest.approx([score for *_, score in one.alternatives], rel=1e-3, abs=1e-6)
    first_round = runs[1][0][0]
    assert first_round[4].tokens == [] and sum(len(p.tokens) for p in first_round) > 4  # a 1-token prompt has no features yet


def test_served_round_cost_drafts_a_rounds_sessions_in_one_call_each(target, trained_head, monkeypatch):
    from verispec.bench.costs import served_round_cost

    encoded, blocks = [], []
    encode_many, draft_block = ParallelHead.encode_many, ParallelHead.draft_block
    monkeypatch.setattr(ParallelHead, "encode_many", lambda self, features, *args: encoded.append(len(features)) or encode_many(self, features, *args))
    monkeypatch.setattr(ParallelHead, "draft_block", lambda self, context, anchor, *args, **kw: blocks.append(len(anchor)) or draft_block(self, context, anchor, *args, **kw))
    drafter = ParallelDrafter(target, parallel_head(target, block_size=4), candidates=2)
    alone_s, together_s = served_round_cost(drafter, context_tokens=12, requests=4, num_drafts=4, repeats=2)
    assert alone_s > 0 and together_s > 0
    # Together, per round (warm-up + 2): one catch-up call for the 4 sessions, one block pass of 4
    # rows and one pair-fit pass of 4·(K-1)·m = 24 known-slot blocks; alone (12 rounds) a block of
    # one row and a pair fit of 6; the untimed prompt rounds (1 draft, not corrected) a block each.
    assert encoded == [4] * 3
    assert (blocks.count(4), blocks.count(24), blocks.count(6), blocks.count(1)) == (3, 3, 12, 12 + 2 * 12)


# --- far memory (long inputs) ---------------------------------------------------------------------


def test_parallel_head_blocks_with_far_memory(target):
    # The cached catch-up and a block (plus correction blocks with known slots and per-row
    # visibility) with a window covering everything are the head as trained; a short one is not.
    from verispec.drafters.far_memory import FarMemoryConfig

    head = parallel_head(target, block_size=3, num_layers=2, seed=5)
    hidden = target.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    features, embeds = torch.randn(1, 14, hidden, generator=generator), torch.randn(1, 14, hidden, generator=generator)
    known_embeds, known = torch.randn(2, 3, hidden, generator=generator), torch.tensor([[True, False, False], [False, True, False]])
    visible = torch.arange(14)[None] < torch.tensor([[14], [9]])

    def blocks(far_memory):
        caches = [LayerKVCache() for _ in head.layers]
        _, first = head.encode_context(features[:, :10], embeds[:, :10], 0, caches, far_memory=far_memory)
        context, outputs = head.encode_context(features[:, 10:], embeds[:, 10:], 10, caches, far_memory=far_memory)
        block = head.draft_block(context, outputs[:, -1], torch.tensor([14]), far_memory=far_memory)
        anchors = torch.stack((outputs[0, -1], first[0, 8]))  # rows 13 and 8: blocks at 14 and 9
        corrections = head.draft_block(context, anchors, torch.tensor([14, 9]), known_embeds, known, visible, far_memory=far_memory)
        return torch.cat((first, outputs), dim=1), block, corrections

    as_trained = blocks(None)
    for mode in ("fold", "local"):
        for got, expected in zip(blocks(FarMemoryConfig(mode, local_window=20)), as_trained):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    short = blocks(FarMemoryConfig("fold", local_window=3, memory_temperature=0.5))
    assert not any(torch.allclose(got, expected, atol=1e-3) for got, expected in zip(short, as_trained))
    with pytest.raises(ValueError, match="LayerKVCache"):
        head.encode_context(features, embeds, far_memory=FarMemoryConfig("fold", local_window=3))


@pytest.mark.parametrize("correction", [False, True, "eagle", "successor"])
def test_greedy_output_is_token_identical_with_far_memory(target, trained_head, correction, monkeypatch):
    import verispec.drafters.far_memory as far_memory
    from verispec.drafters.far_memory import FarMemoryConfig

    monkeypatch.setattr(far_memory, "AUTO_WINDOW_AFTER", 12)  # "auto": the 3-token prompt as trained, the 30-token one with a local window
    plain = SpeculativeDecoder(target)
    covering = SpeculativeDecoder(target, _anchored_drafter(target, trained_head, correction, FarMemoryConfig("fold", local_window=200)), gamma=3)
    as_trained = SpeculativeDecoder(target, _anchored_drafter(target, trained_head, correction, None), gamma=3)
    for mode in ("fold", "local", "auto"):
        drafter = _anchored_drafter(target, trained_head, correction, FarMemoryConfig(mode, local_window=4, memory_temperature=0.5, memory_weight=2.0))
        decoder = SpeculativeDecoder(target, drafter, gamma=3)
        for prompt in ([7, 14, 21], [(7 * 5 + k) % VOCAB for k in range(30)]):
            expected_mode = {"auto": "local" if len(prompt) > 12 else None}.get(mode, mode)
            assert getattr(drafter.start(prompt, SamplingParams()).far_memory, "mode", None) == expected_mode
            result = decoder.generate(prompt, 24, stop=[])
            assert result.token_ids == plain.generate(prompt, 24, stop=[]).token_ids
            assert sum(result.stats.drafted_per_round) > 0
            assert all(1 <= accepted + 1 <= 4 for accepted in result.stats.accepted_per_round)  # 1..gamma+1 tokens a call
    # "auto" on the long prompt drafts as the local window does (which differs from the trained attention there).
    long_prompt = [(7 * 5 + k) % VOCAB for k in range(30)]

    def rounds_of(far):
        result = SpeculativeDecoder(target, _anchored_drafter(target, trained_head, correction, far), gamma=3).generate(long_prompt, 24, stop=[])
        return result.stats.drafted_per_round, result.stats.accepted_per_round

    assert rounds_of(FarMemoryConfig("auto", 4, 0.5, 2.0)) == rounds_of(FarMemoryConfig("local", 4, 0.5, 2.0)) != rounds_of(None)
    # A window covering the whole text drafts as trained: the same rounds.
    prompt = [(7 * 3 + k) % VOCAB for k in range(20)]
    rounds = [(r.stats.drafted_per_round, r.stats.accepted_per_round) for r in (d.generate(prompt, 24, stop=[]) for d in (covering, as_trained))]
    assert rounds[0] == rounds[1]


def test_far_memory_drafter_refuses_replay_and_bad_configs(target, trained_head):
    from verispec.drafters.far_memory import FarMemoryConfig

    drafter = _anchored_drafter(target, trained_head, True, FarMemoryConfig("fold", local_window=4))
    tokens = torch.tensor([5, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="far_memory"):
        accepted_from_every_start(drafter, tokens, torch.zeros(5, target.config.hidden_size), 3, tokens)
    with pytest.raises(ValueError, match="far_memory must be a FarMemoryConfig"):
        _anchored_drafter(target, trained_head, True, "fold")
    assert _anchored_drafter(target, trained_head, True, FarMemoryConfig("full")).far_memory is None  # "full": as trained


@pytest.mark.parametrize("correction", [True, "eagle"])
def test_correction_keeps_the_anchors_first_draft_and_chooses_what_follows(target, trained_head, correction):
    # With first_from_anchor the first draft is EAGLE's readout: the lattice may not overrule it.
    import verispec.drafters.parallel.drafter as drafter_module

    drafter = _anchored_drafter(target, trained_head, correction, None)
    uncorrected = _anchored_drafter(target, trained_head, False, None)
    lattices = []
    best_path = drafter_module.best_path

    def spy(unary, pair):
        lattices.append(unary.clone())
        return best_path(unary, pair)

    drafter_module.best_path = spy
    try:
        for prompt in ([7, 14, 21, 28], [(7 * 5 + k) % VOCAB for k in range(12)], [3, 90, 41, 5, 5, 5]):
            session, plain_session = drafter.start(prompt, SamplingParams()), uncorrected.start(prompt, SamplingParams())
            with torch.no_grad():
                features = target.model(torch.tensor([prompt])).last_hidden_state[0, :-1]
            context = DraftContext(prompt, features, 0)
            corrected, top1 = session.propose(context, 3, torch.Generator()).tokens, plain_session.propose(context, 3, torch.Generator()).tokens
            assert corrected[0] == top1[0]
    finally:
        drafter_module.best_path = best_path
    assert lattices and all(torch.isinf(unary[0, 1:]).all() and torch.isfinite(unary[1:]).all() for unary in lattices)
