"""Serving at pp > 1 with up to pp micro-batches in flight: one "tick" per step on every rank.

At each tick every stage works on a different item (a step's batch, or a bubble):

    stage 0      (all its tp ranks) the item rank 0 picked (tp broadcast) -> its layers ->
                 send to stage 1; rank 0 then receives the logits of the item it sent pp - 1
                 ticks ago from the last stage's tp rank 0
    stage s > 0  receive the next item from stage s - 1, hand the item it computed last tick
                 to stage s + 1 (the last stage: its logits to rank 0), then compute the new one

so stage s works on item k while stage s + 1 works on item k - 1. Receives are posted
before sends along the chain (stage 0 sends, then receives), so blocking point-to-point
messages cannot deadlock. Rank 0 schedules only sequences that are not in flight: with
enough running sequences they form up to pp groups, one per stage. A bubble (no work) is a
header alone; an idle server sends bubbles every heartbeat, so a dead or stuck rank shows
as a failed or timed-out receive within the collective timeout.

An item on the wire: header (4 + pp,) int64 [kind, B, T, payload length, busy_us of each
stage], then for a step the payload of step.encode and the hidden states (B, T, hidden)
(to rank 0: the logits (B, V) instead). Each stage writes its cumulative busy time
(microseconds of compute) into the header as the item passes, so rank 0 learns every
stage's idle fraction without another message.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from shardwise.engine.slots import StepBatch
from shardwise.serve.step import HEADER_LEN, Kind, decode, encode

__all__ = ["PipelineTicks"]


class PipelineTicks:
    """This rank's part of the pipelined serve loop (see the module docstring)."""

    def __init__(self, engine, fault) -> None:
        mesh = engine.stages.mesh
        self.engine, self.fault = engine, fault
        self.model, self.caches, self.device = engine.model, engine.caches, engine.device
        self.tp, self.pp, self.P, self.s = engine.tp, mesh.pp, mesh.dims.pp, mesh.pp_rank
        self.hidden, self.dtype, self.vocab = engine.stages.hidden_size, engine.stages.dtype, self.model.cfg.vocab_size
        self.last = self.s == self.P - 1
        self.busy_s = 0.0
        self.prev = self._bubble(), None, None  # (header, payload, output) computed last tick

    def _bubble(self) -> torch.Tensor:
        return torch.zeros(HEADER_LEN + self.P, dtype=torch.long, device=self.device)

    def _compute(self, header: torch.Tensor, payload, hidden) -> torch.Tensor | None:
        if int(header[0]) != Kind.STEP:
            return None
        self.fault.step()
        t0 = time.perf_counter()
        out = self.caches.stage_step(self.model, decode(header[:HEADER_LEN], payload), hidden, last=self.last)
        self.busy_s += time.perf_counter() - t0
        return out

    def _send(self, header, payload, out, dst: int) -> None:
        header = header.clone()
        header[HEADER_LEN + self.s] = int(self.busy_s * 1e6)
        self.pp.send(header, dst)
        if int(header[0]) == Kind.STEP:
            if dst != 0 or self.s == 0:  # logits go to rank 0 alone; the payload is rank 0's own
                self.pp.send(payload, dst)
            self.pp.send(out.contiguous(), dst)

    def _recv(self, src: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        header = self.pp.recv((HEADER_LEN + self.P,), torch.long, src, device=self.device)
        if int(header[0]) != Kind.STEP:
            return header, None, None
        B, T, n = (int(x) for x in header[1:4])
        payload = self.pp.recv((n,), torch.long, src, device=self.device)
        hidden = self.pp.recv((B, T, self.hidden), self.dtype, src, device=self.device)
        return header, payload, hidden

    # ---- stage 0 ------------------------------------------------------------------------
    def lead_tick(self, batch: StepBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank 0: run `batch` (None: a bubble) through stage 0 and hand it on -> (the header of
        the item that left the last stage this tick, its logits (B, V) or None for a bubble)."""
        if batch is None:
            header, payload = self._bubble(), None
        else:
            h, payload = encode(batch)
            header = torch.cat([h, torch.zeros(self.P, dtype=torch.long, device=h.device)])
        return self._stage0(header, payload)

    def _stage0(self, header: torch.Tensor, payload):
        header = self.tp.broadcast(header, src=0)
        if int(header[0]) == Kind.STEP:
            payload = self.tp.broadcast(
                payload if payload is not None else torch.empty(int(header[3]), dtype=torch.long, device=self.device),
                src=0,
            )
        out = self._compute(header, payload, None)
        self._send(header, payload, out, 1)
        if self.engine.world.rank != 0:
            return None, None
        back = self.pp.recv((HEADER_LEN + self.P,), torch.long, self.P - 1, device=self.device)
        if int(back[0]) != Kind.STEP:
            return back, None
        return back, self.pp.recv((int(back[1]), self.vocab), self.dtype, self.P - 1, device=self.device)

    # ---- ranks other than 0 -------------------------------------------------------------
    def follow(self) -> None:
        """Every rank but 0: tick forever (the launcher ends the job)."""
        while True:
            if self.s == 0:
                self._stage0(self._bubble(), None)
                continue
            item = self._recv(self.s - 1)
            if not self.last:
                self._send(*self.prev, self.s + 1)
            elif self.tp.rank == 0:
                self._send(*self.prev, 0)
            self.prev = item[0], item[1], self._compute(*item)


class InFlight:
    """Rank 0's record of the items in the pipe (their rows; None for bubbles), oldest first."""

    def __init__(self, depth: int) -> None:
        self.items: deque[list | None] = deque([None] * depth)

    def busy(self) -> frozenset[int]:
        return frozenset(seq.id for rows in self.items if rows for seq in rows)

    def empty(self) -> bool:
        return all(rows is None for rows in self.items)

    def push(self, rows: list | None) -> list | None:
        """Add this tick's item; -> the rows of the item that came out of the pipe."""
        self.items.append(rows)
        return self.items.popleft()
