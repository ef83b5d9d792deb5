"""Our AVX2 few-row kernels: the numbers of nn.Linear (to rounding), the same greedy output, clear errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marks import needs_amx, needs_amx_int8, needs_bf16, needs_bf16_prompt_pieces, needs_kernels
from tiny_models import noisy_copy, tiny_config, tiny_target
from verispec import DraftModel, SpeculativeDecoder
from verispec.models import panel_linear, quantize_int8
from verispec.models.packed_linear import pack_linears
from verispec.models.panel_linear import MAX_INT8_KERNEL_ROWS, int8_uses_amx, pack_bf16_panels, MAX_KERNEL_ROWS, MAX_VNNI_KERNEL_ROWS, PanelLinear, f32_panel_width, int8_uses_vnni, pack_panels, pack_vnni_panels, panel_kernels_unavailable_reason, panel_or_same, use_panel_kernels


def test_pack_panels_layout_and_padding():
    weight = torch.arange(19 * 5, dtype=torch.float32).view(19, 5)  # [out 19, in 5]: 3 panels, the last padded
    packed = pack_panels(weight)
    assert packed.shape == (3, 5, 8)
    for out in range(19):
        torch.testing.assert_close(packed[out // 8, :, out % 8], weight[out], rtol=0, atol=0)
    assert bool((packed[2, :, 3:] == 0).all())
    assert pack_panels(weight.to(torch.int8)).dtype == torch.int8
    with pytest.raises(ValueError, match="2-D float32 or int8"):
        pack_panels(weight.double())
    wide = pack_panels(weight, width=32)  # the AVX-512 float32 layout: one panel of 32 columns
    assert wide.shape == (1, 5, 32)
    torch.testing.assert_close(wide[0, :, :19], weight.T, rtol=0, atol=0)
    assert bool((wide[0, :, 19:] == 0).all())
    with pytest.raises(ValueError, match="width must be positive"):
        pack_panels(weight, width=0)


@needs_kernels
def test_float32_layers_pack_as_wide_as_the_kernels_built_here():
    layer = PanelLinear(torch.nn.Linear(16, 40))
    width = f32_panel_width()
    cpu_flags = Path("/proc/cpuinfo").read_text()
    assert width == (32 if " avx512f" in cpu_flags and not os.environ.get("VERISPEC_NO_AVX512") else 16)
    assert layer.packed.shape == (-(-40 // width), 16, width)


@needs_kernels
@pytest.mark.parametrize("rows", [12, 13, 17, 24, 25, 37])
def test_wide_float32_rows_do_not_depend_on_how_many_rows_come_together(rows):
    # One accumulator chain per output: a verification pass over 13 rows (AVX-512: chunks of 7 and 6,
    # taken together 128 k-steps at a time; AVX2: chunks of 5, 4 and 4, a pair then one, 256 k-steps;
    # 1000 inputs end in a partial block) gives bit for bit the products of 13 one-row steps, so
    # batching cannot flip a greedy near-tie. 25 and 37 rows: pairs of chunks, then a chunk or pair.
    torch.manual_seed(rows)
    layer = PanelLinear(torch.nn.Linear(1000, 70))
    x = torch.randn(rows, 1000)
    with torch.inference_mode():
        together = layer(x)
        one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, one_by_one)
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(together.double(), reference, atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 12, 13, 25, MAX_KERNEL_ROWS])
@pytest.mark.parametrize("bias", [True, False])
def test_float32_matches_a_float64_reference(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(67, 45, bias=bias)  # odd widths: a partial last panel, k not a multiple of the unroll
    layer = PanelLinear(linear)
    x = torch.randn(rows, 67)
    reference = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    with torch.inference_mode():
        out = layer(x[None])  # leading dimensions are kept
    assert out.shape == (1, rows, 45)
    torch.testing.assert_close(out[0].double(), reference, atol=2e-5, rtol=1e-5)


@needs_kernels
def test_more_rows_or_gradients_use_the_layer_it_wraps():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 20)
    layer = PanelLinear(linear)
    many = torch.randn(MAX_KERNEL_ROWS + 1, 32)
    torch.testing.assert_close(layer(many), linear(many), rtol=0, atol=0)  # bit for bit: the same call
    x = torch.randn(3, 32, requires_grad=True)
    layer(x).sum().backward()  # training still works through the float weight
    assert x.grad is not None and linear.weight.grad is not None
    assert set(layer.state_dict()) == {"weight", "bias"}


@needs_kernels
def test_long_passes_run_the_kernels_in_chunks_when_asked():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 40)
    layer = PanelLinear(linear, chunk_long_passes=True)
    many = torch.randn(2 * MAX_KERNEL_ROWS + 5, 32)  # a prefill: three kernel calls
    chunks = torch.cat([layer(many[first : first + MAX_KERNEL_ROWS]) for first in range(0, len(many), MAX_KERNEL_ROWS)])
    assert torch.equal(layer(many), chunks)
    torch.testing.assert_close(layer(many), linear(many), atol=1e-5, rtol=1e-5)
    assert layer(many[None]).shape == (1, len(many), 40)
    quantized = quantize_int8(torch.nn.Sequential(torch.nn.Linear(32, 40)))[0]
    # int8 drafts keep fbgemm for long passes, except on AMX tiles, where their prompt runs the kernel
    assert PanelLinear(quantized, chunk_long_passes=True).chunk_long_passes == int8_uses_amx()
    assert PanelLinear(quantized).chunk_long_passes == int8_uses_amx()


def row_quantized(x: torch.Tensor) -> torch.Tensor:
    """x # [rows, in] as the VNNI kernel sees it: round(x * (1 / s)) * s, s = max|row| / 127, in
    float32 as the kernel computes them (a float64 division rounds a near-tie the other way now and then)."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(x * (1 / scale)).double() * scale.double()


