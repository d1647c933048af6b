"""Rank functions of the quantized-layer parity tests, fn(world, ...): every tensor-parallel
layer with fp16 / int8 weights against its unsharded converted twin (the same layer at
tp = 1, converted the same way), batch > 1, on widths tp divides and widths it does not.

What must hold, and why:
- Column-parallel layers (column, qkv, merged gate/up, the LM head) hold whole output rows,
  so their per-row scales are the unsharded ones, and their input is replicated, so its
  per-call quantization is too: each output column is computed exactly as at tp = 1.
  Checked to fp32 rounding (the GEMM's blocking may differ).
- Row-parallel layers hold a run of each row's columns: the scale covers that run, and
  each rank quantizes its own input slice. Checked against the unsharded twin and the
  float layer within the scheme's error, and against a wrong slice (which must be far off).
- Embedding tables: dequantized rows, identical at any tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import LocalCommunicator
from shardwise.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from shardwise.layers.partition import split_ranges
from shardwise.quant.convert import quantize_model

__all__ = ["quantized_layers_case", "quantized_layer_case", "KINDS", "TOL"]

KINDS = ("column", "column_gather", "row", "qkv", "merged", "head", "embedding")

B, T = 3, 5
TOL = {"fp16": 2e-3, "int8": 6e-2}
"""Max error relative to the output's scale, against the float layer (int8: 63-level weights
and 8-bit activations per call; measured about 1-2% on these random layers)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


def _shard(t: torch.Tensor, comm, dim: int) -> torch.Tensor:
    start, end = split_ranges(t.shape[dim], comm.size)[comm.rank]
    return t.narrow(dim, start, end - start)


def _converted(make, comm, scheme: str) -> nn.Module:
    """make(comm) -> a parallel layer; returned converted, in a ModuleDict so quantize_model sees it."""
    holder = nn.ModuleDict({"layer": make(comm)})
    quantize_model(holder, scheme)
    return holder["layer"]


def _check_exact(y: torch.Tensor, twin: torch.Tensor, ref: torch.Tensor, scheme: str, what: str) -> None:
    torch.testing.assert_close(y, twin, rtol=1e-5, atol=1e-5 * twin.abs().max().item(), msg=lambda m: f"{what}: {m}")
    err = _rel(y, ref)
    assert err <= TOL[scheme], f"{what}: {err:.2e} from the float layer (tolerance {TOL[scheme]})"


def quantized_layers_case(comm, scheme: str, width: int) -> None:
    """Every kind of layer, one after the other (one pooled case per world size)."""
    for kind in KINDS:
        quantized_layer_case(comm, kind, scheme, width)


def quantized_layer_case(comm, kind: str, scheme: str, width: int) -> None:
    torch.manual_seed(7)
    one = LocalCommunicator()
    if kind in ("column", "column_gather"):
        gather = kind == "column_gather"
        full = nn.Linear(24, width, bias=True)
        x = torch.randn(B, T, 24)
        make = lambda c: ColumnParallelLinear.from_linear(full, comm=c, gather_output=gather)  # noqa: E731
        with torch.no_grad():
            y, twin, ref = _converted(make, comm, scheme)(x), _converted(make, one, scheme)(x), full(x)
        if not gather:
            twin, ref = _shard(twin, comm, -1), _shard(ref, comm, -1)
        _check_exact(y, twin, ref, scheme, kind)
    elif kind == "qkv":  # 9 query / 3 KV heads: uneven at tp 2 and 4, KV heads shared by two ranks
        full = nn.Linear(32, (9 + 2 * 3) * 4, bias=True)
        x = torch.randn(B, T, 32)
        make = lambda c: QKVParallelLinear.from_linear(full, num_heads=9, num_kv_heads=3, comm=c)  # noqa: E731
        layer = _converted(make, comm, scheme)
        rows = torch.cat(
            [torch.arange(s.start, s.stop) + off for s, off in zip(layer.local_rows(), (0, 36, 48), strict=True)]
        )
        with torch.no_grad():
            y, twin, ref = layer(x), _converted(make, one, scheme)(x)[..., rows], full(x)[..., rows]
        _check_exact(y, twin, ref, scheme, kind)
    elif kind == "merged":
        gate, up = nn.Linear(24, width), nn.Linear(24, width)
        x = torch.randn(B, T, 24)
        make = lambda c: MergedColumnParallelLinear.from_linears(gate, up, comm=c)  # noqa: E731
        with torch.no_grad():
            g, u = _converted(make, comm, scheme)(x).chunk(2, dim=-1)
            g1, u1 = _converted(make, one, scheme)(x).chunk(2, dim=-1)
            y, twin = F.silu(g) * u, _shard(F.silu(g1) * u1, comm, -1)
            ref = _shard(F.silu(gate(x)) * up(x), comm, -1)
        _check_exact(y, twin, ref, scheme, kind)
    elif kind == "head":  # a vocabulary tp may not divide, gathered
        lin = nn.Linear(16, width, bias=False)
        x = torch.randn(B, T, 16)
        make = lambda c: VocabParallelLMHead.from_linear(lin, comm=c, gather_output=True)  # noqa: E731
        with torch.no_grad():
            y, twin, ref = _converted(make, comm, scheme)(x), _converted(make, one, scheme)(x), lin(x)
        _check_exact(y, twin, ref, scheme, kind)
    elif kind == "embedding":
        emb = nn.Embedding(width, 16)
        ids = torch.randint(0, width, (B, T))
        ids[0, 0], ids[1, 1] = 0, width - 1
        make = lambda c: VocabParallelEmbedding.from_embedding(emb, comm=c)  # noqa: E731
        with torch.no_grad():
            y, twin, ref = _converted(make, comm, scheme)(ids), _converted(make, one, scheme)(ids), emb(ids)
        _check_exact(y, twin, ref, scheme, kind)
    elif kind == "row":
        full = nn.Linear(width, 24, bias=True)
        x = torch.randn(B, T, width)
        make = lambda c: RowParallelLinear.from_linear(full, comm=c)  # noqa: E731
        layer = _converted(make, comm, scheme)
        with torch.no_grad():
            y, twin, ref = layer(_shard(x, comm, -1)), _converted(make, one, scheme)(x), full(x)
            wrong = layer(_shard(x.roll(1, dims=-1), comm, -1)) if comm.size > 1 else None
        for other, what in ((twin, "the unsharded converted twin"), (ref, "the float layer")):
            err = _rel(y, other)
            assert err <= TOL[scheme], f"row: {err:.2e} from {what} (tolerance {TOL[scheme]})"
        if wrong is not None:
            assert _rel(wrong, ref) > 5 * TOL[scheme], "a shifted input slice should not match: the check is blind"
    else:
        raise ValueError(kind)
