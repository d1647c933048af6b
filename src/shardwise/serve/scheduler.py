"""Continuous batching on rank 0: a queue of requests, a fixed set of KV-cache slots.

At every token boundary (between two steps) the scheduler

1. frees the slots of sequences that finished, or whose client left or hit a stop string;
2. admits waiting requests into free slots, oldest first, while the padded prefill
   (rows x longest prompt) stays within `max_step_tokens` (always at least one);
3. builds the next StepBatch: a prefill step of the admitted prompts when there are
   any, else a decode step of every running sequence (its last sampled token).

With a paged KV cache (`blocks`: engine/paged.BlockTables) a sequence holds blocks;
a prompt that starts with blocks already cached (prefix caching) shares them and feeds
only the rest. A sequence is admitted while the pool has the blocks of its prompt (and fewer
than num_slots sequences run); before a decode step every row is given the block its next
token needs, and when the pool has none left the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue with every token it has seen,
to be prefilled again (recomputation; the tokens it already delivered are not resampled).
When every layer attends within a sliding window, the blocks a sequence's window has left
go back to the pool after each step (BlockTables.drop_behind_window).
Each step carries its rows' block tables to every rank.

NOTE: prefill and decode rows are never mixed in one step: a step pads every row to
its longest row, so one 500-token prompt would make each 1-token decode row cost 500.
Running sequences wait one step while new ones are prefilled.

After the step it samples each row's next token with that request's own sampling
parameters and random generator, and hands each request its Output. The HTTP thread
only calls submit() and cancel(); everything else runs in the engine thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardwise.engine.paged import BlockTables
from shardwise.engine.sampling import SamplingParams, sample
from shardwise.engine.slots import StepBatch
from shardwise.serve.metrics import Metrics

__all__ = ["Output", "Sequence", "Scheduler", "QueueFull", "EngineDown"]

_ids = itertools.count()


class QueueFull(RuntimeError):
    """--max-queue requests are already waiting."""


class EngineDown(RuntimeError):
    """The engine failed; no request can be served any more."""


@dataclass(frozen=True)
class Output:
    """What one step tells one request: a token, a finish reason, or an error."""

    token: int | None = None
    finish: str | None = None
    """"stop" (a stop token; the token itself is not returned) or "length" (max_tokens)."""
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """One request as the engine sees it: token ids in, token ids out."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    on_output: Callable[[Output], None]
    """Called from the engine thread; must be quick and thread-safe."""
    id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    cached: int = 0
    """Tokens of this sequence in its slot's cache."""
    feed: list[int] = field(default_factory=list)
    """Tokens to feed at the next step: the prompt, then the last sampled token."""
    generated: int = 0
    last_step: int = -1
    """The scheduler's step count when this sequence last stepped (pp > 1: the longest waiting go first)."""
    generator: torch.Generator | None = None
    seen: list[int] = field(default_factory=list)
    """Tokens already in the cache, in order (paged: what a preempted sequence feeds again)."""
    preempted: int = 0
    done: bool = False
    """It finished, or its client left: the slot is freed at the next boundary."""


