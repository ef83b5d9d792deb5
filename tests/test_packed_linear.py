"""oneDNN-packed linears: same numbers as nn.Linear (to rounding), same greedy output."""

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SpeculativeDecoder
from verispec.models import packed_linear
from verispec.models.packed_linear import PackedLinear, choose_min_packed_rows, fastest_min_packed_rows, onednn_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_packing_available(), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("min_packed_rows", [1, 4])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_matches_dense_linear(rows, min_packed_rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear, min_packed_rows=min_packed_rows)
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_greedy_output():
    target = tiny_target()
    reference = SpeculativeDecoder(target, DraftModel(noisy_copy(target, 0.2)), gamma=5).generate([1, 2, 3], 40, stop=[])
    packed = pack_linears(tiny_target())
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    result = SpeculativeDecoder(packed, DraftModel(noisy_copy(target, 0.2)), gamma=5).generate([1, 2, 3], 40, stop=[])
    assert result.token_ids == reference.token_ids
    assert result.stats.accepted_per_round == reference.stats.accepted_per_round


def test_bad_threshold():
    with pytest.raises(ValueError, match="min_packed_rows"):
        pack_linears(tiny_target(), min_packed_rows=0)


def test_bad_threshold_measurement_arguments():
    with pytest.raises(ValueError, match="repeats"):
        fastest_min_packed_rows(PackedLinear(torch.nn.Linear(64, 48), min_packed_rows=4), repeats=0)
    with pytest.raises(ValueError, match="same, non-empty set of row counts"):
        choose_min_packed_rows({1: 1.0, 2: 1.0}, {1: 1.0})


@pytest.mark.parametrize(
    "packed_s, expected",
    [
        ({1: 0.7, 2: 0.7, 3: 0.8}, 1),  # packed faster everywhere (the AMD machine)
        ({1: 1.2, 2: 1.3, 3: 1.4}, 4),  # dense faster for few rows (the Xeon): packed from 4 rows only
        ({1: 1.1, 2: 0.9, 3: 0.9}, 2),
        ({1: 0.9, 2: 1.1, 3: 0.9}, 3),  # a loss at 2 rows keeps 1-2 rows dense even though 1 row won
        ({1: 0.9, 2: 0.9, 3: 1.01}, 4),
    ],
)
def test_threshold_is_the_smallest_row_count_from_which_packed_never_loses(packed_s, expected):
    dense_s = {1: 1.0, 2: 1.0, 3: 1.0}
    assert choose_min_packed_rows(dense_s, packed_s) == expected


def test_measured_threshold_is_a_valid_row_count():
    assert 1 <= fastest_min_packed_rows(PackedLinear(torch.nn.Linear(256, 512), min_packed_rows=4), repeats=3) <= 4


def test_pack_linears_measures_the_threshold_on_the_largest_body_linear(monkeypatch):
    model = tiny_target()
    output_layer = model.get_output_embeddings()
    body = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not output_layer]
    timed = []

    def fake_measure(linear, repeats=5):
        timed.append(linear)
        return 3

    monkeypatch.setattr(packed_linear, "fastest_min_packed_rows", fake_measure)
    pack_linears(model)
    assert len(timed) == 1 and isinstance(timed[0], PackedLinear)
    assert timed[0].weight is max(body, key=lambda linear: linear.weight.numel()).weight
    assert output_layer.weight.numel() > timed[0].weight.numel()  # the vocabulary-sized head is skipped
    assert {m.min_packed_rows for m in model.modules() if isinstance(m, PackedLinear)} == {3}
    timed.clear()
    pack_linears(tiny_target(), min_packed_rows=2)  # an explicit threshold is not measured
    assert timed == []
