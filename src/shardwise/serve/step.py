"""The step message: what rank 0 broadcasts so that every rank runs the same step.

Two broadcasts of int64 tensors per step, a fixed-size header then the payload:

    header   (5,)                 [kind, B, T, payload length, W]
    payload  (3B + B*T + B*W,)    [slots (B) | past (B) | n_new (B) | ids (B*T) | tables (B*W)]

W is the width of the rows' block tables (paged KV cache; slots are then sequence ids), 0
for the slot cache.

A NOOP step (idle heartbeat) has no payload; every rank then joins a barrier, so a
dead or stuck rank is noticed even when no request is running. STOP ends the workers'
loop. Only token ids and slot bookkeeping travel: sampling happens on rank 0, and the
sampled token reaches the other ranks as an input id of the next step. A GREEDY_STEP (every
row greedy) is a STEP whose tokens every rank chooses alike from one all-gather of each
rank's best (shardwise.engine.argmax), its logits never gathered.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from shardwise.comm import Communicator
from shardwise.engine.slots import StepBatch

__all__ = ["Kind", "HEADER_LEN", "encode", "decode", "send_step", "recv_step"]

HEADER_LEN = 5


class Kind(IntEnum):
    NOOP = 0
    STEP = 1
    STOP = 2
    GREEDY_STEP = 3
    """A STEP whose rows all decode greedily: every rank takes its vocabulary shard's best and
    one all-gather chooses the tokens (shardwise.engine.argmax), no logits gathered."""


def encode(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A step -> (header (5,), payload (3B + B*T + B*W,))."""
    B, T = batch.ids.shape
    parts = [batch.slots, batch.past, batch.n_new, batch.ids.reshape(-1)]
    W = 0
    if batch.tables is not None:
        W = batch.tables.shape[1]
        parts.append(batch.tables.reshape(-1))
    payload = torch.cat(parts)
    kind = Kind.GREEDY_STEP if batch.greedy else Kind.STEP
    header = torch.tensor([kind, B, T, payload.numel(), W], dtype=torch.long, device=payload.device)
    return header, payload


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepBatch:
    """The inverse of encode."""
    kind, B, T, n, W = (int(x) for x in header[:HEADER_LEN].tolist())
    if payload.numel() != n or n != 3 * B + B * T + B * W:
        raise ValueError(f"step payload of {payload.numel()} ints does not match its header {header.tolist()}")
    slots, past, n_new, ids, tables = payload.split([B, B, B, B * T, B * W])
    return StepBatch(slots=slots, past=past, n_new=n_new, ids=ids.view(B, T), tables=tables.view(B, W) if W else None,
                     greedy=kind == Kind.GREEDY_STEP)  # fmt: skip


def send_step(comm: Communicator, kind: Kind, batch: StepBatch | None = None, device=None) -> None:
    """Rank 0: broadcast one step (a STEP carries its batch)."""
    if kind in (Kind.STEP, Kind.GREEDY_STEP):
        if batch is None:
            raise ValueError("a STEP needs its batch")
        header, payload = encode(batch)
        comm.broadcast(header, src=0)
        comm.broadcast(payload, src=0)
    else:
        comm.broadcast(torch.tensor([kind, 0, 0, 0, 0], dtype=torch.long, device=device), src=0)


def recv_step(comm: Communicator, device=None) -> tuple[Kind, StepBatch | None]:
    """Other ranks: receive the next step."""
    header = comm.broadcast(torch.empty(HEADER_LEN, dtype=torch.long, device=device), src=0)
    kind = Kind(int(header[0]))
    if kind not in (Kind.STEP, Kind.GREEDY_STEP):
        return kind, None
    payload = comm.broadcast(torch.empty(int(header[3]), dtype=torch.long, device=device), src=0)
    return kind, decode(header, payload)
