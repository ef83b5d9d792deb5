"""Prefix reuse: sequences start from the longest stored prefix, and the tokens do not change."""

from __future__ import annotations

import json

import pytest
import torch
from scheduling import serve_all
from tiny_models import noisy_copy, tiny_target

from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.drafters.draft_model import window_start
from verispec.engine.kv_cache import LayerKVCache, RowLog
from verispec.engine.lean_lm import LeanDecoder, LeanLM, target_lm
from verispec.engine.prefix_cache import PrefixCache, prefix_cache_of_mb
from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels
from verispec.serving import BatchGammaPolicy, Scheduler, SchedulerConfig

pytestmark = pytest.mark.skipif(panel_kernels_unavailable_reason() is not None, reason=f"panel kernels: {panel_kernels_unavailable_reason()}")


@pytest.fixture(scope="module")
def panel_target():
    return use_panel_kernels(tiny_target())


def _sequence(token_ids: list[int], kv_heads: int = 2, head_dim: int = 4, hidden: int = 3) -> tuple[list[LayerKVCache], torch.Tensor]:
    """Two layers of caches holding values derived from the token ids (position-independent), and features."""
    caches = [LayerKVCache() for _ in range(2)]
    ids = torch.tensor(token_ids, dtype=torch.float32)
    for layer, cache in enumerate(caches):
        keys = (ids[None, :, None] + layer).expand(kv_heads, -1, head_dim).contiguous()
        cache.append(keys, -keys)
    return caches, ids[:, None].expand(-1, hidden).contiguous()


def _restored(store: PrefixCache, token_ids: list[int]) -> tuple[list[LayerKVCache], RowLog, torch.Tensor]:
    caches, log = [LayerKVCache() for _ in range(2)], RowLog()
    features = store.restore(token_ids, caches, log)
    return caches, log, features


def test_restore_copies_the_longest_shared_prefix_of_any_stored_sequence():
    store = PrefixCache(1 << 20)
    store.store([1, 2, 3, 4], *_sequence([1, 2, 3, 4]))
    store.store([1, 2, 9, 9, 9], *_sequence([1, 2, 9, 9, 9]))
    assert store.longest_match([1, 2, 3, 7]) == 3 and store.longest_match([1, 2, 9, 9, 5]) == 4 and store.longest_match([5]) == 0
    caches, log, features = _restored(store, [1, 2, 9, 9, 5, 6])
    assert features.tolist() == [[1.0] * 3, [2.0] * 3, [9.0] * 3, [9.0] * 3] and log.length == 4
    assert [cache.length for cache in caches] == [4, 4]
    assert caches[1].keys[0, :4, 0].tolist() == [2.0, 3.0, 10.0, 10.0] and caches[1].values[1, :4, 3].tolist() == [-2.0, -3.0, -10.0, -10.0]
    caches, log, features = _restored(store, [7, 1, 2])
    assert features.shape == (0, 0) and caches[0].length == 0 and log.length == 0
    assert (store.stats.lookups, store.stats.hits, store.stats.reused_tokens) == (2, 1, 4)


def test_a_longer_sequence_supersedes_its_prefixes_and_a_covered_one_is_not_stored_again():
    store = PrefixCache(1 << 20)
    store.store([1, 2], *_sequence([1, 2]))
    store.store([1, 2, 3], *_sequence([1, 2, 3]))
    assert len(store) == 1
    store.store([1, 2], *_sequence([1, 2]))  # covered by [1, 2, 3]
    assert len(store) == 1 and store.longest_match([1, 2, 3, 4]) == 3
    single = _sequence([1])
    store.store([4], *single)
    assert len(store) == 2 and store.bytes == sum(entry.nbytes for entry in store._entries.values())


def test_least_recently_used_sequences_go_first_past_the_byte_budget():
    one = PrefixCache(1 << 20)
    one.store([1, 2, 3], *_sequence([1, 2, 3]))
    entry_bytes = one.bytes
    store = PrefixCache(2 * entry_bytes)
    for first in (10, 20):
        store.store([first, 2, 3], *_sequence([first, 2, 3]))
    _restored(store, [10, 2, 3])  # 10... is now the most recently used
    store.store([30, 2, 3], *_sequence([30, 2, 3]))
    assert store.longest_match([10, 2, 3]) == 3 and store.longest_match([30, 2, 3]) == 3 and store.longest_match([20, 2, 3]) == 0
    assert store.bytes <= store.max_bytes
    tiny = PrefixCache(entry_bytes - 1)
    tiny.store([1, 2, 3], *_sequence([1, 2, 3]))  # larger than the whole budget: not kept
    assert len(tiny) == 0 and tiny.bytes == 0


