"""--target-kernels auto: which weights are timed, how the pick is made, and what the CLI does with it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_target

from verispec.models import kernel_choice
from verispec.models.kernel_choice import LONG_PASS_ROWS, LONG_PASS_WEIGHTS, TIMED_ROWS, KernelChoice, fastest_target_kernels, head_slice, sweep_weights, time_sweeps
from verispec.models.packed_linear import onednn_packing_available
from verispec.models.panel_linear import PanelLinear, panel_kernels_unavailable_reason

both_kernels = pytest.mark.skipif(
    panel_kernels_unavailable_reason() is not None or not onednn_packing_available(), reason="needs the panel kernels and oneDNN packing"
)


def test_sweep_takes_the_largest_body_weights_never_the_output_layer():
    model = tiny_target()
    everything = sweep_weights(model, min_bytes=1 << 40)  # more than the model holds: every body linear
    assert model.lm_head not in everything and len(everything) == 7 * model.config.num_hidden_layers
    sizes = [layer.weight.numel() for layer in everything]
    assert sizes == sorted(sizes, reverse=True)
    one = sweep_weights(model, min_bytes=1)
    assert one == everything[:1]
    enough = sweep_weights(model, min_bytes=sizes[0] * 4 + 1)  # just over one weight's bytes: two weights
    assert enough == everything[:2]
    with pytest.raises(ValueError, match="min_bytes"):
        sweep_weights(model, min_bytes=0)


def test_sweeps_are_timed_per_row_count_for_every_kernel():
    calls = {"a": [], "b": []}
    kernels = {name: [lambda x, name=name: calls[name].append(x.shape)] * 2 for name in calls}
    seconds = time_sweeps(kernels, in_features=[5, 5], repeats=2)
    assert set(seconds) == {"a", "b"} and all(set(by_rows) == set(TIMED_ROWS) for by_rows in seconds.values())
    # (1 warm-up + 2 timed sweeps) x 2 weights per row count, with inputs of the right shape
    assert calls["a"] == [(rows, 5) for rows in TIMED_ROWS for _ in range(3 * 2)]
    with pytest.raises(ValueError, match="repeats"):
        time_sweeps(kernels, in_features=[5, 5], repeats=0)


@both_kernels
def test_the_pick_is_the_smaller_total_over_the_timed_rows(monkeypatch):
    fake = {"panel": {1: 1.0, 8: 5.0}, "packed": {1: 2.0, 8: 3.0}}  # panel wins a step, packed the total
    monkeypatch.setattr(kernel_choice, "time_sweeps", lambda kernels, in_features, repeats, row_counts=TIMED_ROWS: fake)
    choice = fastest_target_kernels(tiny_target())
    assert choice.name == "packed" and choice.seconds == fake and choice.num_weights > 0
    assert "packed (timed here" in choice.summary() and "panel 1000.0 / 5000.0" in choice.summary()
    assert choice.long_passes == "dense" and not choice.long_pass_seconds  # packed: prefill stays torch's


@both_kernels
@pytest.mark.parametrize("faster", ["panel", "dense"])
def test_a_panel_pick_times_prefill_products_in_panel_chunks_against_dense(monkeypatch, faster):
    timed = {}

    def fake(kernels, in_features, repeats, row_counts=TIMED_ROWS):
        if row_counts == (LONG_PASS_ROWS,):
            timed.update(kernels)
            return {"panel": {LONG_PASS_ROWS: 1.0 if faster == "panel" else 3.0}, "dense": {LONG_PASS_ROWS: 2.0}}
        return {"panel": {rows: 1.0 for rows in row_counts}, "packed": {rows: 2.0 for rows in row_counts}}

    monkeypatch.setattr(kernel_choice, "time_sweeps", fake)
    choice = fastest_target_kernels(tiny_target())
    assert choice.name == "panel" and choice.long_passes == faster
    assert ("prefill products in panel chunks" in choice.summary()) == (faster == "panel") and f"ms for {LONG_PASS_ROWS} rows" in choice.summary()
    assert all(layer.chunk_long_passes for layer in timed["panel"]) and len(timed["dense"]) == len(timed["panel"]) <= LONG_PASS_WEIGHTS
    x = torch.randn(LONG_PASS_ROWS, timed["panel"][0].in_features)
    torch.testing.assert_close(timed["panel"][0](x), timed["dense"][0](x), atol=1e-4, rtol=1e-4)  # the same product, two ways


@both_kernels
def test_a_real_timing_on_a_tiny_model_picks_one_of_the_two():
    choice = fastest_target_kernels(tiny_target(), repeats=1)
    assert choice.name in ("panel", "packed") and set(choice.seconds) == {"panel", "packed"}
    assert set(choice.long_pass_seconds) == ({"panel", "dense"} if choice.name == "panel" else set())
    assert all(seconds > 0 for by_rows in choice.seconds.values() for seconds in by_rows.values())


def test_one_family_available_is_taken_untimed_and_none_is_refused(monkeypatch):
    monkeypatch.setattr(kernel_choice, "panel_kernels_unavailable_reason", lambda: "no C++ compiler")
    monkeypatch.setattr(kernel_choice, "onednn_packing_available", lambda: True)
    monkeypatch.setattr(kernel_choice, "time_sweeps", lambda *args: pytest.fail("nothing to compare: must not time"))
    choice = fastest_target_kernels(tiny_target())
    assert choice == KernelChoice("packed") and "the only kernels that run here" in choice.summary()
    monkeypatch.setattr(kernel_choice, "onednn_packing_available", lambda: False)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        fastest_target_kernels(tiny_target())


def test_the_head_slice_keeps_the_heads_share_of_a_pass_and_is_a_view():
    model = tiny_target()
    body = sweep_weights(model, min_bytes=1 << 40)
    whole = head_slice(model, body)
    assert whole.out_features == model.lm_head.out_features and whole.weight.data_ptr() == model.lm_head.weight.data_ptr()
    one = body[:1]
    share = one[0].weight.numel() / sum(layer.weight.numel() for layer in body)
    part = head_slice(model, one)
    assert part.out_features == round(model.lm_head.out_features * share) and part.in_features == model.lm_head.in_features
    assert torch.equal(part.weight, model.lm_head.weight[: part.out_features])
    assert head_slice(model, []) is None
    model.lm_head = torch.nn.Identity()  # not a float32 linear: nothing to time
    assert head_slice(model, body) is None


@both_kernels
def test_a_greedy_run_times_the_panel_head_as_the_int8_screen(monkeypatch):
    seen = {}

    def fake(kernels, in_features, repeats, row_counts=TIMED_ROWS):
        if row_counts != TIMED_ROWS:  # the prefill timing after a panel pick
            return {name: {rows: 1.0 for rows in row_counts} for name in kernels}
        seen.update(kernels=kernels, in_features=in_features)
        return {"panel": {rows: 1.0 for rows in TIMED_ROWS}, "packed": {rows: 2.0 for rows in TIMED_ROWS}}

    monkeypatch.setattr(kernel_choice, "time_sweeps", fake)
    model = tiny_target()
    vocab, width = model.lm_head.weight.shape
    features = torch.randn(3, width)
    expected = model.lm_head(features)
    plain = fastest_target_kernels(model)
    assert not plain.screened_head and plain.head_rows == vocab and "LM-head rows, ms" in plain.summary()
    assert isinstance(seen["kernels"]["panel"][-1], PanelLinear) and seen["in_features"][-1] == width
    packed_head = seen["kernels"]["packed"][-1]
    assert torch.allclose(packed_head(features), expected, atol=1e-5)
    choice = fastest_target_kernels(model, screened_head=True)
    assert choice.screened_head and "LM-head rows (screened on panel)" in choice.summary()
    screen = seen["kernels"]["panel"][-1]
    assert not isinstance(screen, PanelLinear) and len(seen["kernels"]["panel"]) == len(seen["kernels"]["packed"])
    # the screen's approximate logits: close to the head's, not computed in float32
    approx = screen(features)
    assert approx.shape == expected.shape and not torch.equal(approx, expected)
    assert (approx - expected).abs().max() < 0.05 * expected.abs().max()
