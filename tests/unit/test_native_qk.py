"""The native K-quant kernels (csrc/qk.c: Q4_K, Q5_K, Q6_K) on every ISA this CPU runs,
against the gguf package's dequantization times the 8-bit activation blocks (sw_a256),
computed in float64.

Weights are valid blocks from shardwise's own quantizer (gguf's does not write the K-quants)
and, separately, random bytes with sane fp16 scales (every pattern of the quants, the 6-bit
or int8 sub-scales and the mins), with one row of all-ones bits (every quant, scale and min
at its largest) against activation rows of +-127 (the integer sums' extremes). Activations
carry outliers and all-zero blocks. Shapes: rows {0, 1, 7, 37, 64}, kblocks {0, 1, 3, 5},
n {0, 1, 2, 3, 4, 5, 8, 9, 16} (the avx512 tiles from 8 activation rows and 16 weight rows); the weights are a slice (row_bytes wider than the blocks used and
not a multiple of the block, from an odd address), y has a row stride ldy > rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

native = pytest.importorskip("shardwise.kernels._native", reason="the native kernels are not built")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from native_calls import isa_index, run_gemm  # noqa: E402
from shardwise.kernels import quantize_rows  # noqa: E402

FORMATS = {  # name: (ggml type, bytes per block, where d is, where dmin is or None)
    "Q4_K": (T.Q4_K, 144, 0, 2),
    "Q5_K": (T.Q5_K, 176, 0, 2),
    "Q6_K": (T.Q6_K, 210, 208, None),
}
ISAS = ["portable", "avx2", "avx512"]
RTOL = 2e-6  # (measured worst 1.6e-7) of sum |d sc q| |x| + |dmin mn| |x|: fp32 scaling and summation only (the integer dots are exact)
ROWS, KB, PAD, OFF = 64, 5, 1, 1  # the weight matrix: ROWS x (OFF + KB + PAD) blocks (+ 3 bytes), used from block OFF
A256 = 316  # sw_a256: d (fp32), bsum[16] (int16), m[8], m16[16] (uint8), q[256] (int8)


def _isa(name: str) -> int:
    return isa_index(native, name)


def _f16(v: np.ndarray) -> np.ndarray:  # (...) float -> (..., 2) uint8
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _weights(fmt: str, kind: str, rng: np.random.Generator) -> np.ndarray:
    """(ROWS, row_bytes) uint8 from an odd address: OFF + KB + PAD blocks and 3 spare bytes a row."""
    t, nbytes, d_at, m_at = FORMATS[fmt]
    nb = OFF + KB + PAD
    if kind == "quantized":
        w = torch.from_numpy(rng.standard_normal((ROWS, nb * 256)).astype(np.float32))
        w[torch.from_numpy(rng.random(tuple(w.shape)) < 0.01)] *= 50.0  # outlier weights
        w[3, 256:512] = 0.0  # an all-zero block
        blocks = quantize_rows(w, fmt).numpy().reshape(ROWS, nb, nbytes)
    else:
        blocks = rng.integers(0, 256, (ROWS, nb, nbytes), dtype=np.uint8)
        blocks[5] = 0xFF  # every quant, sub-scale and min at its largest (Q6_K: q 63, sc -1)
        sign = rng.choice([-1, 1], (ROWS, nb))
        blocks[:, :, d_at : d_at + 2] = _f16(rng.uniform(1e-3, 1e-1, (ROWS, nb)) * sign)
        if m_at is not None:
            blocks[:, :, m_at : m_at + 2] = _f16(rng.uniform(-0.1, 0.1, (ROWS, nb)))
    buf = np.zeros(1 + ROWS * (nb * nbytes + 3), dtype=np.uint8)
    w = buf[1:].reshape(ROWS, nb * nbytes + 3)
    w[:, : nb * nbytes] = blocks.reshape(ROWS, nb * nbytes)
    return w


def _activations(n: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((max(n, 3), KB * 256)).astype(np.float32)
    x[rng.random(x.shape) < 0.02] *= 100.0  # outlier channels
    x[:, 256:512] = 0.0  # an all-zero block in every row
    x[1], x[2] = 1.0, -1.0  # every activation at +127, then -127
    return x[:n]


def _quantize_x(x: np.ndarray, kb: int) -> tuple[np.ndarray, np.ndarray]:
    """x (n, >= kb * 256) -> (its sw_a256 bytes, 2 bytes in so the pointer is only 2-aligned;
    the dequantized activations (n, kb * 256) float64)."""
    n = x.shape[0]
    buf = np.zeros(2 + max(n * kb, 1) * A256, dtype=np.uint8)
    native.quantize(256, 0, x.ctypes.data, x.shape[1], n, kb * 256, buf.ctypes.data + 2)
    blocks = buf[2 : 2 + n * kb * A256].reshape(n * kb, A256)
    d = blocks[:, 0:4].copy().view(np.float32).astype(np.float64)  # (n * kb, 1)
    m = np.repeat(blocks[:, 36:44].astype(np.float64), 32, axis=1)  # (n * kb, 256): each sub-block's m
    q = blocks[:, 60:].view(np.int8).astype(np.float64)
    return buf, (d * m * q).reshape(n, kb * 256)


def _dequantized(fmt: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (rows, kb * nbytes) -> (gguf's weights (rows, kb * 256) float64, |d sc q| + |dmin mn|)."""
    t, nbytes, _, m_at = FORMATS[fmt]
    rows, kb = w.shape[0], w.shape[1] // nbytes
    if rows * kb == 0:
        return np.zeros((rows, kb * 256)), np.zeros((rows, kb * 256))
    wd = quants.dequantize(np.ascontiguousarray(w), t).astype(np.float64).reshape(rows, kb * 256)
    if m_at is None:
        return wd, np.abs(wd)
    blocks = np.ascontiguousarray(w.reshape(rows * kb, nbytes))
    _, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16])  # (rows * kb, 8)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)  # (rows * kb, 1)
    m = np.repeat(dmin * mn, 32, axis=1).reshape(rows, kb * 256)  # what each weight's min subtracts
    return wd, np.abs(wd + m) + np.abs(m)