def test_bad_arguments_are_refused_by_name():
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PrefixCache(bad)
    store = PrefixCache(1 << 20)
    caches, features = _sequence([1, 2, 3])
    with pytest.raises(ValueError, match="exactly the 2 tokens"):
        store.store([1, 2], caches, features)
    with pytest.raises(ValueError, match="empty sequence"):
        store.restore([1, 2, 3], caches, RowLog())
    log = RowLog()
    log.append(features)
    assert not store.keep([1, 2], caches, log) and not store.keep([], [], RowLog()) and len(store) == 0  # not what they hold: left alone
    assert store.keep([1, 2, 3], caches, log) and store.longest_match([1, 2, 3]) == 3
    with pytest.raises(ValueError, match="prefix_cache_mb must be an integer >= 0, got -1"):
        prefix_cache_of_mb(-1)
    assert prefix_cache_of_mb(0) is None and prefix_cache_of_mb(2).max_bytes == 2 << 20


def test_row_log_appends_grows_and_crops():
    log = RowLog()
    assert log.width is None and log.view().shape == (0, 0)
    log.append(torch.ones(200, 3))
    log.append(torch.full((100, 3), 2.0))
    assert log.length == 300 and log.view()[-1].tolist() == [2.0, 2.0, 2.0]
    log.crop(150)
    log.append(torch.zeros(1, 3))
    assert log.view()[149].tolist() == [1.0] * 3 and log.view()[150].tolist() == [0.0] * 3
    with pytest.raises(ValueError, match="crop length"):
        log.crop(152)


def _cold_and_warm(model, store: PrefixCache, token_ids: list[int]):
    """Features, next logits and keys of ``token_ids`` computed on an empty store and restored from ``store``."""
    out = []
    for prefixes in (PrefixCache(1 << 30), store):
        lm = target_lm(model, prefixes=prefixes)
        step = lm.extend(token_ids, num_logits=1)
        out.append((step.features, step.logits, [cache.keys[:, : cache.length].clone() for cache in lm.cache], lm.reused_tokens))
        lm.release()
    return out


@pytest.mark.parametrize("length", [40, 300])  # 300: longer than one fused call (the row-exact pieces)
def test_a_restored_prefix_gives_bit_for_bit_what_computing_it_gives(panel_target, length):
    generator = torch.Generator().manual_seed(length)
    shared = torch.randint(0, 96, (length,), generator=generator).tolist()
    store = PrefixCache(1 << 30)
    first = target_lm(panel_target, prefixes=store)
    first.extend(shared + [1, 2, 3], num_logits=0)
    assert first.reused_tokens == 0 and len(store) == 1
    (cold_f, cold_l, cold_k, cold_reused), (warm_f, warm_l, warm_k, warm_reused) = _cold_and_warm(panel_target, store, shared + [4, 5])
    assert cold_reused == 0 and warm_reused == length
    assert torch.equal(cold_f, warm_f) and torch.equal(cold_l, warm_l)
    assert all(torch.equal(a, b) for a, b in zip(cold_k, warm_k))
    if length <= LeanDecoder.shared(panel_target).fused.max_rows:  # one call either way: what a cache-less LM computes too
        plain = target_lm(panel_target).extend(shared + [4, 5], num_logits=1)
        assert torch.equal(plain.features, warm_f) and torch.equal(plain.logits, warm_l)


def test_a_whole_stored_sequence_is_restored_without_computing_anything(panel_target):
    store = PrefixCache(1 << 30)
    ids = list(range(3, 60))
    lm = target_lm(panel_target, prefixes=store)
    want = lm.extend(ids, num_logits=2)
    again = target_lm(panel_target, prefixes=store)
    got = again.extend(ids, num_logits=2)
    assert again.reused_tokens == len(ids) and store.stats.computed_tokens == len(ids)  # the first pass only
    assert torch.equal(got.features, want.features) and torch.equal(got.logits, want.logits)


