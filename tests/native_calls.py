"""Calling the native kernels from the per-format tests (test_native_q32.py, test_native_qk.py):
the ISA a test forces, and one gemm into a guarded y buffer."""

from __future__ import annotations

import numpy as np
import pytest


def isa_index(native, name: str) -> int:
    """The index of ISA `name`; the test is skipped where this CPU does not run it."""
    if name not in native.isas():
        pytest.skip(f"this CPU does not run the {name} kernels (it runs {native.isas()})")
    return native.ISA_NAMES.index(name)


def run_gemm(native, ggml_type: int, nbytes: int, off: int, isa: int, w: np.ndarray, rows: int, kb: int,
             xq: np.ndarray, x_offset: int, n: int) -> np.ndarray:  # fmt: skip
    """The kernel on rows x kb blocks of w from block `off`, activations from byte `x_offset`
    of xq; y (n, rows) out of a (n, rows + 5) buffer that must stay NaN outside it."""
    ldy = rows + 5
    ybuf = np.full(1 + max(n, 1) * ldy, np.nan, dtype=np.float32)
    native.gemm(ggml_type, isa, w.ctypes.data + off * nbytes, w.shape[1], rows, kb, xq.ctypes.data + x_offset, n,
                ybuf.ctypes.data + 4, ldy)  # fmt: skip
    y = ybuf[1 : 1 + n * ldy].reshape(n, ldy)
    assert np.isnan(y[:, rows:]).all(), "wrote past rows in a y row"
    assert np.isnan(ybuf[0]), "wrote before y"
    return y[:, :rows].astype(np.float64)
