"""Few-row linear layers through our own AVX2 / AVX-512 kernels (``panel_kernels.cpp``), for decoding on CPU.

Decoding multiplies each weight by 1 row (a plain or a draft step) or by gamma+1 rows (a
verification pass). On the 2-core AMD EPYC (2026-11-30, one-off timings of the Qwen2.5-1.5B MLP
weight [8960, 1536], 2 threads, medians): oneDNN's packed kernel takes 1.8 / 2.9 ms for 1 / 7 rows,
these kernels 1.4 / 2.1 ms; the 151,936-row LM head 30 / 47 ms against 27 / 34 ms. They load every
weight element once and use it for up to 12 rows at a time, so the weight stream and the arithmetic
overlap; that is what keeps a 7-token verification pass close to a 1-token step.

The int8 variant multiplies by the same int8 weight rows and per-row scales as PyTorch's dynamic
int8 linear but keeps the activations in float32 (fbgemm quantises them to uint8 per call): a
draft computed this way differs in the last digits from fbgemm's, which verification tolerates
(the output stays exact whatever the draft computes) — so it is used for drafters only.

Where the CPU has 8-bit dot products (AVX-VNNI, or AVX512-VNNI with VL) the library is built with
them and int8 weights are packed for them (:func:`pack_vnni_panels`): activations are quantised
per row to 8 bits, as fbgemm does, and one instruction sums 32 weight-activation products. On a
2-core Xeon (2026-11-30, one-off timings) the 151,936-row int8 LM head took 5.8 ms that way against
11.5 ms converting weights to float (fbgemm: 4.9 ms), and a whole 1-token lean draft step 29 ms
against 41 ms with fbgemm op by op (``verispec_lean_stack``, see ``engine/lean_lm.py``).

Where the CPU has AVX-512 the float32 weights are packed 32 columns per panel and every line
of a panel is prefetched into L2 ahead of its use (as are the VNNI int8 panels): on the 2-core Xeon
(2026-11-30, the 1.5B target's 15 largest body weights and its LM head, 1.76 GB, 2 threads, medians
of 5) 65 / 77 ms for 1 / 9 rows against oneDNN's packed 71 / 99 ms; a 1-token int8 draft step went
from 31 to 24 ms. With one accumulator chain per output there, a pass over n rows computes each
row exactly as a 1-row pass does.

Where the CPU also has AMX tiles (Intel Sapphire Rapids and later) the bfloat16 products run on
them: one ``tdpbf16ps`` multiplies 16 rows by 16 input pairs by 16 outputs, so a verification pass
over up to 16 rows streams the weight at the cost of a 1-row step. int8 products over 6 rows or more
run there too (``tdpbusd``, the same integer sums as the dot products, so the same outputs bit for
bit), and int8 layers then take up to ``MAX_KERNEL_ROWS`` rows a call and long passes in pieces: a
draft's catch-up after a lookup round and its prompt pass. :func:`use_amx` switches the tiles off
and on, for comparisons; ``VERISPEC_NO_AMX=1`` builds without them.

The kernel library is compiled on first use with the system C++ compiler (about a second) into the
model cache, ``<cache>/kernels/``, keyed by a hash of the source and flags (the flags depend on the
CPU). No compiler or no AVX2: :func:`panel_kernels_unavailable_reason` says why and callers keep
PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from verispec.models.packed_linear import PackedLinear, float32_linear_sites
from verispec.models.quantize import int8_rows_and_scales, is_quantized

_SOURCE = Path(__file__).with_name("panel_kernels.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
# 8-bit dot products where the CPU has them: the int8 kernels then multiply int8 weights by 8-bit
# activations (the VNNI layout) instead of converting weights to float.
_VNNI_FLAGS = {"avx_vnni": ["-mavxvnni"], "avx512_vnni": ["-mavx512vnni", "-mavx512vl"]}
PANEL_WIDTH = 8  # output columns per int8 panel; must match PANEL in panel_kernels.cpp (checked at load)
# Up to this many rows the panel kernel runs; beyond it PyTorch's GEMM (prompt prefill). On the
# AMD machine ours was no slower than oneDNN or MKL up to 128 rows (one-off timing); for long
# prompts a blocked GEMM re-reads less.
MAX_KERNEL_ROWS = 128
# int8 weights are converted to float in registers, which costs more arithmetic per weight than
# fbgemm's 8-bit multiply-adds: a Qwen2.5-0.5B lean draft pass took 31 / 34 / 42 / 60 ms for
# 1 / 2 / 4 / 7 tokens with these kernels against 31 / 36 / 38 / 44 ms with fbgemm (`verispec
# costs --threads 2`), and a 1-token step's products 20 ms against 25 ms (one-off split). So int8
# products over more rows than this go to fbgemm.
MAX_INT8_KERNEL_ROWS = 2
# With 8-bit dot products (VNNI) the int8 kernel stays memory-bound over more rows.
MAX_VNNI_KERNEL_ROWS = 16
BF16_PANEL_WIDTH = 32  # output columns per bfloat16 panel with AVX-512 (the kernels take their float32 panel width: f32_panel_width)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _machine_flags() -> list[str]:
    """Compiler flags for this CPU beyond AVX2/FMA: AVX-512 for the wide float32 panels, and 8-bit
    dot products (AVX-VNNI first; AVX512-VNNI needs AVX512-VL for its 256-bit form), and bfloat16
    dot products (AVX512-BF16, and AMX tiles on top), if it has them. ``VERISPEC_NO_AVX512=1`` /
    ``VERISPEC_NO_VNNI=1`` / ``VERISPEC_NO_AMX=1`` build without them (the tests run the AVX2 paths
    that way on any machine)."""
    cpu, flags = cpu_flags(), []
    amx = "amx_tile" in cpu and not os.environ.get("VERISPEC_NO_AMX")
    if "avx512f" in cpu and not os.environ.get("VERISPEC_NO_AVX512"):
        flags.append("-mavx512f")
    if not os.environ.get("VERISPEC_NO_VNNI"):
        if "avx_vnni" in cpu:
            flags += _VNNI_FLAGS["avx_vnni"]
        elif {"avx512_vnni", "avx512vl"} <= cpu:
            flags += _VNNI_FLAGS["avx512_vnni"]
        if amx and "amx_int8" in cpu and any(flag in flags for flag in ("-mavxvnni", "-mavx512vnni")):
            flags += ["-mamx-tile", "-mamx-int8"]
    if {"avx512f", "avx512_bf16"} <= cpu and not os.environ.get("VERISPEC_NO_AVX512") and not os.environ.get("VERISPEC_NO_BF16"):
        flags += ["-mavx512bf16", "-mavx512bw", "-mavx512vl"]
        if amx and "amx_bf16" in cpu:
            flags += ["-mamx-tile", "-mamx-bf16"]
    return list(dict.fromkeys(flags))  # -mamx-tile once


def panel_kernels_unavailable_reason() -> str | None:
    """Why the panel kernels cannot run here (no x86-64 AVX2/FMA CPU, no C++ compiler), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU architecture {platform.machine()} (the kernels are x86-64 AVX2)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU lacks AVX2/FMA (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C++ compiler (set CXX or install g++) to build them"
    return None


def _kernel_dir() -> Path:
    from verispec.models.registry import default_cache_dir

    return default_cache_dir() / "kernels"


@functools.cache
def panel_library() -> ctypes.CDLL:
    """The compiled kernels (built on first use); RuntimeError naming the reason if they cannot run here."""
    reason = panel_kernels_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"panel kernels unavailable: {reason}")
    compiler = _compiler()
    source = _SOURCE.read_bytes()
    flags = [*_FLAGS, *_machine_flags()]  # built per machine: part of the key
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _kernel_dir() / f"panel-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent first uses never load a half-written file.
        with tempfile.TemporaryDirectory(dir=target.parent) as build_dir:
            built = Path(build_dir) / target.name
            result = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building the panel kernels failed ({compiler}):\n{result.stderr[-2000:]}")
            os.replace(built, target)
    # torch already loaded its libgomp.so.1: the kernels' OpenMP resolves to that one runtime and pool.
    library = ctypes.CDLL(str(target))
    if library.verispec_panel_width() != PANEL_WIDTH:
        raise RuntimeError(f"{target} packs {library.verispec_panel_width()} columns per panel, expected {PANEL_WIDTH}")
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    library.verispec_f32_panel_width.restype = ctypes.c_int
    library.verispec_panel_linear_f32.argtypes = [pointer, int64, int64, pointer, int64, pointer, pointer, ctypes.c_int]
    library.verispec_panel_linear_i8.argtypes = [pointer, int64, int64, pointer, int64, pointer, pointer, pointer, pointer, ctypes.c_int]
    library.verispec_panel_linear_f32_panels.argtypes = [pointer, int64, int64, pointer, pointer, int64, pointer, ctypes.c_int]
    library.verispec_has_bf16.restype = ctypes.c_int
    library.verispec_use_amx.argtypes, library.verispec_use_amx.restype = [ctypes.c_int], ctypes.c_int
    library.verispec_amx_enabled.restype = ctypes.c_int
    library.verispec_amx_kinds.restype = ctypes.c_int
    library.verispec_use_amx(1)  # where built with AMX: asks Linux for the tile state; the kernel falls back without it
    library.verispec_panel_linear_bf16.argtypes = [pointer, int64, int64, pointer, int64, pointer, pointer, ctypes.c_int]
    library.verispec_exp.argtypes = [pointer, pointer, int64]
    library.verispec_silu_mul.argtypes = [pointer, pointer, pointer, int64]
    library.verispec_screened_head_i8.argtypes = [pointer, int64, int64, pointer, pointer, pointer, int64, pointer, pointer, pointer, int64, pointer, ctypes.c_int]
    library.verispec_screened_head_i8.restype = ctypes.c_int
    library.verispec_lean_stack.argtypes = [pointer, ctypes.c_float, ctypes.c_int, int64, *[pointer] * 16, ctypes.c_int]
    library.verispec_memory_attention.argtypes = [pointer, int64, int64, int64, int64, pointer, int64, pointer, int64, pointer, ctypes.c_float, pointer, pointer, ctypes.c_int]
    return library