def test_rolled_back_drafts_are_not_stored_with_a_released_sequence(panel_target):
    store = PrefixCache(1 << 30)
    lm = target_lm(panel_target, prefixes=store)
    lm.extend(list(range(3, 30)), num_logits=0)
    lm.extend([50, 51, 52, 53], num_logits=4)  # a verification pass ...
    lm.crop(len(lm) - 3)  # ... keeping one token
    lm.extend([60, 61], num_logits=2)
    kept = list(lm.token_ids)
    lm.release()
    assert store.longest_match(kept + [1]) == len(kept) and store.longest_match(kept[:-2] + [51]) == len(kept) - 2
    (cold_f, _, cold_k, _), (warm_f, _, warm_k, warm_reused) = _cold_and_warm(panel_target, store, kept + [7])
    assert warm_reused == len(kept) and torch.equal(cold_f, warm_f) and all(torch.equal(a, b) for a, b in zip(cold_k, warm_k))


def _decoders(model, prefix_mb: int | None):
    draft = noisy_copy(tiny_target(), noise=0.05)
    drafter = DraftModel(draft, prefix_cache=PrefixCache(prefix_mb << 20) if prefix_mb else None)
    return SpeculativeDecoder(model, drafter, gamma=4, prefix_cache=PrefixCache(prefix_mb << 20) if prefix_mb else None)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_speculative_decoding_with_prefix_reuse_emits_the_same_tokens(panel_target, sampling):
    system = list(range(10, 40))
    prompts = [system + [5, 6, 7], system + [8, 9], system + [5, 6, 7, 11]]
    cached, fresh = _decoders(panel_target, 64), _decoders(panel_target, None)
    answers = []
    for prompt in prompts:
        got = cached.generate(prompt, max_new_tokens=24, sampling=sampling, stop=[])
        want = fresh.generate(prompt, max_new_tokens=24, sampling=sampling, stop=[])
        assert got.token_ids == want.token_ids
        answers.append(got)
    assert [answer.stats.reused_prompt_tokens for answer in answers] == [0, len(system), len(prompts[0])]
    # A chat's next turn: the first prompt, its answer and more; all but the last answer token was cached.
    turn = prompts[0] + answers[0].token_ids + [12, 13]
    got = cached.generate(turn, max_new_tokens=16, sampling=sampling, stop=[])
    assert got.token_ids == fresh.generate(turn, max_new_tokens=16, sampling=sampling, stop=[]).token_ids
    assert got.stats.reused_prompt_tokens == len(prompts[0]) + len(answers[0].token_ids) - 1
    assert cached.drafter.prefix_cache.stats.hits >= 3  # the draft's own prompt passes reused too


def test_a_windowed_draft_keeps_its_start_across_a_conversations_turns_while_the_text_fits_two_windows():
    window = 8  # grid of 2 positions
    store = PrefixCache(1 << 20)
    prompt = list(range(100, 120))  # 20 tokens
    assert window_start(prompt[:8], window, store) == 0 and window_start(prompt, None, store) == 0
    assert window_start(prompt, window, None) == 12  # no cache: exactly the last 8
    assert window_start(prompt[:19], window, None) == 11 and window_start(prompt[:19], window, store) == 12  # cold: the grid start within the window
    store.store(prompt[12:], *_sequence(prompt[12:]))  # the first turn, as its draft saw it
    turn = prompt + [7, 7, 7]  # 23 tokens: its own window would start at 15 (grid 16)
    assert window_start(turn, window, store) == 12  # 3 tokens to compute from 12, 7 from 16
    assert window_start(turn[:-1] + [1], window, store) == 12
    longer = prompt + list(range(200, 210))  # 30 tokens: 12 leaves 18 > 2 windows
    assert window_start(longer, window, store) == 22
    store.store(longer[15:], *_sequence(longer[15:]))  # a stored start off the grid is never chosen
    assert window_start(longer, window, store) == 22
    store.store(longer[14:], *_sequence(longer[14:]))  # on the grid and within two windows: nothing to compute
    assert window_start(longer, window, store) == 14


