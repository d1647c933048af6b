"""Rank functions of the layer parity tests, fn(world, ...): every tensor-parallel layer
against its unsharded twin, outputs, input and parameter gradients, batch > 1. Each
raises on a mismatch; the gloo tests (through the rank pool) and the MPI test run them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_close, sharded_grads_expected
from shardwise.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_cross_entropy,
)
from shardwise.layers.partition import split_ranges
from shardwise.sharding import Vocab

__all__ = ["DTYPES", "linear_case", "qkv_case", "merged_case", "vocab_case", "untied_head_case"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
B, T = 3, 5  # batch > 1 and a sequence dim: (B, T, features)


def _shard(t: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """This rank's slice along dim: equal when tp divides it, else as split_ranges deals it."""
    start, end = split_ranges(t.shape[dim], comm.size)[comm.rank]
    return t.narrow(dim, start, end - start)


def linear_case(comm, kind: str, dtype_name: str, gather: bool, width: int = 36) -> None:
    """width: the split dim (column: out_features, row: in_features); one tp does not divide
    is split unevenly."""
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)  # same unsharded layer, input and upstream gradient on every rank
    full = nn.Linear(24, width, bias=True).to(dtype)
    x = torch.randn(B, T, 24, dtype=dtype, requires_grad=True)
    gy = torch.randn(B, T, width, dtype=dtype)
    y_ref = full(x)
    y_ref.backward(gy)

    if kind == "column":
        layer = ColumnParallelLinear.from_linear(full, comm=comm, gather_output=gather)
        expect_w, expect_b = _shard(full.weight.grad, comm, 0), _shard(full.bias.grad, comm, 0)
        x_local = x.detach().clone().requires_grad_()
        y_expect, gy_local = (y_ref, gy) if gather else (_shard(y_ref, comm, -1), _shard(gy, comm, -1))
    else:  # row: the input arrives sharded, as from a column-parallel layer
        full_in = nn.Linear(width, 24, bias=True).to(dtype)
        x = torch.randn(B, T, width, dtype=dtype, requires_grad=True)
        gy = torch.randn(B, T, 24, dtype=dtype)
        y_ref = full_in(x)
        y_ref.backward(gy)
        layer = RowParallelLinear.from_linear(full_in, comm=comm)
        expect_w, expect_b = _shard(full_in.weight.grad, comm, 1), full_in.bias.grad
        x_local = _shard(x.detach(), comm, -1).clone().requires_grad_()
        y_expect, gy_local = y_ref, gy
    y = layer(x_local)
    y.backward(gy_local)
    assert_close(y, y_expect.detach(), "output")
    x_grad_expect = x.grad if kind == "column" else _shard(x.grad, comm, -1)
    assert_close(x_local.grad, x_grad_expect, "input grad")
    assert_close(layer.weight.grad, expect_w, "weight grad")
    assert_close(layer.bias.grad, expect_b, "bias grad")


def qkv_case(comm, num_heads: int, num_kv_heads: int, dtype_name: str, separate: bool) -> None:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(1)
    hidden, hd = 32, 4
    full = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * hd, bias=True).to(dtype)
    x = torch.randn(B, T, hidden, dtype=dtype, requires_grad=True)
    y_ref = full(x)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)

    if separate:  # q, k, v as three nn.Linear, as in most Hugging Face checkpoints
        q_rows, kv_rows = num_heads * hd, num_kv_heads * hd
        parts = []
        for w, b in zip(
            full.weight.split([q_rows, kv_rows, kv_rows]), full.bias.split([q_rows, kv_rows, kv_rows]), strict=True
        ):
            lin = nn.Linear(hidden, w.shape[0]).to(dtype)
            lin.weight.data.copy_(w)
            lin.bias.data.copy_(b)
            parts.append(lin)
        layer = QKVParallelLinear.from_linears(*parts, num_heads=num_heads, num_kv_heads=num_kv_heads, comm=comm)
    else:
        layer = QKVParallelLinear.from_linear(full, num_heads=num_heads, num_kv_heads=num_kv_heads, comm=comm)
    x_local = x.detach().clone().requires_grad_()
    y = layer(x_local)

    q_sl, k_sl, v_sl = layer.local_rows()
    q_rows, kv_rows = num_heads * hd, num_kv_heads * hd

    def local(t):  # this rank's [q | k | v] slice of an unsharded (..., q+2kv) tensor
        q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=-1 if t.dim() != 2 else 0)
        if t.dim() == 2:
            return torch.cat([q[q_sl], k[k_sl], v[v_sl]], dim=0)
        return torch.cat([q[..., q_sl], k[..., k_sl], v[..., v_sl]], dim=-1)

    # NOTE: a replicated KV head is one tensor held by several ranks (kv_holders). In
    # attention, each replica's gradient covers only its own query heads, and the replicas'
    # gradients add up to the unsharded one; split the unsharded k/v gradient the same way here.
    gy_local = local(gy)
    holders = torch.tensor([layer.layout.kv_holders[h] for h in layer.layout.kv_heads(comm.rank)], dtype=dtype)
    per_row = holders.repeat_interleave(hd).repeat(2)  # (2 * local kv * hd,): k rows, then v rows
    gy_local[..., layer.q_size :] /= per_row
    y.backward(gy_local)
    assert_close(y, local(y_ref.detach()), "qkv output")
    assert_close(x_local.grad, x.grad, "input grad")
    assert_close(layer.weight.grad, local(full.weight.grad), "weight grad (replicated KV grads summed)")
    q_b, k_b, v_b = full.bias.grad.split([q_rows, kv_rows, kv_rows])
    assert_close(layer.bias.grad, torch.cat([q_b[q_sl], k_b[k_sl], v_b[v_sl]]), "bias grad")