def vnni_reference(quantized: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the VNNI (or AMX) int8 kernel computes for x # [rows, in], in float64: 8-bit rows of x
    times the layer's exact int8 weights and per-row scales, plus its bias."""
    weight = quantized.weight()
    dequantized = weight.int_repr().double() * weight.q_per_channel_scales().double()[:, None]
    return row_quantized(x) @ dequantized.T + quantized.bias().double()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, MAX_VNNI_KERNEL_ROWS, MAX_VNNI_KERNEL_ROWS + 1])
def test_int8_uses_the_same_int8_rows_and_scales(rows):
    torch.manual_seed(rows)
    quantized = quantize_int8(torch.nn.Sequential(torch.nn.Linear(70, 33)))[0]  # widths off every vector multiple
    layer = PanelLinear(quantized)
    assert layer.max_kernel_rows == (MAX_KERNEL_ROWS if int8_uses_amx() else MAX_VNNI_KERNEL_ROWS if int8_uses_vnni() else MAX_INT8_KERNEL_ROWS)
    weight = quantized.weight()
    dequantized = weight.int_repr().double() * weight.q_per_channel_scales().double()[:, None]
    x = torch.randn(rows, 70)
    with torch.inference_mode():
        out = layer(x)
    if rows > layer.max_kernel_rows:
        torch.testing.assert_close(out, quantized(x), rtol=0, atol=0)
    elif int8_uses_vnni():
        # 8-bit activations, one scale per row, times the exact int8 weights: exact integer sums.
        torch.testing.assert_close(out.double(), vnni_reference(quantized, x), atol=1e-5, rtol=1e-5)
    else:
        # Float activations times the exact int8 weights: far closer than fbgemm's quantised activations.
        torch.testing.assert_close(out.double(), x.double() @ dequantized.T + quantized.bias().double(), atol=1e-5, rtol=1e-5)