def _gemm(fmt: str, isa: int, w: np.ndarray, rows: int, kb: int, xq: np.ndarray, n: int) -> np.ndarray:
    """The kernel on rows x kb blocks of w from block OFF (tests/native_calls.run_gemm)."""
    t, nbytes, _, _ = FORMATS[fmt]
    return run_gemm(native, int(t), nbytes, OFF, isa, w, rows, kb, xq, 2, n)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kind", ["quantized", "random"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemm_against_reference(fmt: str, kind: str, isa_name: str) -> None:
    isa = _isa(isa_name)
    t, nbytes, _, _ = FORMATS[fmt]
    assert isa_name in native.kernels()[int(t)], f"no {isa_name} gemm registered for {fmt}: {native.kernels()[int(t)]}"
    rng = np.random.default_rng([int(t), len(kind)])
    w = _weights(fmt, kind, rng)
    x = _activations(16, rng)
    worst = 0.0
    for kb in (0, 1, 3, 5):
        xs = {n: _quantize_x(x[:n], kb) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16)}
        for rows in (0, 1, 7, 37, 64):  # 37: two 16-row tiles and 5 rows (from 8 activation rows)
            wd, wabs = _dequantized(fmt, w[:rows, OFF * nbytes : (OFF + kb) * nbytes])
            for n, (xq, xd) in xs.items():
                ref, scale = xd @ wd.T, np.abs(xd) @ wabs.T
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


def test_activation_block_layout() -> None:
    """The sizes and the sub-scale range Python assumes (kernels.block) are the extension's."""
    from shardwise.kernels.block import _ACT_BYTES, A256_M

    assert (A256, _ACT_BYTES[32], A256_M) == (native.A256_BYTES, native.A32_BYTES, native.A256_M)
    assert _ACT_BYTES[256] == A256


