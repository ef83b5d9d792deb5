"""`verispec replay`: recorded greedy traces replay the engine's rounds; modelled costs; the CLI."""

import json

import pytest

from tiny_models import noisy_copy, tiny_target, write_tiny_qwen2_gguf
from verispec import DraftModel, SpeculativeDecoder
from verispec.bench.replay import DraftTrace, ReplayCosts, record_trace, replay, summarize_replays
from verispec.cli import main
from verispec.drafters import NgramDrafter
from verispec.drafters.ngram import LookupRule
from verispec.replay_cli import parse_verify_ms

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]  # repeats, so lookup has something to copy


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    return target, DraftModel(noisy_copy(target, 0.3))


@pytest.fixture(scope="module")
def trace(models):
    target, drafter = models
    return record_trace("p", SpeculativeDecoder(target), drafter, PROMPT, 40)


COSTS = ReplayCosts({1: 0.10, 4: 0.13, 8: 0.17}, draft_step_s=0.02)


def test_costs_interpolate_between_measured_rows_and_extend_the_last_slope():
    assert COSTS.verify(1) == 0.10 and COSTS.verify(4) == 0.13
    assert COSTS.verify(2) == pytest.approx(0.11) and COSTS.verify(6) == pytest.approx(0.15)
    assert COSTS.verify(12) == pytest.approx(0.21)  # past 8 rows: 0.01 a row, as from 4 to 8
    assert ReplayCosts({1: 0.1}, 0.0).verify(9) == 0.1
    with pytest.raises(ValueError, match="1 row"):
        ReplayCosts({2: 0.1}, 0.01)
    with pytest.raises(ValueError, match="draft_step_s"):
        ReplayCosts({1: 0.1}, -1.0)
    assert parse_verify_ms("1:237, 4:273") == {1: 0.237, 4: 0.273}
    for bad in ("4:273", "1:abc", "1=2", "1:0"):
        with pytest.raises(ValueError, match="--verify-ms"):
            parse_verify_ms(bad)


def test_the_trace_is_the_greedy_answer_and_the_drafts_view_of_it(models, trace):
    target, drafter = models
    assert trace.answer_ids == SpeculativeDecoder(target).generate(PROMPT, 40, stop=[]).token_ids
    assert len(trace.draft_tokens) == len(trace.draft_probs) == 40 and all(0 < p <= 1 for p in trace.draft_probs)
    # The draft's view at position i: its greedy token given the prompt and the answer's first i tokens.
    assert trace.draft_tokens[:3] == SpeculativeDecoder(drafter.model).generate(PROMPT, 1, stop=[]).token_ids + [
        SpeculativeDecoder(drafter.model).generate(PROMPT + trace.answer_ids[:i], 1, stop=[]).token_ids[0] for i in (1, 2)
    ]
    with pytest.raises(ValueError, match="one entry per answer token"):
        DraftTrace("bad", [1], [2, 3], [2], [0.5])


def test_lookup_replay_reproduces_the_engines_rounds(trace, models):
    target, _ = models
    real = SpeculativeDecoder(target, NgramDrafter(LookupRule()), gamma=4).generate(PROMPT, 40, stop=[]).stats
    replayed = replay(trace, "ngram:gamma=4:tune=0", COSTS)
    assert (replayed.target_calls, replayed.drafted, replayed.accepted) == (real.target_calls, real.num_drafted, real.num_accepted)


def test_draft_model_replay_reproduces_the_engines_rounds(trace, models):
    target, drafter = models
    # Past its first wrong draft the draft's recorded continuation stands in for it: with a path stop
    # at or above the recording's floor, every round drafts and accepts what the engine's does.
    stopping = DraftModel(drafter.model, path_confidence=0.05)  # (the floor: the longest rounds past a wrong token)
    real = SpeculativeDecoder(target, stopping, gamma=6).generate(PROMPT, 40, stop=[]).stats
    replayed = replay(trace, "draft-model:gamma=6:path=0.05", COSTS)
    assert replayed.drafted_per_round == real.drafted_per_round and replayed.accepted_per_round == real.accepted_per_round
    assert any(d > a + 1 for d, a in zip(real.drafted_per_round, real.accepted_per_round))  # rounds that draft on past a wrong token
    assert replayed.seconds == pytest.approx(sum(d * 0.02 + COSTS.verify(d + 1) for d in replayed.drafted_per_round))
    assert replayed.plain_seconds == pytest.approx(40 * 0.10)
    # Without a stop the engine drafts gamma every round; the replay drafts as far as the recording goes.
    free = SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPT, 40, stop=[]).stats
    replayed = replay(trace, "draft-model:gamma=4", COSTS)
    assert replayed.accepted_per_round == free.accepted_per_round and replayed.drafted <= free.num_drafted


def test_path_stops_and_adaptive_settings_replay(trace):
    free = replay(trace, "draft-model:gamma=8", COSTS)
    stopped = replay(trace, "draft-model:gamma=8:path=0.9", COSTS)
    assert stopped.drafted < free.drafted  # the stop drafts less
    adaptive = replay(trace, "ngram+draft-adaptive:gamma=8:path=0.45", COSTS)
    assert adaptive.new_tokens == 40 and 1 <= 40 / adaptive.target_calls <= 9
    summary = summarize_replays([free, stopped], ["draft-model:gamma=8", "draft-model:gamma=8:path=0.9", "absent"])
    assert [s.setting for s in summary] == ["draft-model:gamma=8", "draft-model:gamma=8:path=0.9"]
    assert summary[0].median_speedup == pytest.approx(free.speedup) and summary[0].tokens_per_call == pytest.approx(40 / free.target_calls)
    with pytest.raises(ValueError, match="replay settings take"):
        replay(trace, "eagle:gamma=4", COSTS)


def test_cli_records_traces_once_and_replays_settings(tmp_path, capsys, monkeypatch):
    model = tmp_path / "tiny.gguf"
    write_tiny_qwen2_gguf(model)
    args = ["replay", "--target", str(model), "--draft", str(model), "--first", "1", "--num-prompts", "2", "--max-new-tokens", "6",
            "--settings", "draft-model:gamma=3,ngram+draft-adaptive:gamma=4", "--verify-ms", "1:10,4:12", "--draft-ms", "2",
            "--target-kernels", "dense", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "draft-model:gamma=3" in out and "ngram+draft-adaptive:gamma=4" in out
    result = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert result["prompts"] == ["HumanEval/1", "HumanEval/2"] and len(result["rows"]) == 4
    assert list(result["by_category"]) == ["humaneval"] and {row["category"] for row in result["rows"]} == {"humaneval"}
    assert [s["setting"] for s in result["by_category"]["humaneval"]] == ["draft-model:gamma=3", "ngram+draft-adaptive:gamma=4"]
    assert json.loads((tmp_path / "out" / "traces.json").read_text())["max_new_tokens"] == 6
    # A second run reuses the traces: no model is loaded.
    import verispec.models

    monkeypatch.setattr(verispec.models, "load_model", lambda *a, **k: pytest.fail("traces should be reused"))
    assert main(args) == 0
    # ...but not for the target served in another precision: its answers differ.
    monkeypatch.setattr(verispec.models, "load_model", lambda *a, **k: pytest.fail("recording again"))
    with pytest.raises(pytest.fail.Exception, match="recording again"):
        main([*args, "--target-dtype", "bfloat16"])
    assert main([*args[:-2], "--settings", "eagle", "--out", str(tmp_path / "out")]) == 2
    assert "replay takes draft-model" in capsys.readouterr().err
    assert main([*args, "--first", "-1"]) == 2
    assert "--first must be >= 0" in capsys.readouterr().err