@needs_amx_int8
@pytest.mark.parametrize("outputs", [8, 20, 40, 64])  # 1, 3, 5, 8 panels: groups of four panels with 1-4 in the last
def test_int8_amx_tiles_give_the_dot_products_sums_bit_for_bit(outputs):
    # 192 inputs (3 tiles of 64): the tiles run from AMX_INT8_MIN_ROWS rows on. Integer sums are exact
    # either way, so tiles, dot products and one row at a time must agree bit for bit, and long
    # passes (150 rows: 128 + 22) run the kernel in pieces.
    torch.manual_seed(outputs)
    quantized = quantize_int8(torch.nn.Sequential(torch.nn.Linear(192, outputs)))[0]
    layer = PanelLinear(quantized)
    assert layer.max_kernel_rows == MAX_KERNEL_ROWS and layer.chunk_long_passes
    for rows in (1, 5, 6, 16, 17, 33, 128, 150):
        x = torch.randn(rows, 192)
        try:
            with torch.inference_mode():
                tiles = layer(x)
                one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
                assert not panel_linear.use_amx(False) and not int8_uses_amx()
                dot_products = layer(x)
        finally:
            panel_linear.use_amx(True)
        torch.testing.assert_close(tiles.double(), vnni_reference(quantized, x), atol=1e-5, rtol=1e-5)
        assert torch.equal(tiles, dot_products) and torch.equal(tiles, one_by_one), rows


@needs_amx_int8
def test_int8_widths_off_the_tiles_run_the_dot_products():
    # 70 inputs (72 after padding to quads) do not fill 64-byte tile rows: the VNNI kernel runs, and a
    # long pass still goes through it in pieces, matching the same formula.
    torch.manual_seed(0)
    quantized = quantize_int8(torch.nn.Sequential(torch.nn.Linear(70, 33)))[0]
    layer = PanelLinear(quantized)
    x = torch.randn(140, 70)
    with torch.inference_mode():
        out = layer(x)
    torch.testing.assert_close(out.double(), vnni_reference(quantized, x), atol=1e-5, rtol=1e-5)