class Scheduler:
    def __init__(
        self,
        *,
        num_slots: int,
        max_queue: int,
        metrics: Metrics,
        max_step_tokens: int = 2048,
        stale_s: float = 3.0,
        blocks: BlockTables | None = None,
    ) -> None:
        self.cond = threading.Condition()
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot (paged: sequence id) -> sequence, oldest first
        self.free = list(range(num_slots))  # paged: tokens for the count of sequences that may run
        self.blocks = blocks
        self.max_queue, self.max_step_tokens, self.stale_s = max_queue, max_step_tokens, stale_s
        self.metrics = metrics
        self.failed: str | None = None
        self.last_beat = time.monotonic()
        self._rows: list[Sequence] = []  # the rows of the step in flight
        self.steps = 0

    # ---- the HTTP thread ----------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a validated request; raises QueueFull or EngineDown at once."""
        with self.cond:
            if self.failed is not None:
                raise EngineDown(self.failed)
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queue {self.max_queue})")
            seq.feed = list(seq.prompt)
            self.waiting.append(seq)
            self.metrics.queue_depth = len(self.waiting)
            self.cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client left or the text hit a stop string: free the slot at the next boundary."""
        with self.cond:
            seq.done = True
            if seq in self.waiting:
                self.waiting.remove(seq)
                self.metrics.queue_depth = len(self.waiting)

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): every rank completed a step or heartbeat within stale_s."""
        if self.failed is not None:
            return False, self.failed
        age = time.monotonic() - self.last_beat
        if age > self.stale_s:
            return False, f"no step completed for {age:.1f}s (a rank is stuck or slow)"
        return True, "ok"

    # ---- the engine thread --------------------------------------------------------------
    def wait_for_work(self, timeout: float) -> bool:
        with self.cond:
            if not (self.waiting or self.running):
                self.cond.wait(timeout)
            return bool(self.waiting or self.running)

    def next_batch(self, device=None, busy: frozenset[int] = frozenset(), groups: int = 1) -> StepBatch | None:
        """Free, admit, and build the next step (None when nothing runs). pp > 1: busy are the
        ids of sequences in a step still in flight (they neither step nor free their slot), and
        a decode step takes at most 1/groups of the running sequences, the longest waiting
        first, so that the groups in flight even out."""
        with self.cond:
            for slot, seq in list(self.running.items()):
                if seq.done and seq.id not in busy:
                    del self.running[slot]
                    self._free_seat(seq)
            admitted: list[Sequence] = []
            longest = 0
            while self.waiting and self.free:
                n = len(self.waiting[0].feed)
                if admitted and (len(admitted) + 1) * max(longest, n) > self.max_step_tokens:
                    break
                if self.blocks is not None and self.blocks.missing({self.waiting[0].id: n}) > self.blocks.pool.num_free:
                    break  # the oldest waits for blocks; nobody overtakes it
                seq = self.waiting.popleft()
                self._seat(seq, n)
                if not seq.preempted:
                    seq.generator = None if seq.sampling.greedy else seq.sampling.generator()
                    self.metrics.prompt_tokens += n
                admitted.append(seq)
                longest = max(longest, n)
            self._rows = admitted
            if not admitted:
                live = [s for s in self.running.values() if not s.done]
                ready = sorted((s for s in live if s.id not in busy), key=lambda s: s.last_step)
                self._rows = self._fit(ready[: -(-len(live) // groups)], busy)  # ceil(live / groups)
            self.metrics.queue_depth, self.metrics.running = len(self.waiting), len(self.running)
            if self.blocks is not None:
                self.metrics.blocks_free = self.blocks.pool.num_free
            self.steps += 1
            for seq in self._rows:
                seq.last_step = self.steps
        if not self._rows:
            return None
        rows = [(s.slot, s.cached, s.feed) for s in self._rows]
        tables = None if self.blocks is None else self.blocks.rows([s.id for s in self._rows])
        return StepBatch.build(rows, device=device, tables=tables)

    def _seat(self, seq: Sequence, n: int) -> None:
        """Admit `seq` (its next n tokens fed): a slot, or (paged) blocks for them."""
        if self.blocks is None:
            seq.slot = self.free.pop(0)
        else:
            self.free.pop(0)
            seq.slot = seq.id
            hit = self.blocks.share_prefix(seq.id, seq.feed) if seq.cached == 0 else 0
            if hit:  # those positions are cached already: feed only the rest
                seq.seen, seq.feed, seq.cached = seq.feed[:hit], seq.feed[hit:], hit
                self.metrics.prefix_hit_tokens += hit
            self.blocks.reserve({seq.id: seq.cached + len(seq.feed)})
        self.running[seq.slot] = seq

    def _free_seat(self, seq: Sequence) -> None:
        self.free.append(seq.slot if self.blocks is None else 0)
        if self.blocks is not None:
            self.blocks.release([seq.id])

    def _fit(self, rows: list[Sequence], busy: frozenset[int]) -> list[Sequence]:
        """Paged: give every decode row the blocks of its next token, preempting the newest
        running sequences (not in flight) while the pool is short; the rows that remain."""
        if self.blocks is None:
            return rows
        while rows:
            need = {s.id: s.cached + len(s.feed) for s in rows}
            if self.blocks.missing(need) <= self.blocks.pool.num_free:
                self.blocks.reserve(need)
                return rows
            victims = [s for s in reversed(self.running.values()) if s.id not in busy and not s.done]
            if not victims:
                return []  # every other holder is in flight (pp > 1): this step waits for them
            if len(self.blocks.tables) <= 1:  # NOTE: the server sizes the pool for one longest sequence
                raise RuntimeError(
                    f"the KV pool ({self.blocks.pool.num_blocks} blocks of {self.blocks.block_size}) cannot hold "
                    f"one sequence of {max(need.values())} tokens"
                )
            victim = victims[0]
            del self.running[victim.slot]
            self._free_seat(victim)
            victim.feed = victim.seen + victim.feed  # everything it has seen, fed again
            victim.seen, victim.cached, victim.preempted = [], 0, victim.preempted + 1
            self.waiting.appendleft(victim)
            self.metrics.preemptions += 1
            rows = [s for s in rows if s is not victim]
        return rows

    def rows(self) -> list[Sequence]:
        """The sequences of the step next_batch just built, in row order."""
        return list(self._rows)

    def finish_step(self, logits: torch.Tensor, rows: list[Sequence] | None = None) -> int:
        """logits: (B, V) of the step built by next_batch (or of the step of `rows`, built
        earlier: pp > 1), or the step's tokens (B,) when every row is greedy and they were
        chosen already (engine.argmax) -> number of new tokens delivered."""
        chosen = logits.dim() == 1
        tokens = (logits if chosen else logits.argmax(dim=-1)).tolist()  # greedy rows; sampled replaced below
        delivered = 0
        with self.cond:
            for b, seq in enumerate(self._rows if rows is None else rows):
                if not seq.sampling.greedy:
                    if chosen:
                        raise RuntimeError(f"sequence {seq.id} samples, but its step's tokens were chosen greedily")
                    row = logits[b : b + 1].float().cpu()  # (1, V): the generator lives on the CPU
                    tokens[b] = int(sample(row, seq.sampling, seq.generator)[0])
                seq.cached += len(seq.feed)
                if self.blocks is not None:
                    seq.seen += seq.feed
                    self.blocks.cache_prefix(seq.id, seq.seen)
                    self.blocks.drop_behind_window(seq.id, seq.cached)  # a sliding window's old blocks
                seq.feed = [tokens[b]]
                if seq.done:
                    continue
                if tokens[b] in seq.stop_ids:
                    out = Output(finish="stop")
                else:
                    seq.generated += 1
                    delivered += 1
                    out = Output(token=tokens[b], finish="length" if seq.generated >= seq.max_tokens else None)
                if out.finish is not None:
                    seq.done = True
                seq.on_output(out)
            if rows is None:
                self._rows = []
            self.last_beat = time.monotonic()
        return delivered

    def beat(self) -> None:
        """An idle heartbeat completed on every rank."""
        self.last_beat = time.monotonic()

    def fail(self, message: str) -> None:
        """The engine stopped: every queued and running request gets an error; new ones are refused."""
        with self.cond:
            self.failed = message
            victims = [*self.waiting, *self.running.values()]
            self.waiting.clear()
            self.running.clear()
            self.metrics.queue_depth = self.metrics.running = 0
        for seq in victims:
            if not seq.done:
                seq.on_output(Output(error=message))
