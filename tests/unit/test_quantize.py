"""--quantize on one process: the schemes and their refusals, the kernels against their
emulations, what a model converts, and the bytes `info` predicts against the bytes a
loaded rank holds."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from helpers import NoCollectives
from shardwise.cli.main import main
from shardwise.comm import LocalCommunicator
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained, read_config
from shardwise.kernels import BlockWeight
from shardwise.kernels.block import fake_quantize
from shardwise.kernels.blocks import FORMATS, dequantize_blocks
from shardwise.kernels.rows import Rows
from shardwise.quant import (
    QuantizedTable,
    QuantizedWeight,
    QuantizeError,
    check_quantize,
    embedding,
    linear,
)
from shardwise.quant.convert import conversion_targets, quantize_weight, weight_bytes


def test_schemes_and_refusals_name_what_is_supported(monkeypatch):
    assert check_quantize(None) is None
    assert check_quantize("int8") == "int8"
    assert check_quantize("q4_k") == "q4_k"
    with pytest.raises(QuantizeError, match=r"--quantize int4 is not supported; supported: fp16, int8, q8_0, q4_0"):
        check_quantize("int4")
    with pytest.raises(QuantizeError, match="block format computed by shardwise's CPU kernels; on CUDA use int8"):
        check_quantize("q4_k", device="cuda")
    with pytest.raises(QuantizeError, match="inference only"):
        check_quantize("fp16", training=True)
    with pytest.raises(QuantizeError, match="not on mps"):
        check_quantize("int8", device="mps")
    monkeypatch.setattr(torch.backends, "quantized", types.SimpleNamespace(supported_engines=["qnnpack", "none"]))
    with pytest.raises(QuantizeError, match="needs PyTorch's fbgemm.*this build has quantized engines: qnnpack"):
        check_quantize("fp16")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--quantize", "int4"], "--quantize int4 is not supported; supported: fp16, int8, q8_0"),
        (["serve", "--quantize", "q3_k"], "--quantize q3_k is not supported; supported: fp16, int8"),
        (["info", "--quantize", "int4"], "--quantize int4 is not supported"),
    ],
)
def test_cli_refuses_an_unknown_scheme_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err


def test_training_refuses_quantize_before_reading_its_config(capsys, tmp_path):
    code = main(["train", "--config", str(tmp_path / "missing.toml"), "--quantize", "int8"])
    assert code == 2
    assert "--quantize int8 is for inference only" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 40), (5, 40), (1, 40)])
def test_fp16_kernel_is_the_fp16_rounded_product(shape, dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(24, 40), torch.randn(24), torch.randn(shape)
    q = QuantizedWeight(w.to(dtype), "fp16")
    y = linear(x.to(dtype), q, b.to(dtype))
    assert y.shape == (*shape[:-1], 24) and y.dtype == dtype and q.shape == (24, 40) and q.nbytes == 2 * 24 * 40
    expect = F.linear(x.to(dtype).float(), w.to(dtype).half().float(), b.to(dtype).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expect, rtol=tol, atol=tol * expect.abs().max().item())


@pytest.mark.parametrize("scheme", ["int8", "q4_0", "q5_1", "q4_k", "q6_k"])
def test_cpu_schemes_are_block_weights_computing_the_emulated_product(scheme):
    """int8 on CPU is Q8_0 (one fp16 scale per 32 weights); every block scheme's linear equals
    its dequantized weights times its activations quantized per block (d = amax / 127), and
    stays close to the fp32 product."""
    torch.manual_seed(1)
    w, x = torch.randn(32, 512), torch.randn(6, 512)
    x[:, 7] *= 40  # an outlier channel: per-block activation scales keep the other blocks exact
    q = quantize_weight(w, scheme)
    fmt = {"int8": "Q8_0"}.get(scheme, scheme.upper())
    f = FORMATS[fmt]
    assert isinstance(q, BlockWeight) and q.formats == [fmt] and q.nbytes == 32 * 512 // f.block * f.nbytes
    emulated = F.linear(fake_quantize(x, f.block), dequantize_blocks(q.parts[0].data, f))
    y = linear(x, q)
    torch.testing.assert_close(y, emulated, rtol=0, atol=1e-4 * emulated.abs().max().item())
    rel = ((y - F.linear(x, w)).norm() / F.linear(x, w).norm()).item()
    assert rel < {"int8": 0.015, "q6_k": 0.04}.get(scheme, 0.1), f"{scheme} product {rel:.3f} from fp32"


def test_empty_slices_and_tables():
    q = quantize_weight(torch.randn(0, 8), "int8")
    assert linear(torch.randn(3, 8), q).shape == (3, 0)
    q = QuantizedWeight(torch.randn(4, 8), "fp16")
    assert linear(torch.randn(0, 8), q).shape == (0, 4)
    w = torch.randn(10, 6)  # 6 columns: padded to one block of 32 with zero weights
    w[3] = 0  # a row of zeros: rows of zeros back
    for scheme in ("fp16", "int8"):
        t = quantize_weight(w, scheme, "table")
        ids = torch.tensor([[0, 3, 9], [9, 9, 1]])
        rows = embedding(ids, t)
        assert rows.shape == (2, 3, 6) and rows.dtype == torch.float32 and torch.all(rows[0, 1] == 0)
        if scheme == "int8":
            assert isinstance(t, BlockWeight)
            full = dequantize_blocks(t.parts[0].data, FORMATS["Q8_0"])[:, :6]
            assert torch.equal(rows, full[ids])
            torch.testing.assert_close(rows, w[ids], rtol=0, atol=w.abs().max().item() / 127)
        else:
            assert isinstance(t, QuantizedTable) and torch.equal(rows, w.half().float()[ids])


def test_what_a_model_converts(tmp_path):
    """Projections, the head and the table; never norms or routers. A tied matrix: both uses."""
    from hf_models import save_tiny
    from shardwise.models.moe import MoE

    model, _ = load_pretrained(save_tiny("gemma", tmp_path), comm=LocalCommunicator())  # tied
    targets = conversion_targets(model, "int8")
    assert sorted(t.kind for t in targets["embed.weight"]) == ["linear", "table"]
    assert not any("norm" in n for n in targets)
    model, _ = load_pretrained(save_tiny("mixtral", tmp_path), comm=LocalCommunicator())
    names = set(conversion_targets(model, "fp16"))
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.gate.weight is not None and not any(n.endswith("mlp.gate.weight") for n in names)
    assert any(n.endswith("experts.up") for n in names) and any(n.endswith("experts.down") for n in names)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_info_predicts_the_bytes_a_loaded_rank_holds(tp, rank, scheme):
    """`shardwise info --quantize` (from shapes, on meta) against a rank's loaded, converted
    weights (loading is collective-free: one rank of tp built on this process)."""
    from shardwise.cli.info import describe

    _, cfg = read_config(DEFAULT_MODEL)
    predicted = describe(DEFAULT_MODEL, cfg, tp, quantize=scheme)["bytes_by_rank"][rank]
    comm = LocalCommunicator() if tp == 1 else NoCollectives(rank, tp)
    model, report = load_pretrained(DEFAULT_MODEL, comm=comm, quantize=scheme)
    assert report.param_bytes == weight_bytes(model) == predicted
    fp32, _ = load_pretrained(DEFAULT_MODEL, comm=comm)
    ratio = report.param_bytes / weight_bytes(fp32)
    assert (0.49 < ratio < 0.51) if scheme == "fp16" else (0.26 < ratio < 0.29), ratio  # Q8_0: 34 / 128


@pytest.mark.parametrize("scheme", ["fp16", "int8", "q4_k"])
def test_weights_built_from_blocks_of_rows_equal_whole_conversion(scheme):
    """Rows filled in uneven blocks (as the loaders read them) convert to the same weight and
    table as the whole matrix, bit for bit; a block that does not fit, or rows missing, is refused
    naming the numbers."""
    torch.manual_seed(2)
    w = torch.randn(37, 48) * torch.rand(37, 1) * 4
    w[5] = 0
    x = torch.randn(3, 48)
    for kind in ("linear", "table"):
        rows = Rows.for_table(w.shape, scheme) if kind == "table" else Rows.for_weight(w.shape, scheme)
        for a, b in ((0, 1), (1, 17), (17, 36), (36, 37)):
            rows.add(w[a:b].clone())
        got, want = quantize_weight(rows, scheme, kind), quantize_weight(w, scheme, kind)
        if kind == "linear":
            assert torch.equal(linear(x, got), linear(x, want))
        else:
            ids = torch.arange(37)
            assert torch.equal(embedding(ids, got), embedding(ids, want))
        assert got.nbytes == want.nbytes
    rows = Rows.for_weight(w.shape, scheme)
    rows.add(w[:30])
    with pytest.raises(ValueError, match=r"rows 30\.\.40 of shape \(10, 48\) do not fit a \(37, 48\) matrix"):
        rows.add(w[:10])
    with pytest.raises(ValueError, match="30 of 37 rows arrived"):
        quantize_weight(rows, scheme)