def tile_filling_model(dtype: torch.dtype):
    """A tiny Qwen2 model whose widths fill AMX tiles (hidden 64, intermediate 128), int8 or bfloat16."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(hidden_size=64, intermediate_size=128)).eval().requires_grad_(False)
    return quantize_int8(model) if dtype == torch.int8 else use_panel_kernels(model.to(dtype))


@pytest.mark.parametrize("dtype", [pytest.param(torch.int8, marks=needs_amx_int8), pytest.param(torch.bfloat16, marks=needs_bf16_prompt_pieces)])
def test_a_long_prompt_runs_the_fused_stack_in_pieces_on_amx_tiles(dtype):
    # An int8 draft's or a bfloat16 target's (AMX tiles, or the AVX2 bfloat16 kernel) 150-token prompt goes through the one-call stack as 128 +
    # 22 rows. Every row's products and attention depend on that row alone, so its top-layer features
    # equal feeding the prompt 10 tokens at a time, bit for bit, and so do the caches after it.
    from verispec.engine.lean_lm import LeanDecoder, LeanLM

    model = tile_filling_model(dtype)
    decoder = LeanDecoder(model)
    assert decoder.fused is not None and decoder.fused.max_rows == MAX_KERNEL_ROWS and decoder.fused.chunks_long_passes
    prompt = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    # through the kernels, as a draft model runs its head (fbgemm's would quantise per call)
    head = model.lm_head if isinstance(model.lm_head, PanelLinear) else PanelLinear(model.lm_head)
    whole, pieces = LeanLM(model, decoder, lm_head=head), LeanLM(model, decoder, lm_head=head)
    calls = []
    original = type(decoder.fused).__call__
    try:
        type(decoder.fused).__call__ = lambda self, hidden, *args, **kwargs: calls.append(len(hidden)) or original(self, hidden, *args, **kwargs)
        features = whole.extend(prompt, num_logits=1).features
    finally:
        type(decoder.fused).__call__ = original
    assert calls == [128, 22]
    stepped = torch.cat([pieces.extend(prompt[first : first + 10], num_logits=1).features for first in range(0, 150, 10)])
    assert torch.equal(features, stepped)
    next_whole, next_pieces = (lm.extend([5], num_logits=1).logits for lm in (whole, pieces))  # the caches agree too
    assert torch.equal(next_whole, next_pieces)


def test_vnni_panels_hold_each_column_four_inputs_at_a_time():
    weight = torch.arange(-60, 60, dtype=torch.int8)[torch.randperm(120, generator=torch.Generator().manual_seed(0))].view(12, 10)
    packed, colsum = pack_vnni_panels(weight)
    assert packed.shape == (2, 3, 8, 4) and packed.dtype == torch.int8
    for out_index in range(16):
        for in_index in range(12):
            want = int(weight[out_index, in_index]) if out_index < 12 and in_index < 10 else 0  # zero padding
            assert int(packed[out_index // 8, in_index // 4, out_index % 8, in_index % 4]) == want
    assert torch.equal(colsum, weight.sum(dim=1, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D int8"):
        pack_vnni_panels(weight.float())


def test_bad_layer_is_refused():
    with pytest.raises(ValueError, match="PanelLinear takes a float32 or bfloat16 nn.Linear"):
        PanelLinear(torch.nn.Linear(8, 8).double())
    assert isinstance(panel_or_same(torch.nn.Conv1d(2, 2, 1)), torch.nn.Conv1d)


@needs_kernels
def test_panel_target_and_draft_keep_greedy_output_and_acceptance():
    target = tiny_target()
    reference = SpeculativeDecoder(target, DraftModel(noisy_copy(target, 0.2), panel_kernels=False), gamma=5).generate([1, 2, 3], 40, stop=[])
    plain = SpeculativeDecoder(target).generate([1, 2, 3], 40, stop=[])
    fast_target = use_panel_kernels(pack_linears(tiny_target(), min_packed_rows=1))  # packed layers are swapped too
    assert not any(type(module).__name__ in ("Linear", "PackedLinear") for module in fast_target.modules())
    assert set(fast_target.state_dict()) == set(target.state_dict())
    draft = quantize_int8(noisy_copy(target, 0.2))
    drafter = DraftModel(draft)
    assert isinstance(drafter.lm_head, PanelLinear) and isinstance(drafter.lean_decoder.layers[0].gate_up[0], PanelLinear)
    result = SpeculativeDecoder(fast_target, drafter, gamma=5).generate([1, 2, 3], 40, stop=[])
    assert result.token_ids == plain.token_ids == reference.token_ids
    assert sum(result.stats.accepted_per_round) > 0
    # PyTorch's kernels on request: the drafter's own modules stay the model's.
    assert not isinstance(DraftModel(draft, panel_kernels=False).lean_decoder.layers[0].o_proj, PanelLinear)
    with pytest.raises(ValueError, match="panel_kernels must be True or False"):
        DraftModel(draft, panel_kernels=None)


def test_no_compiler_is_named_and_refused(monkeypatch):
    monkeypatch.setattr(panel_linear.shutil, "which", lambda name: None)
    if panel_linear.platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "no C++ compiler" in panel_kernels_unavailable_reason()
    with pytest.raises(RuntimeError, match="panel kernels unavailable"):
        use_panel_kernels(tiny_target())
    linear = torch.nn.Linear(4, 4)
    assert panel_or_same(linear) is linear  # drafters keep PyTorch's kernels


@needs_kernels
def test_a_failed_build_names_the_compiler_and_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    panel_linear.panel_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="building the panel kernels failed"):
            PanelLinear(torch.nn.Linear(8, 8))
        assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-written left to load
    finally:
        panel_linear.panel_library.cache_clear()


@needs_kernels
def test_one_openmp_runtime_after_torch():
    # The kernels must share torch's OpenMP pool, not start a second runtime that fights it for cores.
    code = (
        "import torch; from verispec.models.panel_linear import PanelLinear; PanelLinear(torch.nn.Linear(8, 8))(torch.randn(2, 8));"
        "maps = open('/proc/self/maps').read().splitlines();"
        "print(len({line.split()[-1] for line in maps if 'libgomp' in line}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"


@needs_kernels
def test_the_avx2_paths_run_on_any_avx2_machine(tmp_path):
    # The library is built per machine: on a VNNI or AVX-512 CPU the float-converting int8 kernels and
    # the 16-column (AVX2) float32 panels would never run in the tests. Build them without
    # (VERISPEC_NO_VNNI, VERISPEC_NO_AVX512, own kernel cache) and check products and the one-call
    # draft step in a fresh process.
    code = """
import torch
from verispec.models import quantize_int8
from verispec.models.panel_linear import MAX_INT8_KERNEL_ROWS, bf16_widened, pack_bf16_panels, PanelLinear, f32_panel_width, int8_uses_vnni
from verispec.engine.lean_lm import LeanDecoder, LeanLM
from tiny_models import tiny_target
assert not int8_uses_vnni() and f32_panel_width() == 16
torch.manual_seed(0)
linear = torch.nn.Linear(67, 45)
def one_by_one(layer, x):
    return torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
