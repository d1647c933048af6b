"""The native decode step in one process (shardwise.models.step, kernels.step): where it runs
it equals the per-op path bit for bit (Q8_0, a K-quant, Qwen2's q/k/v biases), where it cannot
it says why and the per-op path runs, a replaced weight rebuilds it, and the native module
refuses a program it has no kernel for. The sharded cases are tests/multiproc/test_native_step.py."""

from __future__ import annotations

import pytest
import torch

from hf_models import save_tiny
from shardwise.comm import LocalCommunicator
from shardwise.hf import load_pretrained
from shardwise.kernels import native, step

pytestmark = pytest.mark.skipif(not step.enabled(), reason="the native module (or its step) is not built")

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""Widths of whole blocks of 256, for the K-quants."""


def _logits(model, native_step: bool, B: int = 3, L: int = 6, new: int = 4) -> torch.Tensor:
    from shardwise.engine.generate import decode_step, prefill

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.cfg.vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded row: the step's mask
    caches = model.new_caches(B, L + new)
    out = []
    with torch.no_grad(), step.off() if not native_step else torch.no_grad():
        logits = prefill(model, ids, mask, caches)
        for t in range(new):
            out.append(logits)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            logits = decode_step(model, logits.argmax(-1, keepdim=True), mask, caches, L + t)
    return torch.stack(out)


def _load(tmp_path, family, quantize, overrides=None):
    path = save_tiny(family, tmp_path, overrides=overrides)
    model, _ = load_pretrained(str(path), comm=LocalCommunicator("tp"), quantize=quantize)
    return model


def _ran(model) -> bool:
    return any(e for e in model.__dict__.get("_step_programs", {}).values())


@pytest.mark.parametrize(
    "family,quantize,overrides",
    [
        ("llama3", "q8_0", None),
        ("llama3", "q4_k", WIDE),
        ("qwen2", "q5_1", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)),
        ("llama3", "q6_k", WIDE),
    ],
)
def test_the_native_step_equals_the_per_op_path(tmp_path, family, quantize, overrides):
    model = _load(tmp_path, family, quantize, overrides)
    plain = _logits(model, False)
    assert not _ran(model)
    fast = _logits(model, True)
    assert _ran(model), model.__dict__.get("_step_refused")
    assert torch.equal(plain, fast), (plain - fast).abs().max().item()


@pytest.mark.parametrize("isa", native.ISAS)
def test_every_kernel_path_the_cpu_runs_gives_the_per_op_paths_logits(tmp_path, isa):
    """The program takes the kernels' variant in force when it is built (portable always runs)."""
    model = _load(tmp_path, "llama3", "q4_k", WIDE)
    with native.use_isa(isa):
        plain, fast = _logits(model, False), _logits(model, True)
    assert _ran(model) and torch.equal(plain, fast), isa


@pytest.mark.parametrize(
    "family,quantize,why",
    [
        ("llama3", "fp16", "qkv: a weight not in native blocks"),  # fp16 weights: op by op
        ("qwen3", "q8_0", "q/k norm"),
        ("gemma", "q8_0", "with offset"),
    ],
)
def test_where_it_cannot_run_it_says_why_and_the_layers_run_op_by_op(tmp_path, family, quantize, why):
    model = _load(tmp_path, family, quantize)
    plain = _logits(model, False)
    fast = _logits(model, True)
    assert not _ran(model) and why in model.__dict__["_step_refused"], model.__dict__.get("_step_refused")
    assert torch.equal(plain, fast)


# Two fp32 summation orders through the layers: within 1e-5 of each other on the Intel Xeon of
# earlier rounds, up to 4.4e-5 apart on an AMD EPYC Zen 4 (2026-12-05), whose MKL kernels sum
# in another order. Logits of order 1; a wrong weight or row would be off by far more.
FP32_ORDER_TOL = 1e-4


