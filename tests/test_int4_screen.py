"""The 4-bit screen of an int8 draft head: its layout, its values (4-bit everywhere, the int8 head's
bit for bit in the candidates' panels), where it runs, and that greedy drafts come out the same."""

import argparse

import pytest
import torch

from tiny_models import tiny_config
from transformers import Qwen2ForCausalLM
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.bench.methods import parse_variant
from verispec.cli import draft_model_settings
from verispec.drafters.base import DraftContext
from verispec.models import quantize_int8
from verispec.models.int4_screen import MAX_SCREEN_ROWS, Int4ScreenedHead, int4_rows, pack_int4_panels
from verispec.models.panel_linear import PanelLinear, int8_uses_vnni, panel_kernels_unavailable_reason

needs_vnni = pytest.mark.skipif(
    panel_kernels_unavailable_reason() is not None or not int8_uses_vnni(), reason="the 4-bit screen runs on the VNNI int8 kernels"
)


def int8_head(vocab: int, hidden: int, bias: bool = False, seed: int = 0) -> PanelLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        linear.weight[5] = 0.0  # a zero row stays zero in 4 bits
    return PanelLinear(quantize_int8(torch.nn.Sequential(linear))[0])


def test_pack_int4_panels_puts_each_weight_in_its_nibble():
    torch.manual_seed(0)
    weight = torch.randint(-8, 8, (11, 13), dtype=torch.int8)  # 2 panels (5 padded columns), 4 quads -> 2 pairs (3 padded k)
    packed = pack_int4_panels(weight)
    assert packed.shape == (2, 2, 8, 4) and packed.dtype == torch.uint8
    for panel in range(2):
        for pair in range(2):
            for column in range(8):
                for i in range(4):
                    n, k_low, k_high = 8 * panel + column, 8 * pair + i, 8 * pair + 4 + i
                    low = int(weight[n, k_low]) + 8 if n < 11 and k_low < 13 else 8
                    high = int(weight[n, k_high]) + 8 if n < 11 and k_high < 13 else 8
                    assert int(packed[panel, pair, column, i]) == low | (high << 4)
    with pytest.raises(ValueError, match="4-bit values"):
        pack_int4_panels(torch.full((2, 4), 8, dtype=torch.int8))


def test_int4_rows_use_seven_levels_per_row():
    rows = torch.tensor([[-128, 64, 1, 0], [0, 0, 0, 0], [10, -5, 3, 2]], dtype=torch.int8)
    scales = torch.tensor([0.5, 2.0, 0.1], dtype=torch.float64)
    quantised, scale4 = int4_rows(rows, scales)
    assert quantised.tolist() == [[-7, 4, 0, 0], [0, 0, 0, 0], [7, -4, 2, 1]]  # -128 (|-128| overflows int8) -> -7; 3.5 -> 4 (half to even)
    assert torch.allclose(scale4, torch.tensor([0.5 * 128 / 7, 2.0 / 7, 0.1 * 10 / 7], dtype=torch.float32))


