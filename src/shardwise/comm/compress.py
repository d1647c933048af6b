"""Compressed all-reduce for slow links: the payload on the wire is bf16, or 8-bit blocks.

    out = compressed_all_reduce(x, comm, "q8")   # x's sum over the group, in x's dtype

Done as a reduce-scatter plus an all-gather (the ring all-reduce's two halves), each partial
quantized once:

    x (n,) fp32, padded to size * c  ->  size chunks of c
    1. each rank encodes its chunks and all_to_all's them: rank j receives everyone's chunk j
    2. rank j decodes them and sums in fp32 (its own chunk exact: it never travels) -> s_j
    3. rank j encodes s_j once; all_gather; every rank decodes every s_j -> out

Every rank decodes the same bytes, so every rank gets the same result (a tensor-parallel
group's replicas stay bitwise equal). Wire formats (`WIRES`):

- "bf16": each value as bfloat16, 2 bytes (fp32's 4).
- "q8": blocks of 32 values with one scale, like llama.cpp's Q8_0: d = amax / 127,
  q = round(x / d) in [-127, 127]; 36 bytes per 32 values (the scale kept in fp32, so no
  block's scale underflows or overflows as fp16's would): 1.125 bytes a value. A chunk is
  its scales, then its values (two runs, so that each side is one tensor operation).

The error bound (`error_bound`), for element i of block b, with x_r rank r's input:
quantizing a block costs at most d/2 = amax/254 per element (q8) or |v| * 2**-8 (bf16's
round-to-nearest to 8 significant bits), so

    |out_i - sum_r x_r,i|  <=  sum_{r != owner} e(x_r, b)  +  e(s, b)

where e(v, b) = amax_b(|v|) / 254 for q8 and |v_i| * 2**-8 for bf16, `owner` the rank whose
chunk holds block b (its own partial is exact) and s the reduced chunk before its encoding.
With every input's amax <= A: at most about (size - 1) * A/254 + size * A/254, i.e.
~ 2 * size * A / 254 for q8; the fp32 all-reduce's own rounding is far below it.

NOTE: only sums, of floating-point tensors; a non-finite input makes its block NaN (q8).
"""

from __future__ import annotations

import torch

from shardwise.comm.communicator import Communicator

__all__ = ["WIRES", "BLOCK", "compressed_all_reduce", "encode", "decode", "wire_bytes", "error_bound"]

WIRES = ("fp32", "bf16", "q8")
"""The wire formats of a tensor-parallel group's all-reduce: fp32 (exact, the default)."""
BLOCK = 32
"""Values per q8 block (one fp32 scale each)."""
_Q8_ROW = 4 + BLOCK  # bytes per block: the scale, then 32 int8
_TINY = torch.finfo(torch.float32).tiny
_BF16_EPS = 2.0**-8  # bf16 round-to-nearest: 8 significant bits, relative error <= 2**-8


def _check(wire: str) -> None:
    if wire not in WIRES:
        raise ValueError(f"comm dtype {wire!r} is not one of {', '.join(WIRES)}")


