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
from shardwise.quant import (
    QuantizedTable,
    QuantizedWeight,
    QuantizeError,
    check_quantize,
    embedding,
    int8_rows,
    linear,
)
from shardwise.quant.convert import conversion_targets, weight_bytes
from shardwise.quant.weights import CPU_QMAX


def test_schemes_and_refusals_name_what_is_supported(monkeypatch):
    assert check_quantize(None) is None
    assert check_quantize("int8") == "int8"
    with pytest.raises(QuantizeError, match=r"--quantize int4 is not supported; supported: fp16, int8"):
        check_quantize("int4")
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
        (["generate", "--quantize", "int4"], "--quantize int4 is not supported; supported: fp16, int8"),
        (["serve", "--quantize", "q4_k"], "--quantize q4_k is not supported; supported: fp16, int8"),
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


def test_int8_kernel_is_the_emulated_product():
    """fbgemm's int8 linear = 63-level per-row weights times 8-bit per-tensor activations:
    emulated in fp32 here, it must agree to the activations' rounding."""
    torch.manual_seed(1)
    w, x = torch.randn(32, 64), torch.randn(6, 64)
    q = QuantizedWeight(w, "int8")
    assert q.nbytes == 32 * 64 + 4 * 32
    qi, scale = int8_rows(w, CPU_QMAX)
    assert qi.abs().max() <= CPU_QMAX
    deq = qi.float() * scale[:, None]
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    sx = (hi - lo) / 255
    zp = round(-lo / sx)
    xq = (torch.round(x / sx) + zp).clamp(0, 255)
    emulated = F.linear((xq - zp) * sx, deq)
    y = linear(x, q)
    torch.testing.assert_close(y, emulated, rtol=0, atol=2e-3 * emulated.abs().max().item())
    rel = ((y - F.linear(x, w)).norm() / F.linear(x, w).norm()).item()
    assert rel < 0.03, f"int8 product {rel:.3f} from fp32"


def test_empty_slices_and_tables():
    q = QuantizedWeight(torch.randn(0, 8), "int8")
    assert linear(torch.randn(3, 8), q).shape == (3, 0)
    q = QuantizedWeight(torch.randn(4, 8), "fp16")
    assert linear(torch.randn(0, 8), q).shape == (0, 4)
    w = torch.randn(10, 6)
    w[3] = 0  # a row of zeros: scale 1, rows of zeros back
    for scheme in ("fp16", "int8"):
        t = QuantizedTable(w, scheme)
        ids = torch.tensor([[0, 3, 9], [9, 9, 1]])
        rows = embedding(ids, t)
        assert rows.shape == (2, 3, 6) and rows.dtype == torch.float32 and torch.all(rows[0, 1] == 0)
        if scheme == "int8":
            qi, s = int8_rows(w)
            assert torch.equal(rows, (qi.float() * s[:, None])[ids])
        else:
            assert torch.equal(rows, w.half().float()[ids])


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
    assert (0.49 < ratio < 0.51) if scheme == "fp16" else (0.25 < ratio < 0.27), ratio


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_weights_built_from_blocks_of_rows_equal_whole_conversion(scheme):
    """Rows filled in uneven blocks (as the loaders read them) convert to the same weight and
    table as the whole matrix, bit for bit; a block that does not fit, or rows missing, is refused
    naming the numbers."""
    from shardwise.quant.rows import Rows

    torch.manual_seed(2)
    w = torch.randn(37, 48) * torch.rand(37, 1) * 4
    w[5] = 0
    x = torch.randn(3, 48)
    for make, build in ((Rows.for_weight, QuantizedWeight), (Rows.for_table, QuantizedTable)):
        rows = make(w.shape, scheme)
        for a, b in ((0, 1), (1, 17), (17, 36), (36, 37)):
            rows.add(w[a:b].clone())
        got, want = build(rows, scheme), build(w, scheme)
        if build is QuantizedWeight:
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
        QuantizedWeight(rows, scheme)
