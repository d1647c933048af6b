"""The native 32-weight block kernels (csrc/q32.c: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) on every ISA
this CPU runs, against the gguf package's dequantization times the 8-bit activation blocks,
computed in float64.

Weights are valid blocks from gguf's own quantizer and, separately, random bytes with sane
fp16 scales (every nibble, 5th-bit and int8 pattern, Q8_0's -128 included). Activations carry
outliers and all-zero blocks. Shapes: rows {0, 1, 7, 37, 64}, kblocks {0, 1, 3, 8, 13},
n {0, 1, 2, 3, 4, 5, 16, 19}; the weights are a slice (row_bytes wider than the blocks used,
starting at a block offset, so unaligned), y has a row stride ldy > rows.
"""

from __future__ import annotations

import numpy as np
import pytest

native = pytest.importorskip("shardwise.kernels._native", reason="the native kernels are not built")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from native_calls import isa_index, run_gemm  # noqa: E402

FORMATS = {  # name: (ggml type, bytes per block, has a min m)
    "Q8_0": (T.Q8_0, 34, False),
    "Q4_0": (T.Q4_0, 18, False),
    "Q4_1": (T.Q4_1, 20, True),
    "Q5_0": (T.Q5_0, 22, False),
    "Q5_1": (T.Q5_1, 24, True),
}
ISAS = ["portable", "avx2", "avx512"]
RTOL = 2e-6  # (measured worst 2.5e-7) of sum |d q'| |x| + |m| |x|: fp32 scaling and summation only (the integer dots are exact)
ROWS, KB, PAD, OFF = 64, 13, 3, 2  # the weight matrix: ROWS x (OFF + KB + PAD) blocks, used from block OFF


def _isa(name: str) -> int:
    return isa_index(native, name)


def _weights(fmt: str, kind: str, rng: np.random.Generator) -> np.ndarray:
    """(ROWS, (OFF + KB + PAD) * nbytes) uint8 blocks."""
    t, nbytes, has_min = FORMATS[fmt]
    nb = OFF + KB + PAD
    if kind == "quantized":
        w = rng.standard_normal((ROWS, nb * 32)).astype(np.float32)
        w[rng.random(w.shape) < 0.01] *= 50.0  # outlier weights
        w[3, 32:64] = 0.0  # an all-zero block
        return np.ascontiguousarray(quants.quantize(w, t))
    raw = rng.integers(0, 256, (ROWS, nb, nbytes), dtype=np.uint8)
    raw[:, :, 0:2] = (
        (rng.uniform(1e-3, 1e-1, (ROWS, nb)) * rng.choice([-1, 1], (ROWS, nb)))
        .astype(np.float16)
        .view(np.uint8)
        .reshape(ROWS, nb, 2)
    )
    if has_min:
        raw[:, :, 2:4] = rng.uniform(-0.5, 0.5, (ROWS, nb)).astype(np.float16).view(np.uint8).reshape(ROWS, nb, 2)
    return raw.reshape(ROWS, nb * nbytes)