def test_a_windowed_draft_with_prefix_reuse_prefills_only_the_new_turn_and_emits_the_same_tokens(panel_target):
    plain = SpeculativeDecoder(panel_target)
    drafter = DraftModel(noisy_copy(tiny_target(), noise=0.05), context_window=16, prefix_cache=PrefixCache(64 << 20))
    decoder = SpeculativeDecoder(panel_target, drafter, gamma=4, prefix_cache=PrefixCache(64 << 20))
    prompt = list(range(10, 40))  # 30 tokens: the draft starts at 16 (a grid of 4)
    first = decoder.generate(prompt, max_new_tokens=8, stop=[])
    turn = prompt + first.token_ids + [12, 13]  # 40 tokens: its own window would start at 24
    reused_before = drafter.prefix_cache.stats.reused_tokens
    second = decoder.generate(turn, max_new_tokens=8, stop=[])
    assert first.token_ids == plain.generate(prompt, max_new_tokens=8, stop=[]).token_ids
    assert second.token_ids == plain.generate(turn, max_new_tokens=8, stop=[]).token_ids
    assert window_start(turn, 16, drafter.prefix_cache) == 16
    # the draft restored the first turn's text from 16 on (its prompt part at least; the answer as far
    # as the draft had fed it). Starting at 24 instead, it would have found nothing stored.
    assert drafter.prefix_cache.stats.reused_tokens - reused_before >= len(prompt) - 16


def test_an_abandoned_stream_leaves_a_consistent_sequence(panel_target):
    decoder = _decoders(panel_target, 64)
    prompt = list(range(20, 50))
    stream = decoder.stream(prompt, max_new_tokens=40, stop=[])
    emitted = [token for _, step in zip(range(3), stream) for token in step.token_ids]
    stream.close()
    (cold_f, _, cold_k, _), (warm_f, _, warm_k, warm_reused) = _cold_and_warm(panel_target, decoder.prefix_cache, prompt + emitted)
    assert warm_reused == len(prompt) + len(emitted) - 1
    assert torch.equal(cold_f, warm_f) and all(torch.equal(a, b) for a, b in zip(cold_k, warm_k))


def test_prefix_reuse_needs_the_fused_stack():
    with pytest.raises(ValueError, match="prefix_cache cannot serve this target: it does not run the lean forward"):
        SpeculativeDecoder(tiny_target(), None, prefix_cache=PrefixCache(1 << 20))
    with pytest.raises(ValueError, match="prefix_cache must be a PrefixCache"):
        SpeculativeDecoder(tiny_target(), None, prefix_cache=1024)
    with pytest.raises(ValueError, match="prefix_cache needs the draft on the lean forward"):
        DraftModel(tiny_target(), lean=False, prefix_cache=PrefixCache(1 << 20))
    model = tiny_target()
    with pytest.raises(ValueError, match="an exact prefix cache needs the fused lean stack"):
        LeanLM(model, LeanDecoder(model, panel_kernels=False), prefixes=PrefixCache(1 << 20))
    # A drafter's LM need not be exact: without the fused stack it reuses prefixes all the same.
    loose = LeanLM(model, LeanDecoder(model, panel_kernels=False), prefixes=PrefixCache(1 << 20), row_exact=False)
    loose.extend(list(range(5, 40)), num_logits=0)
    loose.release()
    again = LeanLM(model, LeanDecoder(model, panel_kernels=False), prefixes=loose.prefixes, row_exact=False)
    again.extend(list(range(5, 42)), num_logits=1)
    assert again.reused_tokens == 35


def _serve(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int]]:
    """Submit ``prompts`` together; each one's tokens and its reused prompt positions."""
    return [(tokens, step.stats.reused_prompt_tokens) for tokens, step in serve_all(scheduler, prompts, max_tokens)]