@pytest.mark.parametrize("overrides,layout", [(None, False), (WIDE, False), (WIDE, True)])
def test_an_fp32_model_runs_its_linears_natively_within_rounding(tmp_path, overrides, layout):
    """fp32 weights: the program's own fp32 kernel (csrc/f32.c) where the per-op path runs MKL's,
    so the two differ in summation order only; also with the wide weights re-strided
    column-major for decode (quant.layout.decode_layout, as generate and serve do)."""
    from shardwise.quant.layout import decode_layout

    model = _load(tmp_path, "llama3", None, overrides)
    if layout:  # the order decode_layout gives the per-op path (with the program, it keeps rows)
        with step.off():
            decode_layout(model, rows=1)
        assert model.layers[0].attn.qkv.weight.stride(0) == 1  # column-major now
    plain = _logits(model, False)
    fast = _logits(model, True)
    assert _ran(model), model.__dict__.get("_step_refused")
    torch.testing.assert_close(fast, plain, rtol=FP32_ORDER_TOL, atol=FP32_ORDER_TOL)
    assert torch.equal(fast.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (7, 33, 5), (64, 576, 1), (130, 100, 16), (5, 17, 9), (300, 9, 2)])
def test_the_fp32_kernel_equals_a_float64_product_on_every_path(isa, transposed, rows, k, n):
    """Row-major weights, and column-major ones (quant/layout.py's decode order): every ISA."""
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(n, k, generator=g)
    if transposed:  # W (rows, k) held as its transpose's rows, rows + 5 apart
        wt = torch.randn(k, rows + 5, generator=g)[:, :rows]
        w, ptr, ld = wt.t(), wt.data_ptr(), rows + 5
    else:  # W's rows k + 3 apart
        w = torch.randn(rows, k + 3, generator=g)[:, :k]
        ptr, ld = w.data_ptr(), k + 3
    y = torch.full((n, rows + 2), float("nan"))
    isa_id = native.lib.ISA_NAMES.index(isa)
    native.lib.f32_gemm(isa_id, ptr, ld, rows, k, x.data_ptr(), k, n, y.data_ptr(), rows + 2, int(transposed))
    ref = (x.double() @ w.double().T).float()
    torch.testing.assert_close(y[:, :rows], ref, rtol=1e-5, atol=1e-5 * k**0.5)
    assert y[:, rows:].isnan().all()  # nothing written past the rows


def test_a_replaced_weight_rebuilds_the_program(tmp_path):
    from shardwise.kernels.block import BlockWeight

    model = _load(tmp_path, "llama3", "q8_0")
    _logits(model, True)
    (entry,) = [e for e in model.__dict__["_step_programs"].values() if e]
    down = model.layers[1].mlp.down
    w = down.weight
    down.weight = BlockWeight([type(p)(p.fmt, p.data.clone().flip(0)) for p in w.parts], w.shape[1])
    plain, fast = _logits(model, False), _logits(model, True)
    assert torch.equal(plain, fast)
    assert all(e is not entry for e in model.__dict__["_step_programs"].values())


def test_re_striding_the_weights_after_a_step_builds_the_program_again(tmp_path):
    """decode_layout replaces fp32 weights' storage in place (same Parameters): the programs
    built before go, and the next steps equal the per-op path in the new order."""
    from shardwise.quant.layout import decode_layout

    model = _load(tmp_path, "llama3", None, WIDE)
    _logits(model, True)
    assert _ran(model)
    with step.off():  # the per-op path's order: column-major
        assert decode_layout(model, rows=1) > 0 and "_step_programs" not in model.__dict__
    plain, fast = _logits(model, False), _logits(model, True)
    assert _ran(model)
    torch.testing.assert_close(fast, plain, rtol=FP32_ORDER_TOL, atol=FP32_ORDER_TOL)


def test_the_native_module_refuses_a_program_it_has_no_kernel_for(tmp_path):
    model = _load(tmp_path, "llama3", "q8_0")
    _logits(model, True)
    (entry,) = [e for e in model.__dict__["_step_programs"].values() if e]
    prog = entry.program
    layers = prog.layers
    bad = type(layers)("q", layers)
    bad[step.Y["qkv"] + 4] = 9  # the first part's ggml type: Q8_1, no kernel
    st = type(layers)("q", [0] * 8)
    with pytest.raises(ValueError, match="step: a weight type without a kernel"):
        native.lib.step(prog.head.buffer_info()[0], bad.buffer_info()[0], *[0] * 11, st.buffer_info()[0])