def _activations(n: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((max(n, 1), KB * 32)).astype(np.float32)
    x[rng.random(x.shape) < 0.02] *= 100.0  # outlier channels
    x[:, 64:96] = 0.0  # an all-zero block in every row
    return x[:n]


def _quantize_x(x: np.ndarray, kb: int) -> tuple[np.ndarray, np.ndarray]:
    """x (n, >= kb * 32) -> (its sw_a32 bytes, 4 bytes in so the pointer is only 4-aligned; the
    dequantized activations (n, kb * 32) float64)."""
    n = x.shape[0]
    buf = np.zeros(4 + max(n * kb, 1) * native.A32_BYTES, dtype=np.uint8)
    native.quantize(32, 0, x.ctypes.data, x.shape[1], n, kb * 32, buf.ctypes.data + 4)
    blocks = buf[4 : 4 + n * kb * 40].reshape(n * kb, 40)
    d = blocks[:, 0:4].copy().view(np.float32).astype(np.float64)  # (n * kb, 1)
    q = blocks[:, 8:40].view(np.int8).astype(np.float64)
    return buf, (d * q).reshape(n, kb * 32)


def _reference(fmt: str, w: np.ndarray, xd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (rows, kb * nbytes) -> (y (n, rows) in float64, the bound's scale sum |d q'||x| + |m||x|)."""
    t, nbytes, has_min = FORMATS[fmt]
    rows, kb = w.shape[0], w.shape[1] // nbytes
    if rows * kb == 0:
        wd = np.zeros((rows, kb * 32))
    else:
        wd = quants.dequantize(np.ascontiguousarray(w), t).astype(np.float64).reshape(rows, kb * 32)
    if has_min:
        m = w.reshape(rows, kb, nbytes)[:, :, 2:4].copy().view(np.float16).astype(np.float64)  # (rows, kb, 1)
        m = np.broadcast_to(m, (rows, kb, 32)).reshape(rows, kb * 32)
        wabs = np.abs(wd - m) + np.abs(m)
    else:
        wabs = np.abs(wd)
    return xd @ wd.T, np.abs(xd) @ wabs.T


def _gemm(fmt: str, isa: int, w: np.ndarray, rows: int, kb: int, xq: np.ndarray, n: int) -> np.ndarray:
    """The kernel on rows x kb blocks of w from block OFF (tests/native_calls.run_gemm)."""
    t, nbytes, _ = FORMATS[fmt]
    return run_gemm(native, int(t), nbytes, OFF, isa, w, rows, kb, xq, 4, n)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kind", ["quantized", "random"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemm_against_reference(fmt: str, kind: str, isa_name: str) -> None:
    isa = _isa(isa_name)
    t = int(FORMATS[fmt][0])
    assert isa_name in native.kernels()[t], f"no {isa_name} gemm registered for {fmt}: {native.kernels()[t]}"
    rng = np.random.default_rng([t, len(kind)])
    w = _weights(fmt, kind, rng)
    nbytes = FORMATS[fmt][1]
    x = _activations(19, rng)
    worst = 0.0
    for kb in (0, 1, 3, 8, 13):
        xs = {n: _quantize_x(x[:n], kb) for n in (0, 1, 2, 3, 4, 5, 16, 19)}  # 19: two runs of 16, an odd rest
        for rows in (0, 1, 7, 37, 64):  # 37: two 16-row tiles and 5 rows
            wk = w[:rows, OFF * nbytes : (OFF + kb) * nbytes]
            for n, (xq, xd) in xs.items():
                ref, scale = _reference(fmt, wk, xd)
                y = _gemm(fmt, isa, w, rows, kb, xq, n)
                err = np.abs(y - ref)
                bad = err > RTOL * scale + 1e-30
                assert not bad.any(), (
                    f"{fmt} {kind} {isa_name} rows={rows} kblocks={kb} n={n}: |y - ref| {err.max():.3g} "
                    f"at {np.argwhere(bad)[0].tolist()}, bound {(RTOL * scale).ravel()[bad.ravel().argmax()]:.3g}"
                )
                if isa_name != "portable":
                    y0 = _gemm(fmt, 0, w, rows, kb, xq, n)
                    assert (np.abs(y - y0) <= RTOL * scale + 1e-30).all(), (
                        f"{fmt} {isa_name} != portable at rows={rows} kblocks={kb} n={n}"
                    )
                if err.size:
                    worst = max(worst, float((err / np.maximum(scale, 1e-30)).max()))
    assert worst < RTOL


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_against_gguf(fmt: str, isa_name: str) -> None:
    isa = _isa(isa_name)
    t, nbytes, _ = FORMATS[fmt]
    rng = np.random.default_rng(int(t))
    w = _weights(fmt, "random", rng)
    for rows, kb in ((0, 3), (1, 1), (7, 3), (64, 13), (5, 0)):
        out = np.full(rows * kb * 32 + 1, np.nan, dtype=np.float32)
        native.dequantize(int(t), isa, w.ctypes.data + OFF * nbytes, w.shape[1], rows, kb, out.ctypes.data)
        assert np.isnan(out[-1]), "wrote past the output"
        got = out[:-1].reshape(rows, kb * 32)
        wk = np.ascontiguousarray(w[:rows, OFF * nbytes : (OFF + kb) * nbytes])
        want = quants.dequantize(wk, t).reshape(rows, kb * 32) if rows * kb else got
        # 1 ulp: w = d * q + m may be one fused rounding here and two in gguf's numpy
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.abs(want).max(initial=0)) * 2**-22 + 1e-30)