def test_the_server_reuses_prefixes_across_requests_and_turns_with_the_same_tokens(panel_target):
    engine = _decoders(panel_target, None)
    system = list(range(10, 40))
    first = [system + [5, 6], system + [7, 8, 9], list(range(60, 70))]
    config = SchedulerConfig(gamma=3, gamma_policy=BatchGammaPolicy(full_until=8, off_from=40), prefix_cache_mb=64)
    drafter = DraftModel(noisy_copy(tiny_target(), noise=0.05), prefix_cache=PrefixCache(64 << 20))
    scheduler = Scheduler(panel_target, drafter, None, config)
    assert scheduler.target.prefixes is not None
    try:
        got = _serve(scheduler, first[:1], 12)  # alone first: the system prompt is then stored
        got += _serve(scheduler, first[1:], 12)  # together, sharing passes
        answer = got[0][0]
        turn = first[0] + answer + [11, 12]
        got += _serve(scheduler, [turn, first[2]], 12)
    finally:
        scheduler.stop()
    prompts = first + [turn, first[2]]
    assert [tokens for tokens, _ in got] == [engine.generate(prompt, max_new_tokens=12, stop=[]).token_ids for prompt in prompts]
    assert [reused for _, reused in got] == [0, len(system), 0, len(first[0]) + len(answer) - 1, len(first[2]) - 1]
    assert scheduler.metrics.reused_prompt_tokens._value.get() == sum(reused for _, reused in got)
    with pytest.raises(ValueError, match="prefix_cache_mb must be an integer >= 0"):
        SchedulerConfig(prefix_cache_mb=-1)


