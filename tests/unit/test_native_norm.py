"""The native RMSNorm (csrc/norm.c) on every ISA this CPU runs against F.rms_norm: rows of
several widths (a multiple of 16 and not), batches, a non-contiguous input, a zero row; and
where it must step aside (autograd, bf16, meta) it is F.rms_norm itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.kernels import native
from shardwise.kernels.ops import rms_norm

pytestmark = pytest.mark.skipif(native.lib is None, reason="the native kernels are not built")


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_rms_norm_equals_torch_on_every_isa(isa):
    if isa not in native.ISAS:
        pytest.skip(f"this CPU does not run {isa} (it runs {native.ISAS})")
    torch.manual_seed(0)
    with native.use_isa(isa):
        for shape in ((1, 1, 576), (3, 5, 2048), (2, 7, 100), (4, 17), (1, 3)):
            x = torch.randn(shape) * 5
            x[..., 0, :] = 0  # a zero row: eps keeps it finite
            w = torch.randn(shape[-1])
            got, want = rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6)
            assert got.shape == want.shape and torch.isfinite(got).all()
            assert (got - want).abs().max() <= 1e-6 * want.abs().max() + 1e-12, (isa, shape)
        x = torch.randn(6, 64).t()  # non-contiguous (64, 6) rows
        w = torch.randn(6)
        assert torch.allclose(rms_norm(x, w, 1e-5), F.rms_norm(x, (6,), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_autograd_bf16_and_meta_take_torchs_path():
    torch.manual_seed(1)
    x = torch.randn(3, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    y = rms_norm(x, w, 1e-5)
    y.sum().backward()  # differentiable: F.rms_norm's graph
    assert x.grad is not None and w.grad is not None
    xb = torch.randn(3, 32, dtype=torch.bfloat16)
    assert rms_norm(xb, w.detach().bfloat16(), 1e-5).dtype == torch.bfloat16
    assert rms_norm(torch.empty(2, 32, device="meta"), torch.empty(32, device="meta"), 1e-5).device.type == "meta"


def test_without_the_extension_it_is_torchs_rms_norm(monkeypatch):
    monkeypatch.setattr(native, "lib", None)  # a machine where the extension did not build
    x, w = torch.randn(3, 576), torch.randn(576)
    assert torch.equal(rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))


def test_argmax_equals_torch_argmax():
    """Greedy sampling's native argmax: the same indices as torch.argmax(dim=-1), ties (the
    first), NaN (the first NaN), -inf, a row of one, non-contiguous and 1-D/3-D inputs."""
    from shardwise.kernels.ops import argmax

    torch.manual_seed(0)
    x = torch.randn(16, 1000)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first
    x[2, :] = float("-inf")
    x[3, 5] = float("nan")
    x[3, 9] = float("nan")  # the first NaN
    x[4, 0] = float("nan")
    x[5, 999] = float("inf")
    x[6, :] = 0.0
    for t in (x, x[:, ::3], x.t().contiguous().t(), x[0], x.view(4, 4, 1000), x[:, :1], x[:0]):
        got = argmax(t)
        assert got.dtype == torch.long and got.shape == t.shape[:-1]
        assert torch.equal(got, t.argmax(dim=-1)), t.shape
    half = x.to(torch.bfloat16)  # steps aside: torch's own
    assert torch.equal(argmax(half), half.argmax(dim=-1))