def int8_uses_vnni() -> bool:
    """Whether the kernels built here take int8 weights in the VNNI layout (8-bit dot products)."""
    return bool(panel_library().verispec_int8_layout())


def f32_panel_width() -> int:
    """Output columns per float32 panel in the kernels built here: 32 with AVX-512, else 8."""
    return int(panel_library().verispec_f32_panel_width())


def _panels(weight: torch.Tensor, group: int, width: int = PANEL_WIDTH) -> torch.Tensor:
    """``weight`` # [out, in] as [ceil(out/width), ceil(in/group), width, group]: element i of
    column n of panel p in group g is weight[width·p + n, group·g + i]; padding is zero."""
    out_features, in_features = weight.shape
    num_panels, num_groups = -(-out_features // width), -(-in_features // group)
    padded = torch.zeros(num_panels * width, num_groups * group, dtype=weight.dtype)
    padded[:out_features, :in_features] = weight
    return padded.view(num_panels, width, num_groups, group).transpose(1, 2).contiguous()


def pack_vnni_panels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``weight`` # [out, in] as VNNI panels # [ceil(out/8), ceil(in/4), 8, 4] (byte i of column
    n of panel p in group g is weight[8p + n, 4g + i]; padding is zero) and its row sums # [out] int32."""
    if weight.dim() != 2 or weight.dtype != torch.int8:
        raise ValueError(f"weight must be a 2-D int8 tensor, got {weight.dtype} of shape {tuple(weight.shape)}")
    return _panels(weight, 4), weight.sum(dim=1, dtype=torch.int32).contiguous()


