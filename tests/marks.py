"""Skip markers shared by the test modules: tests that need kernels this CPU may lack."""

from __future__ import annotations

import pytest

from verispec.models.panel_linear import bf16_kernels_available, panel_kernels_unavailable_reason

needs_bf16 = pytest.mark.skipif(
    panel_kernels_unavailable_reason() is not None or not bf16_kernels_available(), reason="the bfloat16 kernels need an AVX512-BF16 CPU"
)