def chunk_len(n: int, size: int, wire: str) -> int:
    """Elements per rank's chunk: n / size rounded up (to whole blocks for q8)."""
    per = -(-n // size)
    return -(-per // BLOCK) * BLOCK if wire == "q8" else per


def wire_bytes(n: int, wire: str) -> int:
    """Bytes that encode n values (n a multiple of BLOCK for q8)."""
    _check(wire)
    if wire == "q8":
        return n // BLOCK * _Q8_ROW
    return n * (2 if wire == "bf16" else 4)


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """(rows, c) fp32 -> (rows, wire_bytes(c)) uint8. q8: each row holds its c / 32 fp32
    scales, then its c int8 values (c a multiple of BLOCK)."""
    rows, c = x.shape
    if wire == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    if wire == "fp32":
        return x.contiguous().view(torch.uint8)
    blocks = x.reshape(rows, c // BLOCK, BLOCK)  # (rows, nb, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True).div_(127)  # (rows, nb, 1)
    # NOTE: no clamp to [-127, 127] needed: |x| / (amax / 127) rounds to at most 127; an
    # all-zero block divides by the smallest normal float and stays 0
    q = blocks.div(d.clamp(min=_TINY)).round_().to(torch.int8)  # (rows, nb, 32)
    return torch.cat([d.view(rows, -1).view(torch.uint8), q.view(rows, c).view(torch.uint8)], dim=1)


def decode(raw: torch.Tensor, wire: str) -> torch.Tensor:
    """encode's inverse: (rows, wire bytes) uint8 -> (rows, c) fp32."""
    rows = raw.shape[0]
    if wire == "bf16":
        return raw.view(torch.bfloat16).float()
    if wire == "fp32":
        return raw.view(torch.float32)
    nb = raw.shape[1] // _Q8_ROW
    d = raw[:, : 4 * nb].view(torch.float32)  # (rows, nb)
    q = raw[:, 4 * nb :].view(torch.int8).view(rows, nb, BLOCK)  # (rows, nb, 32)
    return (q * d.unsqueeze(-1)).view(rows, -1)  # int8 * fp32 -> fp32


def compressed_all_reduce(x: torch.Tensor, comm: Communicator, wire: str) -> torch.Tensor:
    """The sum of x over the group with `wire` on the wire (a new tensor, x's shape and dtype).

    Two collectives on `comm`: an all_to_all (size chunks of wire_bytes(c) each) and an
    all_gather (one chunk): counted as those in comm.stats, with the bytes that travel."""
    _check(wire)
    if comm.size == 1:
        return x
    if wire == "fp32":
        return comm.all_reduce(x)
    if not x.is_floating_point():
        raise TypeError(f"compressed all-reduce ({wire}) sums floating-point tensors, got {x.dtype}")
    n, p = x.numel(), comm.size
    c = chunk_len(n, p, wire)
    flat = x.detach().reshape(-1).float()
    if p * c != n:
        flat = torch.cat([flat, flat.new_zeros(p * c - n)])
    chunks = flat.view(p, c)  # (size, c): row j is rank j's to reduce
    got = comm.all_to_all(encode(chunks, wire), [1] * p, [1] * p)  # (size, bytes): everyone's chunk `rank`
    parts = decode(got, wire)  # (size, c)
    parts[comm.rank] = chunks[comm.rank]  # this rank's own partial never travelled: exact
    mine = parts.sum(dim=0, keepdim=True)  # (1, c), the reduced chunk s_rank
    every = comm.all_gather(encode(mine, wire).reshape(-1), dim=0)  # (size * bytes,)
    out = decode(every.view(p, -1), wire).reshape(-1)[:n]  # (n,)
    return out.view(x.shape).to(x.dtype)


def error_bound(inputs: list[torch.Tensor], wire: str) -> torch.Tensor:
    """The bound on |compressed_all_reduce - exact sum| per element (derived in the module
    docstring), from every rank's input (same shape): what the tests hold the result to."""
    _check(wire)
    p, n = len(inputs), inputs[0].numel()
    if wire == "fp32" or p == 1:
        return torch.zeros(inputs[0].shape)
    c = chunk_len(n, p, wire)
    xs = torch.stack([t.reshape(-1).float() for t in inputs])  # (p, n)
    xs = torch.cat([xs, xs.new_zeros(p, p * c - n)], dim=1).view(p, p, c)  # (rank, owner, c)
    exact = xs.sum(dim=0)  # (owner, c)
    if wire == "bf16":
        per_rank = xs.abs() * _BF16_EPS  # (rank, owner, c)
        # the reduced chunk is bf16-rounded once; it is at most |exact| + the partials' error
        tail = (exact.abs() + per_rank.sum(dim=0)) * _BF16_EPS
    else:
        amax = xs.view(p, p, c // BLOCK, BLOCK).abs().amax(dim=-1, keepdim=True) / 254  # (rank, owner, nb, 1)
        per_rank = amax.expand(p, p, c // BLOCK, BLOCK).reshape(p, p, c)
        s_amax = exact.view(p, c // BLOCK, BLOCK).abs().amax(dim=-1, keepdim=True)
        s_amax = s_amax + per_rank.sum(dim=0).view(p, c // BLOCK, BLOCK).amax(dim=-1, keepdim=True)
        tail = (s_amax / 254).expand(p, c // BLOCK, BLOCK).reshape(p, c)
    own = torch.zeros(p, p, 1)
    own[torch.arange(p), torch.arange(p)] = 1  # the owner's partial is exact
    bound = (per_rank * (1 - own)).sum(dim=0) + tail  # (owner, c)
    return bound.reshape(-1)[:n].view(inputs[0].shape)