for rows in (1, 2, 3, 5, 9, 12, 13):
    x = torch.randn(rows, 67)
    reference = x.double() @ linear.weight.double().T + linear.bias.double()
    together = PanelLinear(linear)(x)
    torch.testing.assert_close(together.double(), reference, atol=2e-5, rtol=1e-5)
    # every row the same chain of FMAs however many come together (the prefix cache, branch rows)
    assert torch.equal(together, one_by_one(PanelLinear(linear), x)), rows
# bfloat16 weights: the AVX2 kernel widens them to float32 (16-column panels, odd input width: the
# last pair padded; 7 and 13 rows go in chunks of at most 6); each row the same chain of FMAs
assert bf16_widened() and pack_bf16_panels(torch.ones(3, 5).bfloat16(), f32_panel_width()).shape == (1, 3, 16, 2)
bf16_linear = torch.nn.Linear(301, 37).bfloat16()
for rows in (1, 2, 3, 6, 7, 13):
    x = torch.randn(rows, 301)
    reference = x.bfloat16().double() @ bf16_linear.weight.double().T + bf16_linear.bias.double()
    together = PanelLinear(bf16_linear)(x)
    torch.testing.assert_close(together.double(), reference, atol=1e-4, rtol=1e-5)
    assert torch.equal(together, one_by_one(PanelLinear(bf16_linear), x)), rows
# 75 outputs = 10 int8 panels: 1 or 2 rows (the kernel's; more go to fbgemm) take them in
# side-by-side groups of 8 / 4 and a shorter last group; every row the same chain either way
quantized = quantize_int8(torch.nn.Sequential(torch.nn.Linear(70, 75)))[0]
layer = PanelLinear(quantized)
assert layer.max_kernel_rows == MAX_INT8_KERNEL_ROWS and layer.colsum is None
weight = quantized.weight()
dequantized = weight.int_repr().double() * weight.q_per_channel_scales().double()[:, None]
for rows in (1, 2):
    x = torch.randn(rows, 70)
    torch.testing.assert_close(layer(x).double(), x.double() @ dequantized.T + quantized.bias().double(), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer(x), one_by_one(layer, x)), rows
model = quantize_int8(tiny_target())
fused, op_by_op = LeanDecoder(model), LeanDecoder(model)
op_by_op.fused = None
assert fused.fused is not None and fused.fused.max_rows == MAX_INT8_KERNEL_ROWS
lms = [LeanLM(model, decoder) for decoder in (fused, op_by_op)]
for lm in lms:
    lm.extend(list(range(3, 14)), num_logits=1)
for step in ([20], [21, 22], [23]):
    have, want = (lm.extend(step, num_logits=len(step)).logits for lm in lms)
    torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
