"""How many KV blocks a serving rank's pool gets: a memory budget, as bytes or as a fraction.

    --kv-cache-memory SIZE       that many bytes of pool on each rank (2GiB, 512MiB)
    --kv-cache-memory FRACTION   0 < f <= 1 (default 0.9): f of the memory one rank may use
                                 (on CPU the host's room, its cgroup's or MemAvailable, over the
                                 host's ranks; on CUDA the device's free memory), less what the
                                 rank holds besides the pool (runtime, weights, one prefill's
                                 activations), and no more than --max-batch-size sequences of
                                 --max-model-len tokens can ever fill

As vLLM's --gpu-memory-utilization: the pool takes what the budget leaves after the weights,
so a model's long context costs nothing until it is used, and the default never reserves the
worst case of every sequence at full length unless the memory is there. The cap keeps a
CPU host, shared with other processes, from handing a small model most of its memory.

The pool is sized twice with the same arithmetic (`KVBudget.blocks`):
  - before any rank starts (cli/serve.py), from the weights the config predicts, so that a
    --max-model-len the pool cannot hold is refused in one line naming the longest that fits;
  - on every rank once its weights are loaded (serve/worker.py), from the bytes it holds;
    the ranks take the smallest count, since every rank's pool holds the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm import Communicator
from shardwise.engine.paged import BLOCK_SIZE, PagedCaches, blocks_for
from shardwise.memory import fmt_bytes, parse_size
from shardwise.planner.fit import RUNTIME_BYTES

__all__ = ["DEFAULT_FRACTION", "KVBudget", "BudgetTooSmall", "size_pool"]

DEFAULT_FRACTION = 0.9


class BudgetTooSmall(ValueError):
    """The pool cannot hold one sequence of max_model_len tokens (the message names the longest that can)."""


def _size(n: float) -> str:
    return fmt_bytes(n) if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class KVBudget:
    """A rank's KV budget: `bytes`, or `fraction` of `room` (bytes one rank may use; None when
    the host says nothing), at most `cap_blocks` blocks."""

    text: str
    """As the user gave it (for messages)."""
    bytes: int | None = None
    fraction: float | None = None
    room: float | None = None
    room_source: str = ""
    cap_blocks: int | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("a KV budget is bytes or a fraction, one of them")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"a fraction must be in (0, 1], got {self.fraction:g}")

    @classmethod
    def parse(cls, text: str | None, **kw) -> KVBudget:
        """ "2GiB" -> bytes; "0.5" -> a fraction; None -> the default fraction. ValueError otherwise."""
        text = text if text is not None else str(DEFAULT_FRACTION)
        try:
            value = float(text)
        except ValueError:
            return cls(text, bytes=parse_size(text), **kw)
        if value <= 1:
            if value <= 0:
                raise ValueError(f"a fraction must be in (0, 1], got {text}")
            return cls(text, fraction=value, **kw)
        if not value.is_integer():
            raise ValueError(f"a fraction must be in (0, 1], got {text}")
        return cls(text, bytes=parse_size(text), **kw)  # a whole number over 1: bytes

    def pool_bytes(self, other: float) -> float:
        """Bytes the pool may take on a rank that holds `other` bytes besides it (fraction only
        uses it); inf for a fraction of a room the host did not say."""
        if self.bytes is not None:
            return float(self.bytes)
        if self.room is None:
            return float("inf")
        return max(0.0, self.fraction * self.room - other)

    def blocks(self, per_block: int, other: float) -> int:
        """Blocks of `per_block` bytes (this rank's keys and values of one block, every layer it
        holds) the pool gets on a rank holding `other` bytes besides it."""
        room = self.pool_bytes(other)
        cap = self.cap_blocks if self.bytes is None and self.cap_blocks is not None else None
        if room == float("inf"):
            if cap is None:
                raise ValueError("a fractional KV budget needs the host's room or a cap")
            return cap
        n = int(room // per_block)
        return n if cap is None else min(n, cap)

    def describe(self, other: float) -> str:
        """ "--kv-cache-memory 64KiB" or "--kv-cache-memory 0.9 of 11.2 GiB per rank (MemAvailable),
        less 1.3 GiB of weights, runtime and activations," for messages."""
        if self.bytes is not None:
            return f"--kv-cache-memory {self.text}"
        if self.room is None:
            return f"--kv-cache-memory {self.text} (the host's memory unknown: capped at --max-batch-size x --max-model-len)"
        return (
            f"--kv-cache-memory {self.text} of {fmt_bytes(self.room)} per rank ({self.room_source}), less "
            f"{fmt_bytes(other)} of runtime, weights and activations,"
        )

    def summary(self) -> str:
        """The budget in words, for the start-up log."""
        if self.bytes is not None:
            return f"--kv-cache-memory {self.text} per rank"
        cap = f", at most {self.cap_blocks} blocks (--max-batch-size x --max-model-len)" if self.cap_blocks else ""
        if self.room is None:
            return f"--kv-cache-memory {self.text} of an unknown room{cap}"
        return (
            f"--kv-cache-memory {self.text} of {fmt_bytes(self.room)} per rank ({self.room_source}) less runtime, "
            f"weights and activations{cap}"
        )

    def check(self, blocks: int, per_block: int, other: float, max_model_len: int, tp: int) -> None:
        """BudgetTooSmall when `blocks` cannot hold one sequence of max_model_len tokens."""
        need = blocks_for(max_model_len)
        if blocks >= need:
            return
        longest = blocks * BLOCK_SIZE
        fits = (
            f"the longest sequence that fits is {longest} tokens (--max-model-len {longest})"
            if longest
            else "not one block fits"
        )
        raise BudgetTooSmall(
            f"--max-model-len {max_model_len} needs {need} KV blocks of {BLOCK_SIZE} tokens "
            f"({_size(need * per_block)} per rank at tp={tp}); {self.describe(other)} holds {blocks} "
            f"({_size(per_block)} each): {fits}"
        )


def size_pool(
    world: Communicator,
    model,
    param_bytes: int,
    budget: KVBudget,
    activation_bytes: float,
    max_model_len: int,
    tp: int,
) -> tuple[torch.Tensor, int]:
    """The pool's blocks on a rank whose weights are loaded: each rank from the bytes it holds
    (runtime, `param_bytes`, one prefill's activations), every rank of `world` the smallest count
    -> ((ranks, 4) weights, other bytes, blocks it could hold, bytes per block; blocks).
    BudgetTooSmall (every rank alike) when the pool cannot hold one max_model_len sequence."""
    per_block = PagedCaches.bytes_per_block(model)
    other = RUNTIME_BYTES + param_bytes + activation_bytes
    device = next(model.parameters()).device
    mine = torch.tensor([[param_bytes, other, budget.blocks(per_block, other), per_block]], dtype=torch.float64)
    sizes = world.all_gather(mine.to(device), dim=0).cpu()  # (ranks, 4)
    worst = int(sizes[:, 2].argmin())
    blocks = int(sizes[worst, 2])
    budget.check(blocks, int(sizes[worst, 3]), float(sizes[worst, 1]), max_model_len, tp)
    return sizes, blocks
