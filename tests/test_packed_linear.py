"""oneDNN-packed linears: same numbers as nn.Linear (to rounding), same greedy output."""

import pytest
import torch

from tiny_models import noisy_copy, tiny_target
from verispec import DraftModel, SpeculativeDecoder
from verispec.models.packed_linear import PackedLinear, onednn_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_packing_available(), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_matches_dense_linear(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear, min_packed_rows=4)
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