print("ok")
"""
    env = {**os.environ, "VERISPEC_NO_VNNI": "1", "VERISPEC_NO_AVX512": "1", "VERISPEC_CACHE": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])}  # the code under test, e.g. a worktree's
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]




def test_bf16_panels_hold_each_column_two_inputs_at_a_time():
    weight = torch.arange(35 * 5, dtype=torch.float32).view(35, 5).bfloat16()  # [out 35, in 5]: 2 panels, 3 pairs
    packed = pack_bf16_panels(weight)
    assert packed.shape == (2, 3, 32, 2) and packed.dtype == torch.bfloat16
    for out in range(35):
        for k in range(5):
            assert packed[out // 32, k // 2, out % 32, k % 2] == weight[out, k]
    assert bool((packed[:, 2, :, 1] == 0).all()) and bool((packed[1, :, 3:] == 0).all())  # padded input 5 and outputs 35..63
    with pytest.raises(ValueError, match="2-D bfloat16"):
        pack_bf16_panels(weight.float())


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 17, 37])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_matches_a_float64_reference_and_rows_do_not_interact(rows, bias):
    # The kernel rounds the activations to bfloat16 once and sums exact bf16 x bf16 products in float32;
    # one chain per output, so a verification pass gives bit for bit what single-row steps give.
    torch.manual_seed(rows)
    layer = torch.nn.Linear(301, 70, bias=bias).bfloat16()  # odd width: the last pair is padded
    panel = PanelLinear(layer)
    assert panel.is_bf16 and not panel.is_int8 and "bfloat16" in repr(panel)
    x = torch.randn(rows, 301)
    with torch.inference_mode():
        out = panel(x)
        out_bf16 = panel(x.bfloat16())
        one_by_one = torch.cat([panel(x[i : i + 1]) for i in range(rows)])
    reference = x.bfloat16().double() @ layer.weight.double().T
    if bias:
        reference = reference + layer.bias.double()
    assert out.dtype == torch.float32 and out_bf16.dtype == torch.bfloat16  # the caller's dtype back
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
    assert torch.equal(out, one_by_one)
    assert torch.equal(out_bf16, out.bfloat16())


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 128])
def test_amx_tiles_match_a_float64_reference_and_rows_do_not_interact(rows):
    # 192 inputs = 96 pairs, a multiple of the 16 pairs a tile takes: the product runs on AMX tiles.
    # Rows past 16 go in chunks of 16; every row must come out as it does alone (exact verification).
    torch.manual_seed(rows)
    layer = torch.nn.Linear(192, 70).bfloat16()  # 70 outputs: the last panel is partly padding
    panel = PanelLinear(layer)
    x = torch.randn(rows, 192)
    try:
        with torch.inference_mode():
            assert panel_linear.use_amx(True)
            out = panel(x)
            one_by_one = torch.cat([panel(x[i : i + 1]) for i in range(rows)])
            assert not panel_linear.use_amx(False) and not panel_linear.bf16_uses_amx()
            dot_products = panel(x)  # the vdpbf16ps kernel
    finally:
        panel_linear.use_amx(True)
    reference = x.bfloat16().double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
    assert torch.equal(out, one_by_one)
    torch.testing.assert_close(out, dot_products, atol=1e-4, rtol=1e-5)


@needs_amx
def test_amx_runs_where_pairs_fill_whole_tiles_and_the_dot_products_elsewhere():
    torch.manual_seed(0)
    x = torch.randn(9, 1536)
    results = {}
    for inputs in (1536, 1530):  # 768 pairs (48 tiles deep, 6 k blocks) / 765 pairs (not a multiple of 16)
        layer = torch.nn.Linear(inputs, 64).bfloat16()
        panel = PanelLinear(layer)
        try:
            with torch.inference_mode():
                panel_linear.use_amx(True)
                amx = panel(x[:, :inputs])
                panel_linear.use_amx(False)
                dot_products = panel(x[:, :inputs])
        finally:
            panel_linear.use_amx(True)
        reference = x[:, :inputs].bfloat16().double() @ layer.weight.double().T + layer.bias.double()
        torch.testing.assert_close(amx.double(), reference, atol=1e-4, rtol=1e-5)  # k blocks continue their sums
        results[inputs] = torch.equal(amx, dot_products)
    # 1536 inputs: tiles sum each pair in their own rounding, so some of 576 sums differ in the last
    # bits (the AMX path ran); 1530 inputs: the same kernel both times, bit for bit.
    assert results == {1536: False, 1530: True}


@needs_bf16
def test_bf16_long_passes_and_gradients_use_pytorch():
    layer = torch.nn.Linear(64, 40).bfloat16()
    panel = PanelLinear(layer)
    x = torch.randn(MAX_KERNEL_ROWS + 1, 64).bfloat16()
    torch.testing.assert_close(panel(x), layer(x), rtol=0, atol=0)  # prefill: PyTorch's own bfloat16 product
    grad_input = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    assert panel(grad_input).requires_grad


def test_bf16_layers_are_refused_without_the_kernels(monkeypatch):
    monkeypatch.setattr(panel_linear, "bf16_kernels_available", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        PanelLinear(torch.nn.Linear(8, 8).bfloat16())


@needs_bf16
def test_bf16_target_on_the_kernels_keeps_its_own_greedy_output():
    # A bfloat16 target is its own model: speculative decoding must reproduce ITS plain greedy output,
    # with its products on the bfloat16 kernels (plain and verification passes alike).
    target = tiny_target().bfloat16()
    use_panel_kernels(target)
    linears = [module for module in target.modules() if isinstance(module, (torch.nn.Linear, PanelLinear))]
    assert linears and all(isinstance(module, PanelLinear) and module.is_bf16 for module in linears)
    # It runs the lean forward (the fused stack on bfloat16 panels, float32 activations): a pass over
    # several tokens gives bit for bit the logits of one-token steps, so no near-tie can flip.
    from verispec.engine.lean_lm import LeanLM, target_lm

    lm = target_lm(target)
    assert isinstance(lm, LeanLM) and lm.decoder.fused is not None and lm.decoder.fused.kind == 2
    lm.extend(list(range(5, 25)), num_logits=0)
    block = lm.extend([7, 8, 9, 10, 11, 12, 13], num_logits=7).logits  # [7, vocab]
    lm.crop(20)
    steps = torch.cat([lm.extend([token], num_logits=1).logits for token in [7, 8, 9, 10, 11, 12, 13]])
    assert block.dtype == torch.float32 and torch.equal(block, steps)
    plain = SpeculativeDecoder(target).generate([1, 2, 3], 40, stop=[])
    draft = quantize_int8(noisy_copy(tiny_target(), 0.2))
    result = SpeculativeDecoder(target, DraftModel(draft), gamma=5).generate([1, 2, 3], 40, stop=[])
    assert result.token_ids == plain.token_ids
    assert sum(result.stats.accepted_per_round) > 0
    # The same tokens PyTorch's bfloat16 products give (to rounding: no near-tie in this tiny model).
    reference = SpeculativeDecoder(tiny_target().bfloat16()).generate([1, 2, 3], 40, stop=[])
    assert reference.token_ids == plain.token_ids


@needs_bf16
@pytest.mark.parametrize("panel_kernels", [True, False])
def test_a_bfloat16_draft_model_drafts_on_the_lean_forward(panel_kernels):
    # A bfloat16 draft (Python API) takes the lean forward too: its products on the bfloat16 kernels
    # whatever panel_kernels says (the lean activations are float32); the output stays the target's.
    target = tiny_target()
    drafter = DraftModel(noisy_copy(target, 0.1).bfloat16(), panel_kernels=panel_kernels)
    assert drafter.lean_decoder is not None and drafter.lean_decoder.fused is not None
    plain = SpeculativeDecoder(target).generate([1, 2, 3], 30, stop=[])
    result = SpeculativeDecoder(target, drafter, gamma=4).generate([1, 2, 3], 30, stop=[])
    assert result.token_ids == plain.token_ids and sum(result.stats.accepted_per_round) > 0


def _kernel_exp(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    panel_linear.panel_library().verispec_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y


@needs_kernels
def test_the_stacks_exponential_is_within_two_ulp_and_lane_independent():
    # The lean stack's softmax and SiLU take e^x from a vectorised polynomial, not expf: within 2 ulp
    # of the float64 value over the range a model produces, finite at the extremes, NaN kept.
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.randn(10_001) * 4])  # 210,004: a tail
    exact = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs()  # one ulp of the result, to a factor of 2
    assert bool(((_kernel_exp(x).double() - exact).abs() <= 2 * ulp).all())
    edges = _kernel_exp(torch.tensor([-1e4, -88.5, 89.0, 1e4, float("-inf"), float("nan"), 0.0]))
    assert bool((edges[:5] > 0).all() and torch.isfinite(edges[:5]).all()) and edges[5].isnan() and edges[6] == 1.0
    assert edges[0] < 1e-37 and edges[4] < 1e-37  # e^-87 stands in for anything smaller
    # A value's exponential does not depend on where it sits (a vector's lane or the tail).
    for count in (1, 7, 9, 13):
        torch.testing.assert_close(_kernel_exp(x[3 : 3 + count]), _kernel_exp(x)[3 : 3 + count], rtol=0, atol=0)


@needs_kernels
def test_the_stacks_silu_gate_matches_pytorch():
    gate, up = torch.randn(2, 1_000_003) * 6
    act = torch.empty_like(gate)
    panel_linear.panel_library().verispec_silu_mul(gate.data_ptr(), up.data_ptr(), act.data_ptr(), gate.numel())
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, rtol=3e-6, atol=1e-30)
