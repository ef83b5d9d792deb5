"""Far-memory (FOLD) attention for drafters: position assignment, the math, the EAGLE head and the whole decode."""

import math

import pytest
import torch

from marks import needs_kernels
from tiny_models import tiny_target
from verispec import SpeculativeDecoder
from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from verispec.engine.kv_cache import LayerKVCache
from verispec.drafters.far_memory import FarMemoryConfig, FarMemoryRows, assigned_key_positions, far_memory_attention, far_memory_prefix_attention, low_precision_memory
from verispec.drafters.shared_prefix import shared_prefix_attention
from verispec.models.rotary import apply_rotary, rotary_cos_sin

HEAD_DIM = 8
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))


def random_qkv(num_rows, num_keys, heads=4, kv_heads=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(heads, num_rows, HEAD_DIM, generator=generator)
    keys = torch.randn(kv_heads, num_keys, HEAD_DIM, generator=generator)
    values = torch.randn(kv_heads, num_keys, HEAD_DIM, generator=generator)
    return query, keys, values


def rotate_to(states, position):
    """R(position)·x for one vector # [head_dim]."""
    cos, sin = rotary_cos_sin(torch.tensor([float(position)]), INV_FREQ)
    return apply_rotary(states[None], cos, sin)[0]


def reference_attention(query, keys, values, start, config):
    """Row by row, key by key, written out: rotate each key to its assigned position, then one softmax."""
    heads, num_rows, _ = query.shape
    group = heads // keys.shape[0]
    out = torch.zeros_like(query)
    for head in range(heads):
        for row in range(num_rows):
            t = start + row
            rotated_query = rotate_to(query[head, row], t)
            logits, rows_of_values = [], []
            for s in range(t + 1):
                in_memory = s <= t - config.local_window
                if in_memory and config.mode == "local":
                    continue
                position = t - config.local_window if in_memory else s
                logit = float(rotated_query @ rotate_to(keys[head // group, s], position)) / math.sqrt(HEAD_DIM)
                if in_memory:
                    logit = logit / config.memory_temperature + math.log(config.memory_weight)
                logits.append(logit)
                rows_of_values.append(values[head // group, s])
            weights = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0).float()
            out[head, row] = weights @ torch.stack(rows_of_values)
    return out


def plain_causal_attention(query, keys, values, start):
    """Ordinary rotary attention at true positions (what the head was trained with)."""
    heads, num_rows, _ = query.shape
    cos_q, sin_q = rotary_cos_sin(torch.arange(start, start + num_rows).float(), INV_FREQ)
    cos_k, sin_k = rotary_cos_sin(torch.arange(keys.shape[1]).float(), INV_FREQ)
    mask = torch.ones(num_rows, keys.shape[1], dtype=torch.bool).tril(start)
    return torch.nn.functional.scaled_dot_product_attention(
        apply_rotary(query, cos_q, sin_q)[None], apply_rotary(keys, cos_k, sin_k)[None], values[None], attn_mask=mask, enable_gqa=True
    )[0]


@pytest.fixture
def memory_path(request, monkeypatch):
    """Which code attends within the far memory: our kernel (skipped where it cannot run) or PyTorch's products."""
    import verispec.drafters.far_memory as far_memory

    if request.param == "kernel":
        if far_memory._memory_kernel() is None:
            pytest.skip("the attention kernel cannot run here")
    else:
        monkeypatch.setattr(far_memory, "_memory_kernel", lambda: None)
    return request.param


# --- positions and math ------------------------------------------------------------------------------


def test_near_keys_keep_their_positions_far_keys_share_one():
    positions = assigned_key_positions(torch.tensor([9, 4, 1]), num_keys=10, local_window=3)
    # Query at 9, W=3: keys 7, 8, 9 exact; 0..6 all at 6 = 9-3, just beyond the window.
    assert positions[0].tolist() == [6, 6, 6, 6, 6, 6, 6, 7, 8, 9]
    # Query at 4: keys 2..4 exact, 0..1 at 1; keys after the query keep theirs (causal masking hides them).
    assert positions[1].tolist() == [1, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Query at 1 (inside the first window): nothing is memory.
    assert positions[2].tolist() == list(range(10))


@pytest.mark.parametrize(
    "config, start, num_rows",
    [
        (FarMemoryConfig("fold", local_window=3, memory_temperature=0.5, memory_weight=2.0), 0, 9),  # catch-up block
        (FarMemoryConfig("fold", local_window=4, memory_temperature=0.7, memory_weight=0.3), 7, 3),  # rows after a cache
        (FarMemoryConfig("fold", local_window=2, memory_temperature=1.5, memory_weight=1.0), 11, 1),  # one draft step
        (FarMemoryConfig("local", local_window=3), 5, 4),
    ],
)
@pytest.mark.parametrize("memory_path", ["kernel", "pytorch"], indirect=True)
def test_far_memory_attention_matches_the_written_out_reference(config, start, num_rows, memory_path):
    query, keys, values = random_qkv(num_rows, start + num_rows)
    got = far_memory_attention(query, keys, values, start, INV_FREQ, config)
    torch.testing.assert_close(got, reference_attention(query, keys, values, start, config), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("memory_path", ["kernel", "pytorch"], indirect=True)
def test_memory_mass_is_reweighted_by_lambda_and_sharpened_by_one_over_t(memory_path):
    """One row, one head, by hand: out = (Z_loc·o_loc + λ·Z_mem·o_mem) / (Z_loc + λ·Z_mem)."""
    config = FarMemoryConfig("fold", local_window=1, memory_temperature=0.5, memory_weight=3.0)
    query, keys, values = random_qkv(1, 4, heads=1, kv_heads=1, seed=3)
    t = 3
    rotated_query = rotate_to(query[0, 0], t)
    scale = 1 / math.sqrt(HEAD_DIM)
    local_logit = float(rotated_query @ rotate_to(keys[0, 3], 3)) * scale  # key 3 is the whole window
    memory_logits = torch.tensor([float(rotated_query @ rotate_to(keys[0, s], t - 1)) * scale for s in range(3)])  # keys 0..2 at t-W
    z_local = math.exp(local_logit)
    z_memory = torch.exp(memory_logits / 0.5)
    o_memory = (z_memory / z_memory.sum()) @ values[0, :3]
    expected = (z_local * values[0, 3] + 3.0 * float(z_memory.sum()) * o_memory) / (z_local + 3.0 * float(z_memory.sum()))
    got = far_memory_attention(query, keys, values, t, INV_FREQ, config)[0, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start, num_rows", [(0, 12), (9, 3), (11, 1)])
def test_unit_weight_unit_temperature_and_a_window_covering_everything_is_plain_attention(start, num_rows):
    query, keys, values = random_qkv(num_rows, start + num_rows)
    expected = plain_causal_attention(query, keys, values, start)
    for mode in ("fold", "local"):
        config = FarMemoryConfig(mode, local_window=start + num_rows, memory_temperature=1.0, memory_weight=1.0)
        torch.testing.assert_close(far_memory_attention(query, keys, values, start, INV_FREQ, config), expected, atol=1e-6, rtol=1e-6)


def test_local_mode_is_attention_over_the_last_w_keys_only():
    start, window = 10, 4
    query, keys, values = random_qkv(1, start + 1)
    got = far_memory_attention(query, keys, values, start, INV_FREQ, FarMemoryConfig("local", local_window=window))
    # Relative positions are all that rotary attention sees: the last W keys alone, re-indexed from 0, give the same scores.
    kept = slice(start + 1 - window, start + 1)
    expected = plain_causal_attention(query, keys[:, kept], values[:, kept], window - 1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_blocks_of_rows_give_the_same_result_as_one_block(monkeypatch):
    import verispec.drafters.far_memory as far_memory

    config = FarMemoryConfig("fold", local_window=3, memory_temperature=0.6, memory_weight=0.5)
    query, keys, values = random_qkv(10, 14)
    whole = far_memory_attention(query, keys, values, 4, INV_FREQ, config)
    monkeypatch.setattr(far_memory, "_BLOCK_ELEMENTS", 4 * 14 * 3)  # 3 rows a block
    torch.testing.assert_close(far_memory_attention(query, keys, values, 4, INV_FREQ, config), whole, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, num_keys, capacity, ends",
    [
        (2, 6, 128, 700, 1024, [0, 650, 651, 700]),  # a cache's view (heads a capacity apart); a row without memory
        (1, 4, 8, 37, 37, [37]),  # one draft step
        (2, 3, 80, 129, 300, [1, 2, 3, 64, 129]),  # memories shorter than a block of keys, odd lengths
    ],
)
def test_the_memory_kernel_is_pytorchs_memory_attention(kv_heads, group, head_dim, num_keys, capacity, ends, monkeypatch):
    import verispec.drafters.far_memory as far_memory

    generator = torch.Generator().manual_seed(7)
    query = torch.randn(kv_heads, group, len(ends), head_dim, generator=generator)
    keys = torch.randn(kv_heads, capacity, head_dim, generator=generator)[:, :num_keys]
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator)[:, :num_keys]
    ends = torch.tensor(ends)
    calls = []
    library = far_memory._memory_kernel()

    class Recording:  # the library, counting its calls: the kernel must really run
        def verispec_memory_attention(self, *args):
            calls.append(args[3])  # rows
            return library.verispec_memory_attention(*args)

    monkeypatch.setattr(far_memory, "_memory_kernel", lambda: Recording())
    context, lse = far_memory._memory_part(query, keys, values, ends, 0.3)
    assert calls == [len(ends)]
    monkeypatch.setattr(far_memory, "_memory_kernel", lambda: None)
    expected_context, expected_lse = far_memory._memory_part(query, keys, values, ends, 0.3)
    torch.testing.assert_close(context, expected_context, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)  # -inf where a row has no memory, in both
    no_memory = ends == 0
    assert torch.isneginf(lse[:, :, no_memory]).all() and not context[:, :, no_memory].any()


def test_a_memory_kernel_that_cannot_be_built_leaves_pytorchs_products(monkeypatch):
    import verispec.drafters.far_memory as far_memory

    def failing_build():
        raise RuntimeError("building the panel kernels failed (g++): ...")

    monkeypatch.setattr(far_memory, "panel_library", failing_build)
    monkeypatch.setattr(far_memory, "panel_kernels_unavailable_reason", lambda: None)
    far_memory._memory_kernel.cache_clear()
    try:
        assert far_memory._memory_kernel() is None  # a draft is never worth failing a request over
        config = FarMemoryConfig("fold", local_window=2, memory_temperature=1.5, memory_weight=1.0)
        query, keys, values = random_qkv(1, 12)
        got = far_memory_attention(query, keys, values, 11, INV_FREQ, config)
        torch.testing.assert_close(got, reference_attention(query, keys, values, 11, config), atol=1e-5, rtol=1e-5)
    finally:
        far_memory._memory_kernel.cache_clear()  # the real library again for the tests after this one


# --- the far memory read in bfloat16 ------------------------------------------------------------------


def test_low_precision_copies_follow_appends_crops_and_row_copies():
    generator = torch.Generator().manual_seed(5)
    cache = LayerKVCache()

    def rows(n):
        return torch.randn(2, n, HEAD_DIM, generator=generator), torch.randn(2, n, HEAD_DIM, generator=generator)

    def assert_copies_match(end):
        low_keys, low_values = cache.low_precision(end)
        assert low_keys.dtype == torch.bfloat16 and low_keys.shape == (2, end, HEAD_DIM)
        assert torch.equal(low_keys, cache.keys[:, :end].bfloat16()) and torch.equal(low_values, cache.values[:, :end].bfloat16())

    cache.append(*rows(10))
    assert_copies_match(7)
    cache.crop(4)  # a rejected round: positions 4.. are written anew
    cache.append(*rows(6))
    assert_copies_match(9)  # the copies of 4..6 made before the crop must not survive it
    cache.copy_row(8, 2)  # a kept tree branch moves its row down
    assert_copies_match(10)
    cache.append(*rows(600))  # the buffers grow past their first capacity
    assert_copies_match(610)
    assert_copies_match(3)
    with pytest.raises(ValueError, match="low_precision end"):
        cache.low_precision(611)
    with pytest.raises(ValueError, match="copy_row positions"):
        cache.copy_row(610, 2)


@pytest.mark.parametrize("start, num_rows", [(40, 1), (0, 48), (30, 6)])
def test_a_bfloat16_memory_is_the_float32_attention_up_to_rounding(start, num_rows):
    config = FarMemoryConfig("fold", local_window=5, memory_temperature=0.8, memory_weight=1.5)
    query, keys, values = random_qkv(num_rows, start + num_rows, seed=4)
    exact = far_memory_attention(query, keys, values, start, INV_FREQ, config)
    memory = (keys.bfloat16(), values.bfloat16())
    rounded = far_memory_attention(query, keys, values, start, INV_FREQ, config, memory)
    torch.testing.assert_close(rounded, exact, atol=3e-2, rtol=3e-2)
    # The memory's values come from the copies: zero them there and in the float32 keys' memory rows alike.
    last = start + num_rows - 1
    memory_rows = slice(0, last - config.local_window + 1)
    zeroed = values.clone()
    zeroed[:, memory_rows] = 0
    without = far_memory_attention(query[:, -1:], keys, zeroed, last, INV_FREQ, config)
    got = far_memory_attention(query[:, -1:], keys, values, last, INV_FREQ, config, (keys.bfloat16(), zeroed.bfloat16()))
    torch.testing.assert_close(got, without, atol=3e-2, rtol=3e-2)
    assert not torch.allclose(without, exact[:, -1:], atol=3e-2)


def test_a_long_fold_memory_is_read_in_bfloat16_only_where_it_pays(monkeypatch):
    import verispec.drafters.far_memory as far_memory

    cache = LayerKVCache()
    cache.append(torch.randn(2, 40, HEAD_DIM), torch.randn(2, 40, HEAD_DIM))
    fold = FarMemoryConfig("fold", local_window=8)
    monkeypatch.setattr(far_memory, "LOW_PRECISION_MEMORY_FROM", 32)
    monkeypatch.setattr(far_memory, "native_bf16_products", lambda: True)
    low_keys, low_values = low_precision_memory(cache, 40, fold)  # keys 0..31 are memory for the row at 39
    assert low_keys.shape == (2, 32, HEAD_DIM) and low_values.dtype == torch.bfloat16
    assert low_precision_memory(cache, 39, fold) is None  # 31 memory keys: float32
    assert low_precision_memory(cache, 40, FarMemoryConfig("local", local_window=8)) is None  # no memory at all
    assert low_precision_memory(cache, 40, None) is None
    monkeypatch.setattr(far_memory, "native_bf16_products", lambda: False)  # emulated bfloat16 is slower than float32
    assert low_precision_memory(cache, 40, fold) is None


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"mode": "sliding"}, "--draft-attention"),
        ({"local_window": 0}, "--local-window"),
        ({"local_window": 2.5}, "--local-window"),
        ({"memory_temperature": 0.0}, "--memory-temperature"),
        ({"memory_temperature": float("inf")}, "--memory-temperature"),
        ({"memory_weight": -1.0}, "--memory-weight"),
    ],
)
def test_bad_far_memory_settings_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        FarMemoryConfig(**kwargs)


# --- the EAGLE head and the decode ------------------------------------------------------------------


def rotated_at(states, positions):
    """R(p)·x of rows # [..., n, head_dim] at positions # [n]."""
    cos, sin = rotary_cos_sin(torch.as_tensor(positions).float(), INV_FREQ)
    return apply_rotary(states, cos, sin)


@pytest.mark.parametrize(
    "config",
    [
        FarMemoryConfig("fold", local_window=3, memory_temperature=0.5, memory_weight=2.0),
        FarMemoryConfig("fold", local_window=4, memory_temperature=1.3, memory_weight=0.4),
        FarMemoryConfig("local", local_window=3),
    ],
)
def test_rows_after_a_cached_prefix_are_the_causal_far_memory_rows(config):
    # Rows appended after a cached prefix (a drafting head's block, its correction rows) attend as
    # the written-out reference says: far_memory_attention, row by row, with their own keys local.
    prefix_length, num_rows = 9, 3
    query, keys, values = random_qkv(num_rows, prefix_length + num_rows, seed=5)
    positions = torch.arange(prefix_length, prefix_length + num_rows)
    own = (rotated_at(keys[:, prefix_length:], positions)[None], values[:, prefix_length:][None])
    rows = FarMemoryRows(config, positions[None], INV_FREQ)
    got = far_memory_prefix_attention(query[None], (keys[None, :, :prefix_length], values[None, :, :prefix_length]), None, own, True, rows)[0]
    torch.testing.assert_close(got, reference_attention(query, keys, values, prefix_length, config), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_prefix_rows_with_a_covering_window_are_shared_prefix_attention(causal):
    # W beyond every distance, T = λ = 1: the blocks' own attention (bidirectional or causal, each
    # entry seeing its own part of the shared prefix) exactly as drafted without far memory.
    prefix_length, num_rows, batch = 10, 4, 3
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(batch, 4, num_rows, HEAD_DIM, generator=generator)
    keys, values = torch.randn(1, 2, prefix_length, HEAD_DIM, generator=generator), torch.randn(1, 2, prefix_length, HEAD_DIM, generator=generator)
    own_keys, own_values = torch.randn(batch, 2, num_rows, HEAD_DIM, generator=generator), torch.randn(batch, 2, num_rows, HEAD_DIM, generator=generator)
    starts = torch.tensor([10, 6, 8])  # entry b sees prefix keys < starts[b], its rows at starts[b] ..
    positions = starts[:, None] + torch.arange(num_rows)
    visible = (torch.arange(prefix_length)[None] < starts[:, None])[:, None, None, :]
    own = (torch.stack([rotated_at(own_keys[b], positions[b]) for b in range(batch)]), own_values)
    cos, sin = rotary_cos_sin(positions.reshape(-1).float(), INV_FREQ)
    rotated_query = apply_rotary(query, cos.view(batch, 1, num_rows, -1), sin.view(batch, 1, num_rows, -1))
    expected = shared_prefix_attention(rotated_query, (rotated_at(keys, torch.arange(prefix_length)), values), visible, own, causal)
    for mode in ("fold", "local"):
        rows = FarMemoryRows(FarMemoryConfig(mode, local_window=prefix_length + num_rows), positions, INV_FREQ)
        torch.testing.assert_close(far_memory_prefix_attention(query, (keys, values), visible, own, causal, rows), expected, atol=1e-6, rtol=1e-6)
    # A short window changes the result (the test would not notice a far memory that does nothing).
    rows = FarMemoryRows(FarMemoryConfig("fold", local_window=2, memory_temperature=0.5), positions, INV_FREQ)
    assert not torch.allclose(far_memory_prefix_attention(query, (keys, values), visible, own, causal, rows), expected, atol=1e-3)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def fresh_head(target, seed=0):
    torch.manual_seed(seed)
    return EagleHead(EagleConfig.for_target(target.config, 24)).eval().requires_grad_(False)


def test_head_with_a_window_covering_everything_matches_the_trained_attention(target):
    head = fresh_head(target)
    hidden = target.config.hidden_size
    features, embeds = torch.randn(1, 12, hidden), torch.randn(1, 12, hidden)
    expected = head(features, embeds)
    covering = FarMemoryConfig("fold", local_window=12, memory_temperature=1.0, memory_weight=1.0)
    cache = LayerKVCache()
    first = head(features[:, :8], embeds[:, :8], start=0, cache=cache, far_memory=covering)  # catch-up
    rest = [head(features[:, i : i + 1], embeds[:, i : i + 1], start=i, cache=cache, far_memory=covering) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), expected, atol=1e-5, rtol=1e-5)
    # A short window changes the drafts (else the option would do nothing).
    short = FarMemoryConfig("fold", local_window=2, memory_temperature=0.5, memory_weight=1.0)
    assert not torch.allclose(head(features, embeds, start=0, cache=LayerKVCache(), far_memory=short), expected, atol=1e-3)
    with pytest.raises(ValueError, match="LayerKVCache"):
        head(features, embeds, far_memory=short)
    # Mode "full" is the trained attention, bit for bit.
    as_trained = head(features, embeds, start=0, cache=LayerKVCache())
    assert torch.equal(head(features, embeds, start=0, cache=LayerKVCache(), far_memory=FarMemoryConfig("full")), as_trained)


@pytest.mark.parametrize("mode", ["local", "fold"])
def test_greedy_decode_with_far_memory_is_token_identical_to_plain(target, mode):
    config = FarMemoryConfig(mode, local_window=4, memory_temperature=0.5, memory_weight=2.0)
    plain = SpeculativeDecoder(target)
    eagle = SpeculativeDecoder(target, EagleDrafter(target, fresh_head(target), far_memory=config), gamma=3)
    for prompt in ([3, 1, 4], list(range(20, 50))):
        result = eagle.generate(prompt, 24, stop=[])
        assert result.token_ids == plain.generate(prompt, 24, stop=[]).token_ids
        assert sum(result.stats.drafted_per_round) > 0
        assert all(1 <= accepted + 1 <= 4 for accepted in result.stats.accepted_per_round)  # 1..gamma+1 tokens a call


def test_greedy_decode_with_a_bfloat16_memory_is_token_identical_to_plain(target, monkeypatch):
    import verispec.drafters.far_memory as far_memory

    monkeypatch.setattr(far_memory, "LOW_PRECISION_MEMORY_FROM", 1)
    monkeypatch.setattr(far_memory, "native_bf16_products", lambda: True)
    reads = []
    original = LayerKVCache.low_precision
    monkeypatch.setattr(LayerKVCache, "low_precision", lambda cache, end, *args: reads.append(end) or original(cache, end, *args))
    config = FarMemoryConfig("fold", local_window=4)
    eagle = SpeculativeDecoder(target, EagleDrafter(target, fresh_head(target), far_memory=config), gamma=3)
    prompt = list(range(20, 50))
    result = eagle.generate(prompt, 24, stop=[])
    assert result.token_ids == SpeculativeDecoder(target).generate(prompt, 24, stop=[]).token_ids
    assert len(reads) > 10 and max(reads) > len(prompt)  # the catch-up and the draft steps read the copies


def test_a_local_window_catch_up_computes_only_the_rows_later_calls_can_see(target):
    from verispec.drafters.base import DraftContext
    from verispec.sampling import SamplingParams

    drafter = EagleDrafter(target, fresh_head(target), far_memory=FarMemoryConfig("local", local_window=4))
    prompt = list(range(20, 50))
    context = DraftContext(prompt, torch.randn(len(prompt) - 1, target.config.hidden_size), 0)  # features of positions 0..28
    rows_read: list[int] = []
    hook = drafter.head.register_forward_hook(lambda module, args, output: rows_read.append(args[0].shape[1]))
    skipping = drafter.start(prompt, SamplingParams())
    proposal = skipping.propose(context, 5, torch.Generator())
    every_row = drafter.start(prompt, SamplingParams())
    every_row._never_read = lambda num_fresh: 0  # the reference: every catch-up row computed
    reference = every_row.propose(context, 5, torch.Generator())
    hook.remove()
    assert rows_read[0] == 4 and rows_read[len(rows_read) // 2] == len(prompt) - 1  # the two catch-ups: the window's rows, then all
    assert proposal.tokens == reference.tokens and len(proposal.tokens) == 5
    assert skipping.num_real == every_row.num_real == len(prompt) - 1 and skipping.cache.length == every_row.cache.length
    torch.testing.assert_close(skipping.next_feature, every_row.next_feature)
    # Fold (and full) attention read every older row: nothing is skipped there.
    assert EagleDrafter(target, fresh_head(target), far_memory=FarMemoryConfig("fold", local_window=4)).start(prompt, SamplingParams())._never_read(29) == 0


def test_auto_is_the_trained_attention_up_to_the_training_length_and_the_local_window_beyond():
    from verispec.drafters.far_memory import AUTO_WINDOW_AFTER

    auto = FarMemoryConfig("auto", local_window=8, memory_temperature=0.7, memory_weight=2.0)
    assert AUTO_WINDOW_AFTER == 1024  # the heads' max_seq_len
    assert auto.for_prompt(AUTO_WINDOW_AFTER) is None
    assert auto.for_prompt(AUTO_WINDOW_AFTER + 1) == FarMemoryConfig("local", 8, 0.7, 2.0)
    assert FarMemoryConfig("local", 8).for_prompt(5) == FarMemoryConfig("local", 8) and FarMemoryConfig("full").for_prompt(5000) is None
    query, keys, values = random_qkv(1, 10)
    with pytest.raises(ValueError, match="decided per request"):
        far_memory_attention(query, keys, values, 9, INV_FREQ, auto)
    with pytest.raises(ValueError, match="decided per request"):
        rows = FarMemoryRows(auto, torch.tensor([[9]]), INV_FREQ)
        far_memory_prefix_attention(query[None], (keys[None, :, :9], values[None, :, :9]), None, (keys[None, :, 9:], values[None, :, 9:]), False, rows)


def test_an_auto_session_drafts_as_trained_on_short_prompts_and_with_a_local_window_on_long_ones(target, monkeypatch):
    import verispec.drafters.far_memory as far_memory
    from verispec.drafters.base import DraftContext
    from verispec.sampling import SamplingParams

    monkeypatch.setattr(far_memory, "AUTO_WINDOW_AFTER", 12)
    head = fresh_head(target)
    local = FarMemoryConfig("local", local_window=4, memory_temperature=0.5, memory_weight=2.0)
    drafters = {mode: EagleDrafter(target, head, far_memory=config) for mode, config in [("auto", FarMemoryConfig("auto", 4, 0.5, 2.0)), ("full", None), ("local", local)]}

    def head_state(mode, prompt):
        session = drafters[mode].start(prompt, SamplingParams())
        session.propose(DraftContext(prompt, features[: len(prompt) - 1], 0), 3, torch.Generator())
        return session.far_memory, session.next_feature

    features = torch.randn(40, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    short, long = list(range(20, 32)), list(range(20, 50))  # 12 and 30 tokens
    assert head_state("auto", short)[0] is None
    assert torch.equal(head_state("auto", short)[1], head_state("full", short)[1])
    resolved, feature = head_state("auto", long)
    assert resolved == local and torch.equal(feature, head_state("local", long)[1])
    assert not torch.allclose(feature, head_state("full", long)[1], atol=1e-4)  # the window does change this prompt's drafts
    plain = SpeculativeDecoder(target).generate(long, 16, stop=[]).token_ids
    assert SpeculativeDecoder(target, drafters["auto"], gamma=3).generate(long, 16, stop=[]).token_ids == plain


def test_generate_says_when_auto_leaves_the_trained_attention(target):
    from verispec.drafters import NgramDrafter, lookup_then_model
    from verispec.far_memory_cli import auto_attention_note

    auto = EagleDrafter(target, fresh_head(target), far_memory=FarMemoryConfig("auto", local_window=4))
    assert auto_attention_note(auto, 1024) is None  # within the training length: as trained, nothing to say
    note = auto_attention_note(auto, 2000)
    assert "last 4 tokens" in note and "2000 tokens are past the 1024" in note and "--draft-attention" in note
    assert auto_attention_note(lookup_then_model(auto), 2000) == note  # lookup first, the head otherwise
    explicit = EagleDrafter(target, fresh_head(target), far_memory=FarMemoryConfig("fold", local_window=4))
    assert auto_attention_note(explicit, 2000) is None and auto_attention_note(NgramDrafter(), 2000) is None and auto_attention_note(None, 2000) is None


def test_bench_methods_pick_the_mode_and_keep_the_window_temperature_and_weight(target):
    from verispec.bench.methods import build_method

    settings = FarMemoryConfig("fold", local_window=8, memory_temperature=0.7, memory_weight=2.0)
    for name, mode, adaptive in [("eagle", None, False), ("eagle-local", "local", False), ("eagle-fold-adaptive", "fold", True), ("eagle-auto", "auto", False)]:
        decoder = build_method(name, target, None, 3, eagle_head=fresh_head(target), far_memory=settings).decoder
        assert (decoder._gamma_controller is not None) == adaptive
        if mode is None:
            assert decoder.drafter.far_memory is None
        else:
            assert decoder.drafter.far_memory == FarMemoryConfig(mode, 8, 0.7, 2.0)
    # The parallel methods take it as a setting: parallel...:attention=full|local|fold.
    from verispec.bench.methods import parse_variant
    from verispec.drafters.parallel import ParallelConfig, ParallelHead

    torch.manual_seed(0)
    parallel = ParallelHead(ParallelConfig.for_target(target.config, 24, block_size=3)).eval().requires_grad_(False)
    for name, expected in [("parallel", None), ("parallel:attention=full", None), ("parallel-corrected:attention=local", FarMemoryConfig("local", 8, 0.7, 2.0)),
                           ("parallel-corrected-eagle:attention=fold", FarMemoryConfig("fold", 8, 0.7, 2.0))]:  # fmt: skip
        drafter = build_method(name, target, None, 3, eagle_head=fresh_head(target), parallel_head=parallel, far_memory=settings).decoder.drafter
        assert drafter.far_memory == expected
    # So do the EAGLE methods attending as trained (with lookup in front too); the fixed-mode names do not.
    for name, expected in [("eagle:attention=fold", FarMemoryConfig("fold", 8, 0.7, 2.0)), ("ngram+eagle-adaptive:attention=local", FarMemoryConfig("local", 8, 0.7, 2.0)),
                           ("eagle-adaptive:attention=full", None), ("ngram+eagle:attention=auto", FarMemoryConfig("auto", 8, 0.7, 2.0))]:  # fmt: skip
        drafter = build_method(name, target, None, 3, eagle_head=fresh_head(target), far_memory=settings).decoder.drafter
        assert getattr(drafter, "fallback", drafter).far_memory == expected
    for name, message in [("eagle-fold:attention=local", "applies to eagle, "), ("draft-model:attention=fold", "applies to eagle, "), ("parallel:attention=wide", "out of range")]:
        with pytest.raises(ValueError, match=message):
            parse_variant(name)


# --- the long-context prompt set and the command line ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_models import write_tiny_qwen2_gguf

    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_qwen2_gguf(path)
    return str(path)


@pytest.fixture(scope="module")
def fake_stdlib(tmp_path_factory):
    """Six long 'modules' (the sorted order decides the split), one short file and a test package that never count."""
    from verispec.bench.long_context import MIN_MODULE_CHARS

    root = tmp_path_factory.mktemp("stdlib")
    for index in range(6):
        lines = [f'"""Module {index}."""', ""] + [f"def function_{index}_{k}(x):\n    return x + {k}\n" for k in range(4000)]
        text = "\n".join(lines)
        assert len(text) >= MIN_MODULE_CHARS
        (root / f"mod{index}.py").write_text(text)
    (root / "short.py").write_text("def f():\n    pass\n")
    (root / "test").mkdir()
    (root / "test" / "big.py").write_text((root / "mod0.py").read_text())
    return root


def test_load_test_long_texts_are_distinct_cuts_of_about_the_asked_size(fake_stdlib):
    from verispec.bench.long_context import CHARS_PER_TOKEN, approximate_long_texts

    texts = approximate_long_texts(14, 500, root=fake_stdlib)
    assert len(set(texts)) == 14  # six modules, then the same ones from later lines
    for index, text in enumerate(texts):
        body = text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert len(body) == int(500 * CHARS_PER_TOKEN)
        assert f"module `mod{index % 6}.py`" in text and "Rewrite the function `function_" in text.rsplit("```", 1)[1]
    # Request k // 6 of a module starts 40 lines further on: the prompts share no prefix beyond the template.
    assert texts[0].split("```python\n", 1)[1].startswith('"""Module 0."""')
    assert texts[6].split("```python\n", 1)[1].startswith("\ndef function_0_13(x):")  # line 40 of mod0.py
    with pytest.raises(ValueError, match="count and approx_tokens must be >= 1"):
        approximate_long_texts(0, 500, root=fake_stdlib)


def test_long_prompts_have_the_requested_lengths_and_disjoint_splits(tiny_gguf, fake_stdlib):
    from verispec.bench.long_context import long_context_modules, long_context_prompts
    from verispec.models import encode_prompt, load_model

    tokenizer = load_model(tiny_gguf).tokenizer
    dev = [name for name, _ in long_context_modules("dev", fake_stdlib)]
    evaluation = [name for name, _ in long_context_modules("eval", fake_stdlib)]
    assert dev == ["mod0.py", "mod3.py"] and evaluation == ["mod1.py", "mod2.py", "mod4.py", "mod5.py"]
    prompts = long_context_prompts(tokenizer, [300, 1200], "eval", per_length=3, root=fake_stdlib)
    assert [p.category for p in prompts] == ["long-300", "long-1200"] * 3
    for prompt in prompts:
        assert abs(len(encode_prompt(tokenizer, prompt.text)) - int(prompt.category.split("-")[1])) <= 2
        # The request names the module's first function, which sits at the very start of the input.
        module = prompt.id.split("/")[1].split("@")[0]
        assert f"`function_{module[3]}_0`" in prompt.text.rsplit("```", 1)[1]
    # The explain request: the same cuts, the function asked about in words, categories of their own.
    explained = long_context_prompts(tokenizer, [300, 1200], "eval", per_length=3, root=fake_stdlib, request="explain")
    assert [p.category for p in explained] == ["long-explain-300", "long-explain-1200"] * 3
    for prompt in explained:
        ask = prompt.text.rsplit("```", 1)[1]
        assert "Explain in plain words what the function `function_" in ask and "Rewrite" not in ask
        assert abs(len(encode_prompt(tokenizer, prompt.text)) - int(prompt.category.rsplit("-", 1)[1])) <= 2
    with pytest.raises(ValueError, match="--long-request must be one of rewrite, explain"):
        long_context_prompts(tokenizer, [300], "eval", root=fake_stdlib, request="translate")
    # The real standard library: the splits share no module.
    real_dev, real_eval = ({name for name, _ in long_context_modules(split)} for split in ("dev", "eval"))
    assert real_dev and real_eval and not real_dev & real_eval


@pytest.mark.parametrize(
    "options, message",
    [
        (["--draft-attention", "fold", "--local-window", "0"], "--local-window must be an integer >= 1"),
        (["--draft-attention", "fold", "--memory-temperature", "0"], "--memory-temperature must be a finite number > 0"),
        (["--draft-attention", "local", "--memory-weight", "-2"], "--memory-weight must be a finite number > 0"),
        (["--draft-attention", "fold", "--drafter", "ngram"], "it needs --drafter eagle"),
    ],
)
def test_far_memory_option_errors_name_the_option(tiny_gguf, capsys, options, message):
    from verispec.cli import main

    assert main(["generate", "--target", tiny_gguf, "--drafter", "eagle", *options, "x"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serving_commands_default_to_auto_and_eagle_eval_to_the_trained_attention(tiny_gguf, capsys):
    from verispec.cli import _build_parser, main
    from verispec.far_memory_cli import far_memory_from_args

    parser = _build_parser()
    for command in ("generate", "compare", "serve"):
        args = parser.parse_args([command, "--local-window", "64", *(["x"] if command != "serve" else [])])
        assert far_memory_from_args(args) == FarMemoryConfig("auto", 64)
    assert far_memory_from_args(parser.parse_args(["eagle", "eval"])) is None  # measures the head as trained unless asked
    # The default is harmless where no head drafts; only an explicit local/fold is refused there.
    assert main(["generate", "--target", tiny_gguf, "--drafter", "ngram", "--max-new-tokens", "4", "x"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, message",
    [
        (["--lengths", "2048,x"], "--lengths must be a comma list"),
        (["--lengths", "100"], "--lengths must name token counts >= 256"),
        (["--memory-weight", "0"], "--memory-weight"),
        (["--categories", "long-999"], "--categories: unknown long-999"),
    ],
)
def test_long_bench_option_errors_come_before_loading(tmp_path, capsys, options, message):
    from verispec.cli import main

    args = ["bench", "--set", "long", "--methods", "plain,eagle-fold", "--target", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out"), *options]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_bench_runs_eagle_full_local_and_fold_on_the_long_set(tiny_gguf, tmp_path, capsys, monkeypatch):
    import json

    from verispec.bench import long_context
    from verispec.cli import main
    from verispec.drafters.eagle import save_head, target_fingerprint
    from verispec.models import load_model

    loaded = load_model(tiny_gguf)
    head_path = tmp_path / "head.safetensors"
    save_head(head_path, fresh_head(loaded.model), draft_vocab=None, fingerprint=target_fingerprint(loaded.model))
    root = tmp_path / "stdlib"
    root.mkdir()
    (root / "mod.py").write_text("\n".join(f"def f{k}(x):\n    return x * {k}\n" for k in range(6000)))
    monkeypatch.setattr(long_context.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    out = tmp_path / "out"
    args = ["bench", "--target", tiny_gguf, "--set", "long", "--lengths", "300,600", "--split", "dev", "--methods", "plain,eagle,eagle-local,eagle-fold",
            "--eagle-head", str(head_path), "--local-window", "64", "--max-new-tokens", "6", "--gamma", "3", "--no-warmup", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert {row["method"] for row in rows} == {"plain", "eagle", "eagle-local", "eagle-fold"}
    assert {row["category"] for row in rows} == {"long-300", "long-600"}
    assert "identical" in capsys.readouterr().out
