"""kernels.wgrad: the linear whose backward accumulates the weight's gradient itself, against
autograd's own (F.linear, F.embedding): outputs and every gradient over several micro-batches, batch > 1,
with and without bias, a weight shared with an embedding lookup (tied); the buffer kept from
step to step written afresh (no stale sum); the paths it must not take; and a whole training
run (shardwise.train, micro-batches of 2, with and without activation checkpointing) with the
fused path against it switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.comm import LocalCommunicator
from shardwise.kernels import embedding, linear, wgrad
from shardwise.train import full_state, setup, train_step
from train_helpers import tiny_config, write_tiny_tokens


def _params(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    b = torch.nn.Parameter(torch.randn(24, generator=g)) if bias else None
    return w, b


def _micro_batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 16, generator=g) for _ in range(n)]  # (B, T, in)


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_over_micro_batches_match_autograds(bias):
    (w0, b0), (w1, b1) = _params(bias), _params(bias)
    wgrad.fuse([w1])
    xs = _micro_batches()
    for x in xs:
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = F.linear(xa, w0, b0), linear(xb, w1, b1)  # ops.linear takes the fused path for w1
        torch.testing.assert_close(yb, ya, rtol=0, atol=0)
        gy = torch.cos(ya.detach())
        ya.backward(gy)
        yb.backward(gy)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)
    assert w1.grad is not None and w1.grad.shape == w1.shape
    torch.testing.assert_close(w1.grad, w0.grad, rtol=1e-6, atol=1e-5)
    if bias:
        torch.testing.assert_close(b1.grad, b0.grad, rtol=1e-6, atol=1e-6)


def test_the_kept_buffer_is_written_afresh_next_step():
    (w0, _), (w1, _) = _params(False), _params(False)
    wgrad.fuse([w1])
    x1, x2 = _micro_batches(2)
    linear(x1, w1).sum().backward()
    kept = w1.grad.data_ptr()
    wgrad.release([w1])
    assert w1.grad is None  # as zero_grad(set_to_none=True) leaves it
    linear(x2, w1).pow(2).sum().backward()
    F.linear(x2, w0).pow(2).sum().backward()
    assert w1.grad.data_ptr() == kept  # the same memory, not a fresh tensor
    torch.testing.assert_close(w1.grad, w0.grad, rtol=1e-6, atol=1e-5)  # and nothing of step 1 in it


def test_a_weight_tied_to_an_embedding_gets_both_gradients():
    (w0, _), (w1, _) = _params(False), _params(False)
    wgrad.fuse([w1])
    ids = torch.tensor([[3, 7, 3], [0, 23, 5]])
    for w, lin in ((w0, F.linear), (w1, linear)):
        h = F.embedding(ids, w)  # (B, T, 16): rows of the table
        logits = lin(torch.tanh(h), w)  # (B, T, 24): the same table as the head
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(w1.grad, w0.grad, rtol=1e-6, atol=1e-6)


def test_an_embedding_lookup_adds_its_rows_into_the_gradient():
    """Repeated ids, batch > 1; untied (the first write makes .grad, zeroed) and after a step
    (the kept buffer zeroed, not added to)."""
    (w0, _), (w1, _) = _params(False), _params(False)
    wgrad.fuse([w1])
    ids = torch.tensor([[3, 7, 3, 3], [0, 22, 5, 7]])
    gy = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    for step in range(2):
        for w, look in ((w0, F.embedding), (w1, embedding)):
            look(ids + step, w).backward(gy)
        torch.testing.assert_close(w1.grad, w0.grad, rtol=0, atol=1e-6)
        kept = w1.grad.data_ptr()
        wgrad.release([w1])
        w0.grad = None
    embedding(ids, w1).backward(gy)
    assert w1.grad.data_ptr() == kept


def test_the_fused_path_is_taken_only_where_it_may():
    w, _ = _params(False)
    assert not wgrad.fused(w)  # not opted in
    wgrad.fuse([w])
    assert wgrad.fused(w)
    with torch.no_grad():
        assert not wgrad.fused(w)  # inference
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not wgrad.fused(w)  # autocast's casts live in autograd's graph
    w.requires_grad_(False)
    assert not wgrad.fused(w)
    w.requires_grad_(True)
    assert not wgrad.fused(w * 2)  # not a leaf
    assert wgrad.fuse([w], on=False) == 1 and not wgrad.fused(w)


def _train(world, cfg, fused: bool) -> dict:
    tr = setup(world, cfg)
    if not fused:
        wgrad.fuse(tr.model.parameters(), on=False)
    n = sum(bool(getattr(p, "_sw_fuse_wgrad", False)) for p in tr.model.parameters())
    losses = [train_step(tr).loss for _ in range(cfg.run.steps)]
    return {"losses": losses, "state": full_state(tr.model, tr.mesh.tp, tr.specs), "fused": n}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_training_with_the_fused_path_matches_autograds(tmp_path, recompute):
    """full: activation checkpointing's saved-tensor hooks hand back the weight's values as
    another tensor (the fused path once wrote its gradient there, and lost it)."""
    tokens = write_tiny_tokens(tmp_path / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp_path / "run", steps=4, run={"recompute": recompute})  # 4 micro-batches of 2 a step
    on, off = (_train(LocalCommunicator(), cfg, fused) for fused in (True, False))
    assert on["fused"] > 0 and off["fused"] == 0
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=0, atol=1e-5)
    for name, full in off["state"].items():
        torch.testing.assert_close(on["state"][name], full, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