def merged_case(comm, dtype_name: str, width: int = 12) -> None:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(2)
    gate, up = nn.Linear(24, width).to(dtype), nn.Linear(24, width).to(dtype)
    x = torch.randn(B, T, 24, dtype=dtype, requires_grad=True)
    y_ref = F.silu(gate(x)) * up(x)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)
    layer = MergedColumnParallelLinear.from_linears(gate, up, comm=comm)
    x_local = x.detach().clone().requires_grad_()
    g, u = layer(x_local).chunk(2, dim=-1)
    y = F.silu(g) * u
    y.backward(_shard(gy, comm, -1))
    assert_close(y, _shard(y_ref.detach(), comm, -1), "gated output")
    assert_close(x_local.grad, x.grad, "input grad")
    w_expect = torch.cat([_shard(gate.weight.grad, comm, 0), _shard(up.weight.grad, comm, 0)])
    b_expect = torch.cat([_shard(gate.bias.grad, comm, 0), _shard(up.bias.grad, comm, 0)])
    assert_close(layer.weight.grad, w_expect, "weight grad")
    assert_close(layer.bias.grad, b_expect, "bias grad")


def vocab_case(comm, vocab: int, dtype_name: str) -> None:
    """Embedding -> tied vocab-parallel head -> vocab-parallel CE, against F.cross_entropy."""
    dtype = DTYPES[dtype_name]
    torch.manual_seed(3)
    hidden = 16
    emb = nn.Embedding(vocab, hidden).to(dtype)
    ids = torch.randint(0, vocab, (B, T))
    ids[0, 0], ids[1, 1] = 0, vocab - 1  # both ends of the vocabulary, including the padded rank
    target = torch.randint(0, vocab, (B, T))
    target[0, 1], target[2, 3] = vocab - 1, -100  # last id, and an ignored position

    x = emb(ids)  # (B, T, hidden)
    logits = x @ emb.weight.t()  # tied head: (B, T, vocab)
    loss_ref = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none").view(B, T)
    loss_ref.sum().backward()

    pemb = VocabParallelEmbedding.from_embedding(emb, comm=comm)
    head = VocabParallelLMHead.tied(pemb)
    gathered = VocabParallelLMHead.tied(pemb, gather_output=True)
    local_logits = head(pemb(ids))  # (B, T, V_pad/p)
    loss = vocab_parallel_cross_entropy(local_logits, target, comm=comm)
    loss.sum().backward()

    assert_close(gathered(pemb(ids)), logits.detach(), "gathered logits")
    if dtype == torch.float32:
        assert_close(loss, loss_ref.detach(), "per-token loss")
    else:  # bf16 logits: the loss is computed in fp32 from them; compare at bf16 resolution
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=2e-2, atol=2e-2)
    assert (loss[2, 3] == 0).item(), "ignored position must have zero loss"
    assert_close(pemb.weight.grad, pemb.shard.copy_rows(emb.weight.grad), "tied weight grad")


def untied_head_case(comm) -> None:
    torch.manual_seed(4)
    lin = nn.Linear(16, 50, bias=True)
    x = torch.randn(B, T, 16, requires_grad=True)
    y_ref = lin(x)
    y_ref.backward(torch.ones_like(y_ref))
    plan = {"head": Vocab(gather_output=True)}
    model = nn.ModuleDict({"head": lin})
    expected = sharded_grads_expected(model, plan, comm)
    head = VocabParallelLMHead.from_linear(lin, comm=comm, gather_output=True)
    x_local = x.detach().clone().requires_grad_()
    y = head(x_local)
    y.backward(torch.ones_like(y))
    assert_close(y, y_ref.detach(), "logits")
    assert_close(x_local.grad, x.grad, "input grad")
    assert_close(head.weight.grad, expected["head.weight"], "weight grad")
    assert_close(head.bias.grad, expected["head.bias"], "bias grad")
