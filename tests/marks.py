"""Skip markers shared by the test modules: tests that need kernels this CPU may lack."""

from __future__ import annotations

import pytest

from verispec.models.panel_linear import bf16_kernels_available, bf16_uses_amx, bf16_widened, int8_uses_amx, panel_kernels_unavailable_reason

# Bit-identical rows need the panel kernels (one chain of FMAs per output, AVX-512 or AVX2).
needs_kernels = pytest.mark.skipif(panel_kernels_unavailable_reason() is not None, reason=f"panel kernels: {panel_kernels_unavailable_reason()}")
needs_bf16 = pytest.mark.skipif(
    panel_kernels_unavailable_reason() is not None or not bf16_kernels_available(), reason="the bfloat16 kernels need AVX512-BF16, or AVX2 without AVX-512"
)
needs_amx = pytest.mark.skipif(
    not bf16_uses_amx(),  # False without the kernels, without AVX512-BF16 (AMX builds on it) or without the tile state
    reason="the bfloat16 AMX kernel needs a CPU with AMX tiles (and Linux granting their state)",
)
needs_amx_int8 = pytest.mark.skipif(
    not int8_uses_amx(),  # False without the kernels, without VNNI (the int8 layout AMX reads) or without the tile state
    reason="the int8 AMX kernel needs a CPU with AMX tiles (and Linux granting their state)",
)
# Prompts of a bfloat16 target through the one-call stack in pieces: where its products run AMX
# tiles, or the AVX2 kernel (16-column panels) that beats PyTorch's emulated bfloat16 products.
needs_bf16_prompt_pieces = pytest.mark.skipif(
    not (bf16_uses_amx() or bf16_widened()),
    reason="bfloat16 prompts go through the kernels in pieces only on AMX tiles or the AVX2 bfloat16 kernel",
)
