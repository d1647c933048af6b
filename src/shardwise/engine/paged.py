"""A paged KV cache: fixed-size blocks from one pool per rank, a block table per sequence.

The slot cache (engine/slots.py) reserves max_len positions for every slot before the
first request. Here a rank holds one pool of blocks per layer, each block BLOCK_SIZE
positions of this rank's KV heads, and a sequence takes blocks only as it grows:

    pool (per layer)   k, v: (num_blocks, BLOCK_SIZE, local KV heads, head_dim)
    block table        sequence id -> [block, block, ...]; position p of the sequence
                       lives in block table[p // BLOCK_SIZE], row p % BLOCK_SIZE

Block ids are the same in every layer (one table serves them all) and on every rank (each
rank's pool holds its own KV heads of the same blocks): BlockTables lives on rank 0 with
the scheduler, which decides once and sends each step's rows' tables with the step
(StepBatch.tables, (B, W) block ids); PagedCaches, on every rank, only reads them.

One step runs the unchanged DecoderLM forward in the right-aligned layout of
engine/slots.py (see there): the rows' new keys are written through their tables, and each
row's keys are gathered through its table into (B, K) columns. That gather is the slot
cache's gather with other indices (one flat index per key), so a step costs what it did.

A model whose every layer attends within a sliding window (Mistral) frees a sequence's
blocks as they fall behind its window (BlockTables(window=...), `kept_window`): the table
keeps its length, a freed entry reads as block 0, whose keys the window masks out. Gemma 3's
global layers read every position, so its blocks are all kept.

BLOCK_SIZE = 16, as vLLM: a sequence wastes at most 15 positions of its last block, a
2k-token sequence needs a 128-entry table, and a shared prefix is reused in units of 16
tokens. The gather indexes single positions, so the size does not change a step's cost.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardwise.engine.slots import LayerCaches, StepBatch, _StepIndex
from shardwise.kernels.decode import DecodeLayout
from shardwise.memory import zeros_on_touch
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import KVCache

__all__ = [
    "BLOCK_SIZE",
    "OutOfBlocks",
    "BlockPool",
    "BlockTables",
    "PagedKVCache",
    "PagedCaches",
    "blocks_for",
    "kept_window",
]

BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    """A step needs more free blocks than the pool has (the scheduler preempts, or refuses)."""


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


_DROPPED = -1
"""A table entry whose block fell behind the sliding window and went back to the pool."""


def kept_window(cfg) -> int | None:
    """The sliding window past which a sequence's blocks can be freed: cfg.sliding_window when
    every layer slides (Mistral), None when some layer reads every position (Gemma 3's global
    layers) or none slides."""
    return cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_layers is None else None


class BlockPool:
    """Free blocks and reference counts; a block is free when no sequence holds it. Free
    blocks are handed out oldest-freed first, so a freed block that still caches a prefix
    (BlockTables) lives as long as the pool allows."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs at least one block of at least one position, got {num_blocks} x {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order: oldest first
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks of {self.block_size} positions are in use")
        block = next(iter(self._free))
        del self._free[block]
        self.refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more sequence holds `block` (a shared prefix); a free block is taken back."""
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1

    def release(self, block: int) -> bool:
        """One holder fewer; True when the block became free."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None
            return True
        return False