def bf16_kernels_available() -> bool:
    """Whether bfloat16 weights run the panel kernels here: AVX512-BF16 dot products, or on AVX2
    without AVX-512 float32 FMAs on weights widened in registers (exact: a bfloat16 is a float32's top half)."""
    return panel_kernels_unavailable_reason() is None and bool(panel_library().verispec_has_bf16())


def bf16_widened() -> bool:
    """Whether bfloat16 products here run the AVX2 kernel (weights widened to float32, float32 FMAs;
    the build without AVX-512, whose float32 panels are 16 columns wide) rather than AVX512-BF16 dot
    products or AMX tiles; False without bfloat16 kernels."""
    return bf16_kernels_available() and f32_panel_width() == 16


def use_amx(enable: bool) -> bool:
    """Run products on AMX tiles (the default where the kernels were built with them: bfloat16 and
    int8 products) or on dot products (AVX512-BF16, VNNI); returns whether AMX runs now. For
    comparing the two in one process: switch only between passes, as a pass's rows must all come from
    one kernel to be exact (int8 sums are integers, the same either way; bfloat16 ones are not)."""
    return bool(panel_library().verispec_use_amx(int(enable)))


def _amx_runs(kind_bit: int) -> bool:
    library = panel_library() if panel_kernels_unavailable_reason() is None else None
    return library is not None and bool(library.verispec_amx_kinds() & kind_bit) and bool(library.verispec_amx_enabled())


def bf16_uses_amx() -> bool:
    """Whether bfloat16 products run on AMX tiles here (built with them and enabled)."""
    return _amx_runs(1)


def int8_uses_amx() -> bool:
    """Whether int8 products (VNNI layout) run on AMX tiles here (built with them and enabled)."""
    return _amx_runs(2)


