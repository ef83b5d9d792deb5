"""The acceptance monitor: counters add up, speed-up estimate, one warning per dip below the floor."""

import json
import logging

import pytest

from verispec.engine.monitor import AcceptanceMonitor, MonitorConfig


def test_counters_add_up_per_scope_and_window():
    monitor = AcceptanceMonitor(MonitorConfig(window=4, min_rounds=1, plain_step_s=0.3))
    rounds = [(4, 4, 5, 0.5), (4, 1, 2, 0.5), (4, 0, 1, 0.5), (2, 2, 3, 0.4), (4, 3, 4, 0.5)]
    for drafted, accepted, emitted, seconds in rounds:
        monitor.record(("global", "request:1"), drafted, accepted, emitted, seconds)
    snap = monitor.snapshot("global")
    kept = rounds[1:]  # the window holds the last 4 rounds
    assert snap.rounds == 4
    assert (snap.drafted, snap.accepted, snap.emitted) == tuple(sum(r[i] for r in kept) for i in range(3))
    assert snap.alpha == pytest.approx(6 / 14) and snap.tau == pytest.approx(10 / 4)
    assert snap.acceptance_by_position == pytest.approx([3 / 4, 2 / 4, 1 / 3, 0 / 3])
    assert snap.speedup == pytest.approx(10 / 1.9 * 0.3)
    assert monitor.snapshot("request:1") == snap
    monitor.forget("request:1")
    assert monitor.scopes() == ["global"] and monitor.snapshot("request:1").rounds == 0


def test_plain_steps_teach_the_monitor_what_plain_decoding_costs():
    monitor = AcceptanceMonitor(MonitorConfig(min_rounds=1, smoothing=0.5))
    monitor.record(("global",), 4, 4, 5, 0.6)
    assert monitor.snapshot("global").speedup is None  # no plain step seen, none given
    monitor.record(("global",), 0, 0, 1, 0.2)
    monitor.record(("global",), 0, 0, 1, 0.4)
    assert monitor.plain_step_s == pytest.approx(0.3)
    assert monitor.snapshot("global").speedup == pytest.approx(7 / 1.2 * 0.3)


def test_warns_once_below_the_floor_and_again_only_after_recovering(caplog):
    monitor = AcceptanceMonitor(MonitorConfig(window=8, min_rounds=8, plain_step_s=0.3))
    caplog.set_level(logging.INFO, logger="verispec.monitor")

    def rounds(count, accepted):  # 4 drafts, a round costs 0.45 s: pays only above ~1.5 tokens a call
        for _ in range(count):
            monitor.record(("global", "key:abc"), 4, accepted, accepted + 1, 0.45)

    rounds(8, 4)  # 5 tokens / 0.45 s vs 1 / 0.3 s: 3.3x
    assert monitor.warnings == 0
    rounds(8, 0)  # attacked: 1 token a call, 0.67x
    warnings = [json.loads(r.message) for r in caplog.records if r.levelno == logging.WARNING]
    assert monitor.warnings == 2 and {w["scope"] for w in warnings} == {"global", "key:abc"}
    assert all(w["event"] == "speculation_below_floor" and w["speedup"] < 1 for w in warnings)
    rounds(8, 0)  # still below: no new warning
    assert monitor.warnings == 2
    rounds(8, 4)  # recovered, then collapses again: warned again
    rounds(8, 0)
    assert monitor.warnings == 4


def test_alpha_floor_without_a_plain_cost_and_no_verdict_on_thin_evidence():
    monitor = AcceptanceMonitor(MonitorConfig(window=16, min_rounds=10, alpha_floor=0.3))
    for _ in range(9):
        monitor.record(("global",), 4, 0, 1, 0.5)
    assert monitor.warnings == 0  # 9 rounds < min_rounds
    monitor.record(("global",), 4, 0, 1, 0.5)
    assert monitor.warnings == 1


def test_bad_config_and_bad_rounds_are_refused():
    with pytest.raises(ValueError, match="min_rounds"):
        MonitorConfig(window=4, min_rounds=5)
    with pytest.raises(ValueError, match="alpha_floor"):
        MonitorConfig(alpha_floor=1.5)
    with pytest.raises(ValueError, match="inconsistent round"):
        AcceptanceMonitor().record(("global",), 2, 3, 4, 0.1)


def test_the_engine_reports_every_round_and_stays_exact():
    from tiny_models import noisy_copy, tiny_target
    from verispec import DraftModel, SpeculativeDecoder

    target = tiny_target()
    prompt = [3, 17, 5, 9, 3, 17]
    reference = SpeculativeDecoder(target).generate(prompt, 30, stop=[]).token_ids
    monitor = AcceptanceMonitor(MonitorConfig(window=1000, min_rounds=1))
    decoder = SpeculativeDecoder(target, DraftModel(noisy_copy(target, noise=0.3)), gamma=3, monitor=monitor)
    steps = list(decoder.stream(prompt, 30, stop=[]))
    assert [t for step in steps for t in step.token_ids] == reference  # the monitor only watches
    stats = steps[-1].stats
    last = steps[-1].rolling
    assert (last.rounds, last.drafted, last.accepted, last.emitted) == (stats.target_calls, stats.num_drafted, stats.num_accepted, stats.new_tokens)
    assert last.acceptance_by_position == pytest.approx(stats.acceptance_by_position)
    assert [step.rolling.rounds for step in steps] == list(range(1, len(steps) + 1))
    # The generation's own scope is forgotten when it ends; the global one keeps counting.
    assert monitor.scopes() == ["global"] and monitor.snapshot("global").emitted == 30
    decoder.generate(prompt, 10, stop=[])
    assert monitor.snapshot("global").emitted == 40