def four_bit_reference(screen: Int4ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes from the 4-bit panels for x # [rows, in], float32 in its order:
    ((sum_k (w4 + 8) xq_k) - 8 sum_k xq_k) * xscale * s4 (+ bias), xq the 8-bit rows of x."""
    head = screen.head
    panels = head.packed  # the int8 rows back from the VNNI panels
    rows = panels.transpose(1, 2).reshape(panels.shape[0] * 8, -1)[: head.out_features, : head.in_features]
    quantised, scale4 = int4_rows(rows, head.scale)
    xscale = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x * (1 / xscale)).long()  # [rows, in]
    dot = xq @ (quantised.long() + 8).T  # [rows, out], exact integers
    offset = (8 * xq.sum(dim=1, keepdim=True)).float()
    value = (dot.float() - offset) * xscale
    if head.kernel_bias is None:
        return value * scale4
    # the compiler fuses the last multiply and the bias into one multiply-add (one rounding): the
    # float64 product of two float32 values is exact
    return (value.double() * scale4.double() + head.kernel_bias.double()).float()


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("hidden", [64, 20, 18])  # whole pairs of quads; a lone last quad; a padded quad
@pytest.mark.parametrize("bias", [False, True])
def test_screen_is_four_bit_except_the_candidates_panels_which_are_the_int8_heads(rows, hidden, bias):
    head = int8_head(vocab=203, hidden=hidden, bias=bias)  # 203: a last panel of 3 columns
    candidates = 5
    screen = Int4ScreenedHead(head, candidates=candidates)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(hidden))
    got, full, four_bit = screen(x), head(x), four_bit_reference(screen, x)
    assert got.shape == (rows, 203)
    expected = four_bit.clone()
    for row in range(rows):
        threshold = four_bit[row].topk(candidates).values[-1]
        for first in range(0, 203, 8):
            if bool((four_bit[row, first : first + 8] >= threshold).any()):
                expected[row, first : first + 8] = full[row, first : first + 8]  # the int8 head's values, bit for bit
    assert torch.equal(got, expected)
    assert torch.equal(got[:, 5], full[:, 5])  # the zero row's logit is its bias alone either way
    # the int8 head's argmax is among the candidates here, so the screen picks it
    assert torch.equal(got.argmax(-1), full.argmax(-1))


@needs_vnni
def test_more_rows_than_the_screen_takes_run_the_int8_head():
    head = int8_head(vocab=300, hidden=32)
    screen = Int4ScreenedHead(head, candidates=3)
    x = torch.randn(MAX_SCREEN_ROWS + 1, 32)
    assert torch.equal(screen(x), head(x))
    assert not torch.equal(screen(x[:1]), head(x[:1]))  # one row: 4-bit outside the candidates


def test_screen_refuses_what_it_cannot_read():
    float_head = PanelLinear(torch.nn.Linear(16, 40)) if panel_kernels_unavailable_reason() is None else torch.nn.Linear(16, 40)
    with pytest.raises(ValueError, match="int8 PanelLinear"):
        Int4ScreenedHead(float_head)
    if panel_kernels_unavailable_reason() is None and int8_uses_vnni():
        with pytest.raises(ValueError, match="candidates"):
            Int4ScreenedHead(int8_head(vocab=40, hidden=16), candidates=0)


def int8_draft(vocab: int = 2000) -> Qwen2ForCausalLM:
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(tiny_config(vocab_size=vocab)).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked enough for a few confident drafts a round
    return quantize_int8(model)


@needs_vnni
def test_greedy_drafts_read_the_screen_and_propose_what_the_int8_head_proposes():
    model = int8_draft()
    screened = DraftModel(model, path_confidence=0.3)
    full = DraftModel(model, path_confidence=0.3, greedy_head="full")
    assert isinstance(screened.greedy_head, Int4ScreenedHead) and full.greedy_head is full.lm_head
    greedy = SamplingParams(temperature=0)
    sessions = [screened.start([1, 2, 3], greedy), full.start([1, 2, 3], greedy)]
    assert isinstance(sessions[0].lm.lm_head, Int4ScreenedHead) and isinstance(sessions[1].lm.lm_head, PanelLinear)
    sequence, generator = [1, 2, 3], torch.Generator().manual_seed(0)
    for step in range(12):
        proposals = [session.propose(DraftContext(list(sequence)), 6, generator) for session in sessions]
        assert proposals[0].tokens == proposals[1].tokens
        sequence += proposals[0].tokens[:2] + [(7 * step) % 2000]  # the target took two and corrected the third
    sampled = screened.start([1, 2, 3], SamplingParams(temperature=0.8, seed=0))
    assert sampled.lm.lm_head is screened.lm_head  # sampling needs every probability: the int8 head


@needs_vnni
def test_greedy_output_with_the_screened_draft_is_plain_decodings():
    from tiny_models import tiny_target

    target = tiny_target(seed=1, vocab_size=2000)
    plain = SpeculativeDecoder(target).generate([5, 6, 7], 40, SamplingParams(temperature=0)).token_ids
    drafted = SpeculativeDecoder(target, DraftModel(int8_draft()), gamma=5).generate([5, 6, 7], 40, SamplingParams(temperature=0)).token_ids
    assert drafted == plain


def test_greedy_head_option_everywhere():
    with pytest.raises(ValueError, match="greedy_head"):
        DraftModel(int8_draft(vocab=96), greedy_head="int4")
    assert parse_variant("draft-model:dhead=0").dhead == 0
    with pytest.raises(ValueError, match="dhead"):
        parse_variant("draft-model:dhead=2")
    with pytest.raises(ValueError, match="dhead applies to"):
        parse_variant("ngram:dhead=1")
    args = argparse.Namespace(draft_confidence=None, draft_path_confidence=None, draft_vocab=0, draft_greedy_head="full", tree_rows=0)
    assert draft_model_settings(args).greedy_head == "full"