def pack_bf16_panels(weight: torch.Tensor, width: int = BF16_PANEL_WIDTH) -> torch.Tensor:
    """bfloat16 ``weight`` # [out, in] as panels # [ceil(out/width), ceil(in/2), width, 2] (element i
    of column n of panel p in pair g is weight[width·p + n, 2g + i]; padding is zero): one line per
    pair of inputs (128 bytes at width 32, what ``vdpbf16ps`` multiplies by a broadcast pair of
    activations; 64 at 16, the AVX2 kernel's). The kernels read panels of :func:`f32_panel_width`."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight must be a 2-D bfloat16 tensor, got {weight.dtype} of shape {tuple(weight.shape)}")
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    return _panels(weight, 2, width)


def pack_panels(weight: torch.Tensor, width: int = PANEL_WIDTH) -> torch.Tensor:
    """``weight`` # [out, in] (float32 or int8) as panels # [ceil(out/width), in, width]: column n
    of panel p at row k is weight[width·p + n, k]; the last panel is padded with zeros."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.int8):
        raise ValueError(f"weight must be a 2-D float32 or int8 tensor, got {weight.dtype} of shape {tuple(weight.shape)}")
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    return _panels(weight, 1, width).squeeze(-1)


class PanelLinear(nn.Module):
    """A float32 ``nn.Linear`` (or :class:`PackedLinear`) or an int8 dynamic linear whose products
    over at most ``MAX_KERNEL_ROWS`` (int8: ``MAX_INT8_KERNEL_ROWS``) rows run the panel kernels;
    more rows, gradients or other dtypes go to the layer it was built from. A bfloat16 ``nn.Linear``
    (a bfloat16 target) runs the bfloat16 kernel where the CPU has one (AVX512-BF16, or AVX2 without AVX-512; ValueError otherwise),
    half the bytes of float32 (and with AVX512-BF16 twice the multiply-adds per instruction). Float layers keep
    ``weight``/``bias`` as they were (state_dict keys unchanged); the packed panels are a second
    copy of the weight.

    ``chunk_long_passes``: float32 products over more rows than one kernel call takes (a prompt's
    prefill) run the kernels on ``max_kernel_rows`` rows at a time instead of going to the source
    layer: on a 2-core AMD EPYC (Zen 4) a 143-token prefill of the 1.5B target took 2.1 s this way against
    3.1-3.7 s through torch's dense product. Whether it pays depends on the CPU's BLAS, so
    ``--target-kernels auto`` times it (:func:`~verispec.models.kernel_choice.time_long_passes`).
    """

    def __init__(self, source: nn.Module, chunk_long_passes: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = int(source.in_features), int(source.out_features)
        self.is_int8 = is_quantized(source)
        if self.is_int8:
            rows, scales, zero_points = int8_rows_and_scales(source)
            if bool((zero_points != 0).any()):
                raise ValueError("the panel kernels take symmetric int8 weights (zero point 0), as quantize_int8 makes")
            rows, self.scale = rows.contiguous(), scales.float().contiguous()
            bias = source.bias()
            self.source = source  # the fallback for many rows
        elif isinstance(source, (nn.Linear, PackedLinear)) and source.weight.dtype in (torch.float32, torch.bfloat16):
            rows, self.scale = source.weight.detach(), None
            self.weight, self.bias = source.weight, source.bias  # registered: same parameters, same state_dict keys
            bias = source.bias
        else:
            raise ValueError(f"PanelLinear takes a float32 or bfloat16 nn.Linear or an int8 dynamic linear, got {type(source).__name__}")
        self.is_bf16 = rows.dtype == torch.bfloat16
        if self.is_bf16 and not bf16_kernels_available():
            raise ValueError("bfloat16 weights need the bfloat16 panel kernels (AVX512-BF16, or AVX2 without AVX-512), which this CPU or build lacks")
        self.kernel_bias = None if bias is None else bias.detach().float().contiguous()
        self.chunk_long_passes = chunk_long_passes and not self.is_int8
        panel_library()  # build or load now: a failure shows at model preparation, not mid-generation
        self.colsum = None
        if self.is_bf16:
            self.packed, self.max_kernel_rows = pack_bf16_panels(rows, f32_panel_width()), MAX_KERNEL_ROWS
        elif self.is_int8 and int8_uses_vnni():
            self.packed, self.colsum = pack_vnni_panels(rows)  # [ceil(out/8), ceil(in/4), 8, 4], [out]
            # On AMX tiles a pass over many rows streams the weight once per 16 rows: a draft's
            # prompt runs the kernel too, in pieces of MAX_KERNEL_ROWS rows.
            amx = int8_uses_amx()
            self.max_kernel_rows = MAX_KERNEL_ROWS if amx else MAX_VNNI_KERNEL_ROWS
            self.chunk_long_passes = amx
        else:  # [ceil(out/width), in, width]: 8 columns for int8, 32 for float32 on AVX-512 builds
            self.packed = pack_panels(rows, PANEL_WIDTH if self.is_int8 else f32_panel_width())
            self.max_kernel_rows = MAX_INT8_KERNEL_ROWS if self.is_int8 else MAX_KERNEL_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        rows = x.numel() // self.in_features
        chunked = rows > self.max_kernel_rows and self.chunk_long_passes
        if self.is_bf16:
            return self._bf16_forward(x, rows)
        if rows == 0 or (rows > self.max_kernel_rows and not chunked) or x.dtype != torch.float32 or x.requires_grad:
            return self.source(x) if self.is_int8 else nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        out = torch.empty(rows, self.out_features)
        for first in range(0, rows, self.max_kernel_rows):
            self._kernel(flat[first : first + self.max_kernel_rows], out[first : first + self.max_kernel_rows])
        return out.reshape(*x.shape[:-1], self.out_features)

    def _bf16_forward(self, x: torch.Tensor, rows: int) -> torch.Tensor:  # x: [..., in_features]
        """bfloat16 weights: up to ``max_kernel_rows`` rows (every decoding pass) through the kernel, the
        activations rounded to bfloat16 once (as a bfloat16 model holds them anyway) and float32 sums
        out, returned in x's dtype; longer passes (prompt prefill) and gradients go to PyTorch's product."""
        if rows == 0 or rows > self.max_kernel_rows or x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
            return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        pairs = x.reshape(rows, self.in_features).to(torch.bfloat16)
        if self.in_features % 2:  # the kernel reads pairs of inputs; the padded weight column is zero
            pairs = nn.functional.pad(pairs, (0, 1))
        pairs = pairs.contiguous()
        out = torch.empty(rows, self.out_features)
        bias = None if self.kernel_bias is None else self.kernel_bias.data_ptr()
        panel_library().verispec_panel_linear_bf16(
            pairs.data_ptr(), rows, pairs.shape[1] // 2, self.packed.data_ptr(), self.out_features, bias, out.data_ptr(), torch.get_num_threads()
        )
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _kernel(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """out # [rows, out_features] = flat # [rows, in_features] (contiguous, rows <= max_kernel_rows) @ weight.T + bias."""
        rows = flat.shape[0]
        bias = None if self.kernel_bias is None else self.kernel_bias.data_ptr()
        threads, library = torch.get_num_threads(), panel_library()
        if self.is_int8:
            library.verispec_panel_linear_i8(
                flat.data_ptr(), rows, self.in_features, self.packed.data_ptr(), self.out_features, self.scale.data_ptr(),
                None if self.colsum is None else self.colsum.data_ptr(), bias, out.data_ptr(), threads,
            )
        else:
            library.verispec_panel_linear_f32(
                flat.data_ptr(), rows, self.in_features, self.packed.data_ptr(), self.out_features, bias, out.data_ptr(), threads
            )

    def extra_repr(self) -> str:
        kind = ("int8, 8-bit dot products" if self.colsum is not None else "int8") if self.is_int8 else "bfloat16" if self.is_bf16 else "float32"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, kernel up to {self.max_kernel_rows} rows"


def panel_or_same(module: nn.Module) -> nn.Module:
    """``module`` as a :class:`PanelLinear` if the kernels run here and it is a float32 or int8
    linear layer (or a bfloat16 one, where the bfloat16 kernels run); else ``module`` itself."""
    if isinstance(module, PanelLinear) or panel_kernels_unavailable_reason() is not None:
        return module
    if is_quantized(module) or (isinstance(module, nn.Linear) and module.weight.dtype == torch.float32):
        return PanelLinear(module)
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16 and bf16_kernels_available():
        return PanelLinear(module)
    return module


def use_panel_kernels(model: nn.Module, chunk_long_passes: bool = False) -> nn.Module:
    """Replace every float32 ``nn.Linear`` (or oneDNN :class:`PackedLinear`, whose packed copy is
    then released) in ``model`` by :class:`PanelLinear` (in place, a module swap on this instance as
    torch's own quantisation does; no class is modified); bfloat16 ones too where the kernels have
    bfloat16 dot products (:func:`bf16_kernels_available`). ``chunk_long_passes``: see
    :class:`PanelLinear`. Raises RuntimeError naming the reason if the kernels cannot run here."""
    reason = panel_kernels_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"panel kernels unavailable: {reason}")
    sites = float32_linear_sites(model, (nn.Linear, PackedLinear))
    if bf16_kernels_available():
        sites += [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                  if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    for parent, name, child in sites:
        setattr(parent, name, PanelLinear(child, chunk_long_passes))
    return model