@pytest.mark.parametrize("isa_name", ISAS)
def test_activation_blocks_against_fake_quantize(isa_name: str) -> None:
    """sw_a256 on each ISA: the values d m[j] q are kernels.block.fake_quantize's, bit for bit;
    m in 1 .. A256_M with A256_M on the block's largest sub-block; bsum m times the sums of 16;
    a sub-block far below the block's outlier keeps its own levels (the point of m)."""
    from shardwise.kernels.block import A256_M, fake_quantize

    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 4 * 256)).astype(np.float32)
    x[:, 5] = 300.0  # an outlier channel in sub-block 0 of block 0
    x[:, 256:512] = 0.0  # an all-zero block
    x[3, 512:768] *= 1e-3  # a small block: its own scale
    buf = np.zeros(x.shape[0] * 4 * A256, dtype=np.uint8)
    native.quantize(256, _isa(isa_name), x.ctypes.data, x.shape[1], x.shape[0], x.shape[1], buf.ctypes.data)
    blocks = buf.reshape(-1, A256)
    d = blocks[:, 0:4].copy().view(np.float32)  # (blocks, 1)
    bsum = blocks[:, 4:36].copy().view(np.int16)  # (blocks, 16)
    m, m16 = blocks[:, 36:44].astype(np.int64), blocks[:, 44:60].astype(np.int64)
    q = blocks[:, 60:].view(np.int8).astype(np.int64)
    assert ((m >= 1) & (m <= A256_M)).all() and (m16 == np.repeat(m, 2, axis=1)).all()
    live = d[:, 0] > 0
    assert (m[live].max(axis=1) == A256_M).all()
    np.testing.assert_array_equal(bsum, np.repeat(m, 2, axis=1) * q.reshape(-1, 16, 16).sum(-1))
    values = (d * np.repeat(m, 32, axis=1).astype(np.float32)) * q.astype(np.float32)
    want = fake_quantize(torch.from_numpy(x), 256).numpy().reshape(-1, 256)
    np.testing.assert_array_equal(values, want)
    assert m[0, 0] == A256_M and (m[0, 1:] == 1).all(), m[0]  # block 0: the outlier's sub-block, then small ones
    assert np.abs(q[0, 32:]).max() >= 2  # ... which still get levels of their own


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_against_gguf(fmt: str, isa_name: str) -> None:
    isa = _isa(isa_name)
    t, nbytes, _, _ = FORMATS[fmt]
    rng = np.random.default_rng(int(t))
    w = _weights(fmt, "random", rng)
    for rows, kb in ((0, 3), (1, 1), (7, 3), (64, 5), (5, 0)):
        out = np.full(rows * kb * 256 + 1, np.nan, dtype=np.float32)
        native.dequantize(int(t), isa, w.ctypes.data + OFF * nbytes, w.shape[1], rows, kb, out.ctypes.data)
        assert np.isnan(out[-1]), "wrote past the output"
        got = out[:-1].reshape(rows, kb * 256)
        wk = np.ascontiguousarray(w[:rows, OFF * nbytes : (OFF + kb) * nbytes])
        want = quants.dequantize(wk, t).reshape(rows, kb * 256) if rows * kb else got
        # 1 ulp: s * q - m may be one fused rounding here and two in gguf's numpy
        np.testing.assert_allclose(got, want, rtol=0, atol=float(np.abs(want).max(initial=0)) * 2**-22 + 1e-30)


def test_tiles_off_switch_gives_the_row_kernels_result() -> None:
    """SHARDWISE_K_TILES=0 (read at import, so in a child process) turns the avx512 tiles off:
    the same products to fp32 rounding, from the row kernels."""
    import os
    import subprocess
    import sys

    if "avx512" not in native.isas():  # registered is not runnable: an AVX2-only CPU has the table entry too
        pytest.skip(f"this CPU runs no avx512 kernels (it runs {native.isas()})")
    code = (
        "import numpy as np, torch\n"
        "from shardwise.kernels import BlockWeight, quantize_rows\n"
        "import shardwise.kernels.block as block\n"
        "block.PREFILL_ROWS = None\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(48, 512)\n"
        "out = [BlockWeight.of([(f, quantize_rows(w, f))], 512).linear(torch.randn(9, 512)) for f in ('Q4_K', 'Q5_K', 'Q6_K')]\n"
        "np.save(__import__('sys').argv[1], torch.stack(out).numpy())\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ys = []
        for flag in ("1", "0"):
            path = os.path.join(d, f"y{flag}.npy")
            env = {**os.environ, "SHARDWISE_K_TILES": flag}
            done = subprocess.run(
                [sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr[-2000:]
            ys.append(np.load(path))
    on, off = ys
    assert np.abs(on).max() > 1.0  # real products, not zeros
    # the tiles scale a block's exact integer sum once, the row kernels 8 partial sums: they
    # round differently somewhere in 1296 outputs, so equal bits would mean the switch did nothing
    assert not np.array_equal(on, off), "SHARDWISE_K_TILES=0 changed nothing"
    np.testing.assert_allclose(on, off, rtol=1e-5, atol=1e-4 * np.abs(off).max())