class BlockTables:
    """The block table of every sequence, the pool they take from, and the prefix cache
    (the scheduler's side).

    Prefix caching: a full block of a sequence is keyed by its tokens and the key of the
    block before it (so by everything before it, exactly: no hash collisions), once the
    sequence has cached it. A new sequence whose prompt starts with keyed blocks shares
    them (reference counts) instead of computing them. A keyed block stays keyed after its
    last holder leaves, until the pool hands it out again.

    window: every layer attends to the last `window` positions only (kept_window); a block
    no future query of its sequence can see is released (drop_behind_window)."""

    def __init__(
        self, num_blocks: int, block_size: int = BLOCK_SIZE, *, prefix_caching: bool = True, window: int | None = None
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be >= 1 position, got {window}")
        self.window = window
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.prefix_caching = prefix_caching
        self._key_block: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent key id, tokens) -> block
        self._block_key: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block -> (key id, parent, tokens)
        self._keyed: dict[int, tuple[int, int]] = {}  # sequence -> (blocks keyed, last key id)
        self._ids = 0

    def missing(self, lengths: dict[int, int]) -> int:
        """Blocks the pool must still give for each sequence to hold `lengths[seq]` positions."""
        return sum(max(0, blocks_for(n, self.block_size) - len(self.tables.get(s, ()))) for s, n in lengths.items())

    def _allocate(self) -> int:
        block = self.pool.allocate()
        old = self._block_key.pop(block, None)
        if old is not None:  # handed out again: its prefix is no longer cached
            del self._key_block[(old[1], old[2])]
        return block

    def reserve(self, lengths: dict[int, int]) -> None:
        """Give each sequence blocks for `lengths[seq]` positions; all of them or none
        (OutOfBlocks, nothing allocated, when the pool cannot)."""
        total = self.missing(lengths)
        if total > self.pool.num_free:
            raise OutOfBlocks(
                f"this step needs {total} more blocks; {self.pool.num_free} of {self.pool.num_blocks} are free"
            )
        for s, n in lengths.items():
            table = self.tables.setdefault(s, [])
            table += [self._allocate() for _ in range(blocks_for(n, self.block_size) - len(table))]

    def release(self, seqs: Iterable[int]) -> int:
        """Drop these sequences' tables (finished, preempted, or their client left); returns blocks freed."""
        freed = 0
        for s in seqs:
            self._keyed.pop(s, None)
            for block in self.tables.pop(s, ()):
                if block != _DROPPED:
                    freed += self.pool.release(block)
        return freed

    def drop_behind_window(self, seq: int, cached: int) -> int:
        """`seq` holds `cached` positions: release its blocks wholly before the window of its next
        query (position `cached` sees positions > cached - window); returns blocks freed. Their
        entries stay in the table as dropped, so that positions still index it."""
        if self.window is None:
            return 0
        table, freed = self.tables.get(seq, []), 0
        for i in range(min(len(table), max(0, cached + 1 - self.window) // self.block_size)):
            if table[i] != _DROPPED:
                freed += self.pool.release(table[i])
                table[i] = _DROPPED
        return freed

    # ---- prefix caching --------------------------------------------------------------------
    def share_prefix(self, seq: int, tokens: list[int]) -> int:
        """A new sequence about to feed `tokens`: take the cached blocks its tokens start with
        (all but its last token: a step needs one token to compute). Returns the positions
        taken (a multiple of block_size), 0 when caching is off or nothing matches."""
        if not self.prefix_caching or self.tables.get(seq):
            return 0
        bs, parent, hit = self.block_size, -1, []
        for i in range((len(tokens) - 1) // bs):
            block = self._key_block.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if block is None:
                break
            hit.append(block)
            parent = self._block_key[block][0]
        for block in hit:
            self.pool.retain(block)
        if hit:
            self.tables[seq] = hit
            self._keyed[seq] = (len(hit), parent)
        return len(hit) * bs

    def cache_prefix(self, seq: int, tokens: list[int]) -> None:
        """`tokens` are in `seq`'s cache (in order): key its full blocks not keyed yet."""
        if not self.prefix_caching:
            return
        bs, table = self.block_size, self.tables.get(seq, [])
        done, parent = self._keyed.get(seq, (0, -1))
        for i in range(done, min(len(tokens) // bs, len(table))):
            if table[i] == _DROPPED:  # behind the window before it was keyed: nothing after it is keyed
                self._keyed[seq] = (1 << 62, -1)
                return
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self._key_block.get(key)
            if block is None and table[i] not in self._block_key:
                self._ids += 1
                block = table[i]
                self._key_block[key] = block
                self._block_key[block] = (self._ids, *key)
            if block is None:  # NOTE: cannot happen (a fresh block has no key); stop keying this sequence
                self._keyed[seq] = (1 << 62, -1)
                return
            parent, done = self._block_key[block][0], i + 1
        self._keyed[seq] = (done, parent)

    def rows(self, seqs: list[int], device=None) -> torch.Tensor:
        """(B, W) block ids of these sequences' tables, W the longest; 0 past a table's end and
        for a dropped block (its keys are outside every query's window: masked)."""
        width = max((len(self.tables.get(s, ())) for s in seqs), default=0)
        out = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
        for b, s in enumerate(seqs):
            t = self.tables.get(s, ())
            out[b, : len(t)] = torch.tensor(t, dtype=torch.long).clamp(min=0)
        return out.to(device)


class PagedKVCache:
    """One attention layer's pool: (num_blocks, block_size, local KV heads, head_dim) keys and values.

    Stands in for KVCache in Attention.forward, as SlotKVCache does."""

    def __init__(
        self, owner: PagedCaches, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *, dtype, device
    ):
        self.owner = owner
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # NOTE: pages are committed as blocks are first written, not here (a server's pool is
        # sized for its budget, most of it untouched before the first requests)
        self.k = zeros_on_touch(shape, dtype, device)
        self.v = zeros_on_touch(shape, dtype, device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, nkv, T, hd) of the step's query columns -> (B, nkv, K, hd), K = start + T."""
        step = self.owner.step
        if step is None or start + k.shape[2] != step[0].K:
            raise RuntimeError("PagedKVCache used outside PagedCaches.forward")
        ix, write, read = step
        k_flat = self.k.view(-1, *self.k.shape[2:])  # (blocks * block_size, nkv, hd)
        v_flat = self.v.view(-1, *self.v.shape[2:])
        k_flat[write] = k.transpose(1, 2)[ix.valid]  # (N, nkv, hd): only real tokens are written
        v_flat[write] = v.transpose(1, 2)[ix.valid]
        return k_flat[read].transpose(1, 2), v_flat[read].transpose(1, 2)  # (B, nkv, K, hd)

    def decode_layout(self, start: int, batch: int) -> DecodeLayout | None:
        """Where this step's keys live in the pool, for the fused decode kernel (kernels.decode):
        one new token per row, read through the tables; None where it cannot run."""
        step = self.owner.step
        if step is None or start + 1 != step[0].K or step[0].valid.shape != (batch, 1):
            return None
        if self.k.dtype is not torch.float32 or self.k.device.type != "cpu":
            return None
        ix, write, read = step
        _, _, nkv, hd = self.k.shape
        return DecodeLayout(self.k, self.v, pos_stride=nkv * hd, head_stride=hd, K=ix.K, widx=write, ridx=read)


class PagedCaches(LayerCaches):
    """Every layer's pool on this rank, and the step forward through the step's block tables."""

    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs at least one block of at least one position, got {num_blocks} x {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.step: tuple[_StepIndex, torch.Tensor, torch.Tensor] | None = None
        self._build(
            model,
            lambda kv, hd, dtype, device: PagedKVCache(
                self, num_blocks, block_size, kv, hd, dtype=dtype, device=device
            ),
        )

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int = BLOCK_SIZE) -> int:
        """Bytes one block takes on this rank, over every layer it holds (keys and values)."""
        modules = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
        total = 0
        for layer in modules:
            _, kv_heads = KVCache.local_heads(layer.attn)
            total += 2 * block_size * kv_heads * model.cfg.head_dim * layer.attn.qkv.weight.dtype.itemsize
        return total

    def _index(self, batch: StepBatch) -> tuple[_StepIndex, torch.Tensor, torch.Tensor]:
        """The step's index with positions mapped through its tables: (index, write (N,), read (B, K))."""
        if batch.tables is None:
            raise ValueError("a paged step needs its rows' block tables (StepBatch.tables)")
        B = batch.ids.shape[0]
        have = (batch.tables.shape[1] * self.block_size) if batch.tables.numel() else 0
        total = batch.past + batch.n_new  # (B,)
        if int(total.max()) > have or int(batch.tables.max()) >= self.num_blocks or int(batch.tables.min()) < 0:
            raise ValueError(
                f"the step's tables ({tuple(batch.tables.shape)}, blocks {int(batch.tables.min())}..{int(batch.tables.max())}) "
                f"do not hold {int(total.max())} positions in a pool of {self.num_blocks} blocks"
            )
        rows = StepBatch(
            slots=torch.arange(B, device=batch.ids.device), past=batch.past, n_new=batch.n_new, ids=batch.ids
        )
        ix = _StepIndex.of(rows)  # slots = row numbers
        table, bs = batch.tables, self.block_size
        write = table[ix.write_slot, ix.write_pos // bs] * bs + ix.write_pos % bs  # (N,)
        read = table[ix.read_slot, ix.read_pos // bs] * bs + ix.read_pos % bs  # (B, K)
        return ix, write, read

    def _begin(self, batch: StepBatch) -> _StepIndex:
        self.step = self._index(batch)
        return self.step[0]