def test_cli_prefix_cache_options_reach_the_server_and_bench_and_are_validated(capsys):
    from verispec import cli
    from verispec.cli import _build_parser, draft_model_settings, serve_config
    from verispec.engine.prefix_cache import DEFAULT_PREFIX_CACHE_MB

    assert cli.DEFAULT_PREFIX_CACHE_MB == DEFAULT_PREFIX_CACHE_MB
    served = _build_parser().parse_args(["serve"])
    assert serve_config(served).scheduler.prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB and draft_model_settings(served).prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB
    off = _build_parser().parse_args(["serve", "--prefix-cache-mb", "0"])
    assert serve_config(off).scheduler.prefix_cache_mb == 0 and draft_model_settings(off).prefix_cache_mb == 0
    assert _build_parser().parse_args(["bench"]).prefix_cache_mb == 0
    assert cli.main(["bench", "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb must be >= 0 (0 = off), got -1" in capsys.readouterr().err


def test_a_bench_method_keeps_its_own_prefix_caches_and_forgets_them(panel_target):
    from types import SimpleNamespace

    from verispec.bench.methods import build_method

    target, draft = SimpleNamespace(model=panel_target, name="t", tokenizer=None), SimpleNamespace(model=noisy_copy(tiny_target(), 0.05), name="d", tokenizer=None)
    plain, spec = (build_method(name, target, draft, 4, prefix_cache_mb=8) for name in ("plain", "ngram+draft-adaptive"))
    assert len(plain.prefix_caches) == 1 and len(spec.prefix_caches) == 2
    assert plain.prefix_caches[0] is not spec.prefix_caches[0]  # no method starts from another's prompts
    prompt = list(range(10, 50))
    first = spec.run(prompt, 8, SamplingParams())
    again = spec.run(prompt + [3], 8, SamplingParams())
    assert (first.reused_prompt_tokens, again.reused_prompt_tokens) == (0, len(prompt)) and again.token_ids == plain.run(prompt + [3], 8, SamplingParams()).token_ids
    spec.forget()
    assert spec.run(prompt + [3], 8, SamplingParams()).reused_prompt_tokens == 0
    assert build_method("plain", target, draft, 4).prefix_caches == []
    assert len(build_method("plain:prefix=8", target, draft, 4).prefix_caches) == 1  # a method's own key
    assert build_method("plain:prefix=0", target, draft, 4, prefix_cache_mb=8).prefix_caches == []


def tiny_chat_target(tmp_path, wrap=lambda model: model):
    """A tiny target served with the tiny GGUF's real tokenizer and chat template (``wrap``: e.g. our panel kernels)."""
    from tiny_models import write_tiny_qwen2_gguf
    from transformers import AutoTokenizer

    from verispec.models import LoadedModel

    write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    return LoadedModel(model=wrap(tiny_target(vocab_size=len(tokenizer))), tokenizer=tokenizer, name="tiny", path=None)


def test_a_served_conversation_starts_each_turn_from_the_earlier_ones(tmp_path):
    import asyncio

    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from test_server import Server

    from verispec.serving import ServeConfig, create_app
    from verispec.serving.loadtest import format_table, run_level

    target = tiny_chat_target(tmp_path, use_panel_kernels)

    def served(prefix_mb: int):
        server = Server(create_app(ServeConfig(model_id="tiny", scheduler=SchedulerConfig(gamma=3, prefix_cache_mb=prefix_mb)), target, None))
        try:
            result = asyncio.run(run_level(server.url, "tiny", ["def add the hello", "print x in range"], 2, 12, 3, None, conversation=True))
            metrics = {sample.name: sample.value for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text) for sample in family.samples}
        finally:
            server.close()
        return result, metrics

    result, metrics = served(64)
    assert result.requests == 6 and result.median_followup_ttft_s is not None and "turns 2+" in format_table([result])
    assert len(result.median_ttft_by_turn) == 3
    low, middle, high = result.prompt_tokens  # the server's counts: later turns hold the conversation so far
    assert 0 < low <= middle <= high and low < high
    assert f"concurrency 2, prompt tokens per request (server usage): median {middle} (min {low}, max {high})" in format_table([result])
    assert f"concurrency 2, median TTFT (s) by turn: 1: {result.median_ttft_by_turn[0]:.2f}, 2: " in format_table([result])
    # Later turns restore the earlier turns (up to where the answer's text re-tokenizes differently).
    assert metrics["verispec_reused_prompt_tokens_total"] > 0.3 * metrics["verispec_prompt_tokens_total"]
    _, without = served(0)
    # The same conversations (later prompts hold the answers: equal totals, equal answers' lengths), nothing reused.
    assert without["verispec_reused_prompt_tokens_total"] == 0 and without["verispec_prompt_tokens_total"] == metrics["verispec_prompt_tokens_total"]


def test_a_conversation_load_test_reports_the_median_time_to_first_token_of_each_turn():
    from verispec.serving.loadtest import RequestTiming, _median_ttft_by_turn

    timings = [RequestTiming(9.0, ttft, 10, turn=turn) for turn, ttft in [(1, 4.0), (2, 1.0), (1, 2.0), (2, 3.0), (1, 9.0), (3, 0.5), (2, 2.5)]]
    assert _median_ttft_by_turn(timings) == (4.0, 2.5, 0.5)


def test_a_load_test_reports_the_median_decoding_rate_after_the_first_token():
    from verispec.serving.loadtest import LevelResult, RequestTiming, _median_decode_rate, format_table

    # (latency, TTFT, tokens): 9 tokens in 2 s after the first, 4 in 4 s, 19 in 2 s; a 1-token answer has no rate
    timings = [RequestTiming(3.0, 1.0, 10), RequestTiming(6.0, 2.0, 5), RequestTiming(2.5, 0.5, 20), RequestTiming(1.0, 1.0, 1)]
    assert _median_decode_rate(timings) == 4.5
    assert _median_decode_rate([RequestTiming(1.0, 1.0, 1)]) is None
    row = format_table([LevelResult(4, 10.0, 3.0, 6.0, 1.0, 4, median_decode_tokens_per_s=4.5)]).splitlines()[2]
    assert row == "| 4 | 4 | 10.00 | 3.00 | 6.00 | 1.00 | 4.50 |"


def test_loadtest_names_its_servers_and_refuses_bad_ones():
    from verispec.serving.loadtest import Served, parse_servers

    assert parse_servers(["http://127.0.0.1:8000/", "plain=http://127.0.0.1:8001", "https://h:1/x?a=b"]) == [
        Served("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),  # a bare URL labels itself
        Served("plain", "http://127.0.0.1:8001"),
        Served("https://h:1/x?a=b", "https://h:1/x?a=b"),  # '=' in a query is not a name
    ]
    for bad, message in [(["plain=127.0.0.1:8000"], "NAME=URL with an http\\(s\\) URL"), (["=http://h"], "NAME=URL"), (["a=http://x", "a=http://y"], "names must differ")]:
        with pytest.raises(ValueError, match=message):
            parse_servers(bad)


def test_side_by_side_runs_reverse_the_server_order_and_report_medians_of_ratios():
    from verispec.serving.loadtest import LevelResult, Served, format_comparison, side_by_side_order

    a, b, c = Served("a", "http://a"), Served("b", "http://b"), Served("c", "http://c")
    assert [side_by_side_order([a, b, c], run) for run in range(3)] == [[a, b, c], [c, b, a], [a, b, c]]

    def level(rate, decode=None):
        return LevelResult(4, rate, 1.0, 2.0, 0.5, 4, median_decode_tokens_per_s=decode)

    # Three runs at one level: b's ratios to a are 2.0, 1.5, 1.0 (median 1.5) although the median
    # rates (20 against 12) would say 1.67: ratios are taken run by run.
    results = {(0, "a"): [level(10.0, 3.0), level(12.0, 5.0), level(30.0, 4.0)], (0, "b"): [level(20.0), level(18.0), level(30.0)]}
    rows = format_comparison([4], [a, b], results).splitlines()
    assert rows[0].startswith("| concurrency | server | total tok/s, median (min-max) of 3 | vs a, median (min-max) |")
    assert rows[2] == "| 4 | a | 12.00 (10.00-30.00) | 1.00x (1.00-1.00) | 4.00 | 0.50 |"
    assert rows[3] == "| 4 | b | 20.00 (18.00-30.00) | 1.50x (1.00-2.00) | - | 0.50 |"


def test_loadtest_loads_two_servers_side_by_side(tmp_path, capsys):
    from test_server import Server

    from verispec.cli import main
    from verispec.serving import ServeConfig, create_app

    target = tiny_chat_target(tmp_path)
    servers = [Server(create_app(ServeConfig(model_id="tiny", scheduler=SchedulerConfig(gamma=3)), target, None)) for _ in range(2)]
    try:
        args = ["loadtest", "--url", f"plain={servers[0].url}", "--url", f"other={servers[1].url}", "--concurrency", "1,2", "--max-tokens", "4", "--requests-per-client", "1", "--repeat", "2", "--long-prompts", "64"]  # short enough for the tiny context
        assert main(args) == 0
    finally:
        for server in servers:
            server.close()
    captured = capsys.readouterr()
    progress = [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("run ")]
    assert progress == [
        "run 1/2, concurrency 1, plain", "run 1/2, concurrency 1, other", "run 1/2, concurrency 2, plain", "run 1/2, concurrency 2, other",
        "run 2/2, concurrency 1, other", "run 2/2, concurrency 1, plain", "run 2/2, concurrency 2, other", "run 2/2, concurrency 2, plain",
    ]  # fmt: skip
    rows = [line for line in captured.out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [row.split(" | ")[:2] for row in rows] == [["| 1", "plain"], ["| 1", "other"], ["| 2", "plain"], ["| 2", "other"]]
    assert all(" 1.00x (1.00-1.00) " in row for row in rows if "plain" in row)


def test_a_server_dying_mid_load_test_is_a_message_and_the_finished_levels_are_kept(capsys):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from test_server import Server

    from verispec.cli import main

    requests = []

    async def models(request):
        return JSONResponse({"data": [{"id": "m"}]})

    async def chat(request):
        requests.append(await request.json())
        dies = len(requests) > 1  # the first request is answered whole, the second breaks off mid-stream

        async def stream():
            delta = {"choices": [{"delta": {"content": "x"}}]}
            yield f"data: {json.dumps(delta)}\n\n"
            if dies:
                raise ConnectionResetError("the server went away")
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 1, 'prompt_tokens': 7}})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    server = Server(Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])]))
    try:
        code = main(["loadtest", "--url", f"flaky={server.url}", "--concurrency", "1,1", "--max-tokens", "4", "--requests-per-client", "1"])
    finally:
        server.close()
    captured = capsys.readouterr()
    assert code == 2 and len(requests) == 2
    # The last line says what happened; no traceback of ours (the one above it is the fake server's own log).
    assert captured.err.strip().splitlines()[-1].startswith(f"verispec loadtest: error: {server.url}: a request failed after")
    assert "RemoteProtocolError" in captured.err and "verispec/serving/loadtest.py" not in captured.err
    # The first level's table survives the second level's failure.
    assert "finished before the error (flaky):" in captured.out
    assert [line.split(" | ")[:2] for line in captured.out.splitlines() if line.startswith("| 1 |")] == [["| 1", "1"]]
