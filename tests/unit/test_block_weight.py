"""BlockWeight, the block-format weight every layer can hold: cut as the layouts cut it
(whole rows for a column-parallel rank, runs of whole blocks for a row-parallel one), its
products equal the unsharded weight's to fp32 rounding, on the native kernels and on the
PyTorch fallback; parts of different formats (a fused q/k/v) and float parts compose; rows
look up as the reference dequantization gives them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise.kernels.block as block
import shardwise.kernels.native as native
from shardwise.kernels import BlockWeight, Part, quantize_rows
from shardwise.kernels.block import fake_quantize
from shardwise.kernels.blocks import FORMATS, dequantize_blocks

TILES = 64
"""Rows from which these tests send a weight down the dequantized-tile path (block.PREFILL_ROWS)."""
FMTS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    if request.param == "native" and native.lib is None:
        pytest.skip("the native extension is not built here")
    if request.param == "fallback":
        monkeypatch.setattr(native, "lib", None)
    return request.param


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_row_and_column_cuts_sum_to_the_unsharded_product(path, fmt, tp):
    torch.manual_seed(tp)
    block, nbytes = FORMATS[fmt].block, FORMATS[fmt].nbytes
    blocks = 6  # uneven over tp 4: 2, 2, 1, 1 blocks
    out, k = 24, blocks * block
    raw = quantize_rows(torch.randn(out, k), fmt)
    whole = BlockWeight([Part(fmt, raw)], k)
    x = torch.randn(5, k)  # a batch of 5 rows
    y = whole.linear(x)
    # row-parallel: runs of whole blocks, each rank its columns of x; partial sums add up
    shares = [blocks // tp + (r < blocks % tp) for r in range(tp)]
    start, partial = 0, torch.zeros_like(y)
    for n in shares:
        part = BlockWeight([Part(fmt, raw[:, start * nbytes : (start + n) * nbytes])], n * block)
        partial += part.linear(x[:, start * block : (start + n) * block])
        start += n
    assert _rel(partial, y) < 1e-6
    # column-parallel: whole rows, each rank its outputs
    rows = torch.tensor_split(torch.arange(out), tp)
    cols = [BlockWeight([Part(fmt, raw[r])], k).linear(x) for r in rows]
    assert _rel(torch.cat(cols, dim=1), y) < 1e-6
    # and the arithmetic: dequantized weights times the activation blocks
    want = F.linear(fake_quantize(x, block), dequantize_blocks(raw, FORMATS[fmt]))
    assert _rel(y, want) < 1e-5


def test_parts_of_several_formats_and_floats_compose(path, monkeypatch):
    """A fused q|k|v of Q4_K, Q4_K and Q6_K, and a float part: one activation quantization per
    block length, each part into its columns; batch 1-16 and a (B, T, in) input."""
    torch.manual_seed(0)
    k = 512
    ws = [torch.randn(32, k), torch.randn(16, k), torch.randn(16, k), torch.randn(8, k)]
    fmts = ["Q4_K", "Q8_0", "Q6_K", "F32"]
    parts = [Part(f, w if f == "F32" else quantize_rows(w, f)) for f, w in zip(fmts, ws, strict=True)]
    fused = BlockWeight(parts, k)
    assert fused.shape == (72, k) and fused.formats == ["F32", "Q4_K", "Q6_K", "Q8_0"]
    for n, tiles in ((1, None), (4, None), (16, None), (TILES, None), (TILES, TILES)):
        monkeypatch.setattr(block, "PREFILL_ROWS", tiles)
        x = torch.randn(n, k)
        y = fused.linear(x)
        singles = [BlockWeight([p], k).linear(x) for p in parts]
        assert torch.allclose(y, torch.cat(singles, dim=1), rtol=0, atol=1e-5 * y.abs().max().item())
    x3 = torch.randn(2, 3, k, dtype=torch.bfloat16)
    y3 = fused.linear(x3, torch.ones(72, dtype=torch.bfloat16))
    assert y3.shape == (2, 3, 72) and y3.dtype == torch.bfloat16


def test_prefill_rows_run_dequantized_weights_against_float_activations(path, monkeypatch):
    monkeypatch.setattr(block, "PREFILL_ROWS", TILES)
    torch.manual_seed(1)
    raw = quantize_rows(torch.randn(40, 256), "Q4_K")
    w = BlockWeight([Part("Q4_K", raw)], 256)
    x = torch.randn(TILES, 256)
    want = F.linear(x, dequantize_blocks(raw, FORMATS["Q4_K"]))
    assert _rel(w.linear(x), want) < 1e-6


def test_lookup_narrow_and_refusals():
    torch.manual_seed(2)
    table = torch.randn(50, 64)
    raw = quantize_rows(table, "Q5_1")
    w = BlockWeight([Part("Q5_1", raw[:20]), Part("Q8_0", quantize_rows(table[20:], "Q8_0"))], 64)
    ids = torch.tensor([[3, 45, 19], [20, 0, 49]])
    full = torch.cat(
        [dequantize_blocks(raw[:20], FORMATS["Q5_1"]), dequantize_blocks(w.parts[1].data, FORMATS["Q8_0"])]
    )
    assert torch.equal(w.lookup(ids), full[ids])
    sub = w.narrow(15, 10)  # rows spanning both parts (one expert's block)
    assert sub.shape == (10, 64) and [p.fmt for p in sub.parts] == ["Q5_1", "Q8_0"]
    with pytest.raises(ValueError, match=r"a Q4_K part of 64 columns is \(3, 144\) uint8"):
        BlockWeight([Part("Q4_K", torch.zeros(3, 100, dtype=torch.uint8))], 64)
    with pytest.raises(ValueError, match="format Q3_K has no kernel"):
        BlockWeight([Part("Q3_K", torch.zeros(3, 110, dtype=torch.uint8))], 256)
