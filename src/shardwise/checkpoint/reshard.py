"""Resharding as arithmetic: which rows of which stored chunks make a rank's local tensor.

A stored tensor is a set of chunks, each the global rows [start, start + length) along
its split dim, covering the tensor exactly once. A target rank's ShardSpec asks for
pieces (start, length) of the same rows, concatenated, then `pad` zero rows. So

    plan_reads(chunks, spec) -> [Read(chunk, src_start, dst_start, length), ...]

is a pure function of two lists of intervals; `assemble` executes it with a reader of
chunk slices. Nothing here knows about files, ranks or collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardwise.hf.checkpoint import CheckpointError
from shardwise.layers import ShardSpec

__all__ = ["Read", "check_cover", "plan_reads", "assemble", "assemble_any"]


@dataclass(frozen=True)
class Read:
    """Copy rows [src_start, src_start + length) of chunk `chunk` to local rows [dst_start, ...)."""

    chunk: int
    src_start: int
    dst_start: int
    length: int


def check_cover(chunks: Sequence[tuple[int, int]], span: int, *, what: str) -> None:
    """Raise unless the (start, length) chunks cover rows [0, span) exactly once."""
    pos = 0
    for start, length in sorted(chunks):
        if start > pos:
            raise CheckpointError(f"{what}: rows [{pos}, {start}) of {span} are in no chunk (missing data)")
        if start < pos:
            raise CheckpointError(f"{what}: rows [{start}, {min(pos, start + length)}) are stored twice")
        pos = start + length
    if pos != span:
        raise CheckpointError(f"{what}: chunks cover rows [0, {pos}) but the tensor has {span} rows")


def plan_reads(chunks: Sequence[tuple[int, int]], spec: ShardSpec, *, what: str = "tensor") -> list[Read]:
    """The reads that build `spec`'s local tensor (before padding) from the stored chunks."""
    if spec.dim is None:
        raise ValueError("plan_reads needs a sharded spec; read a replicated tensor whole")
    order = sorted(range(len(chunks)), key=lambda i: chunks[i][0])
    reads, local = [], 0
    for start, length in spec.pieces:
        pos, end = start, start + length
        for i in order:
            c_start, c_len = chunks[i]
            a, b = max(pos, c_start), min(end, c_start + c_len)
            if b <= a:
                continue
            if a > pos:
                raise CheckpointError(f"{what}: rows [{pos}, {a}) needed by this rank are in no chunk")
            reads.append(Read(i, a - c_start, local + a - start, b - a))
            pos = b
        if pos < end:
            raise CheckpointError(f"{what}: rows [{pos}, {end}) needed by this rank are in no chunk")
        local += length
    return reads


def assemble(
    spec: ShardSpec, dtype: torch.dtype, reads: list[Read], fetch: Callable[[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """The local tensor: fetch(chunk, src_start, length) for each read, then zero padding rows.

    Holds only the result and one fetched slice at a time.
    """
    out = torch.zeros(spec.local_shape, dtype=dtype)  # padding rows stay zero
    for r in reads:
        out.narrow(spec.dim, r.dst_start, r.length).copy_(fetch(r.chunk, r.src_start, r.length))
    return out


def assemble_any(
    spec: ShardSpec,
    dtype: torch.dtype,
    chunks: Sequence[tuple[int, int]],
    stored_dim: int | None,
    fetch: Callable[[int, int, int], torch.Tensor],
    fetch_whole: Callable[[int], torch.Tensor],
    *,
    what: str,
) -> torch.Tensor:
    """The local tensor for `spec` from chunks split along `stored_dim` (which may differ from
    spec.dim, or be None): partial reads when they agree, the whole tensor otherwise."""
    if spec.dim is not None and spec.dim == stored_dim:
        return assemble(spec, dtype, plan_reads(chunks, spec, what=what), fetch)
    if stored_dim is None:
        if len(chunks) != 1:
            raise CheckpointError(f"{what}: an unsplit tensor must be one chunk, found {len(chunks)}")
        full = fetch_whole(0)
    else:
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][0])
        full = torch.cat([fetch_whole(i) for i in order], dim=stored_dim)
    if tuple(full.shape) != spec.global_shape:
        raise CheckpointError(f"{what}: stored shape {tuple(full.shape)} != expected {spec.global_shape}")
    return spec.take(full).to(dtype)
