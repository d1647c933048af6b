"""Per-sequence KV-cache slots: the cache of continuous batching.

KVCache (models/modules.py) gives every row of a batch the same positions, which suits
one batch that starts and ends together. A server's batch changes at every step:
sequences join at a token boundary and leave when done, each with its own length. Here
each sequence owns a slot of a preallocated cache, and one step is any set of rows

    row b: slot s_b already holds past_b tokens; n_b new tokens arrive (a prompt, or 1)

The step runs the unchanged DecoderLM forward in the layout generate() uses, left
padding. With T = max n_b and K = max(past_b + n_b):

    queries  ids (B, T): row b's new tokens are its last n_b columns (left-padded)
    keys     (B, K):     row b's past_b + n_b keys are its last columns (left-padded)

so the model's causal mask over the last T of K columns, with attention_mask marking
real keys, lets each row attend to exactly its own tokens. Positions are per row
(past_b + j). The cache object answers the model's `update(start, k, v)` call: it
writes the real new keys and values into their slots, then gathers every row's keys in
that right-aligned layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.kernels.decode import DecodeLayout
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import KVCache

__all__ = ["StepBatch", "SlotKVCache", "LayerCaches", "SlotCaches"]


@dataclass(frozen=True)
class StepBatch:
    """One step of continuous batching: which slots advance, by which tokens."""

    slots: torch.Tensor
    """(B,) the slot of each row."""
    past: torch.Tensor
    """(B,) tokens that slot already holds in the cache."""
    n_new: torch.Tensor
    """(B,) new tokens of each row, 1..T."""
    ids: torch.Tensor
    """(B, T) the new tokens, left-padded with 0."""
    tables: torch.Tensor | None = None
    """(B, W) each row's KV blocks, for a paged cache (engine/paged.py; slots are then
    sequence ids); None for the slot cache."""
    greedy: bool = False
    """Every row decodes greedily: the step's logits may stay split by vocabulary (engine.argmax)."""

    @staticmethod
    def build(
        rows: Sequence[tuple[int, int, Sequence[int]]], device=None, tables: torch.Tensor | None = None
    ) -> StepBatch:
        """rows: (slot, past length, new token ids) per row; tables: (B, W) blocks (paged)."""
        if not rows or any(len(r[2]) == 0 for r in rows):
            raise ValueError("a step needs at least one row, and every row at least one new token")
        B, T = len(rows), max(len(r[2]) for r in rows)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, (_, _, new) in enumerate(rows):
            ids[b, T - len(new) :] = torch.tensor(list(new), dtype=torch.long)
        return StepBatch(
            slots=torch.tensor([r[0] for r in rows], dtype=torch.long, device=device),
            past=torch.tensor([r[1] for r in rows], dtype=torch.long, device=device),
            n_new=torch.tensor([len(r[2]) for r in rows], dtype=torch.long, device=device),
            ids=ids.to(device),
            tables=None if tables is None else tables.to(device),
        )


@dataclass(frozen=True)
class _StepIndex:
    """Index tensors of one step, shared by every layer's cache."""

    K: int
    write_slot: torch.Tensor  # (N,) slot of each real new token, N = sum(n_new)
    write_pos: torch.Tensor  # (N,) its position in the slot
    valid: torch.Tensor  # (B, T) True for real new tokens
    read_slot: torch.Tensor  # (B, 1) slot of each row
    read_pos: torch.Tensor  # (B, K) slot position of each key column (0 for padding)
    key_mask: torch.Tensor  # (B, K) 1 for real keys
    positions: torch.Tensor  # (B, T) position of each query (0 for padding)

    @staticmethod
    def of(batch: StepBatch) -> _StepIndex:
        B, T = batch.ids.shape
        dev = batch.ids.device
        total = batch.past + batch.n_new  # (B,)
        K = int(total.max())
        pad_q = (T - batch.n_new).unsqueeze(1)  # (B, 1) padded query columns per row
        j = torch.arange(T, device=dev).unsqueeze(0)  # (1, T)
        valid = j >= pad_q  # (B, T)
        positions = (batch.past.unsqueeze(1) + j - pad_q).clamp(min=0)  # (B, T)
        c = torch.arange(K, device=dev).unsqueeze(0)  # (1, K)
        pad_k = (K - total).unsqueeze(1)  # (B, 1) padded key columns per row
        return _StepIndex(
            K=K,
            write_slot=batch.slots.unsqueeze(1).expand(B, T)[valid],
            write_pos=positions[valid],
            valid=valid,
            read_slot=batch.slots.unsqueeze(1),
            read_pos=(c - pad_k).clamp(min=0),
            key_mask=(c >= pad_k).long(),
            positions=positions,
        )


class SlotKVCache:
    """One attention layer's keys and values for every slot: (slots, max_len, local KV heads, head_dim).

    Stands in for KVCache in Attention.forward: `update` is called with this step's new
    keys and values and returns the keys and values the step's queries attend to.
    """

    def __init__(self, owner: SlotCaches, num_slots: int, max_len: int, kv_heads: int, head_dim: int, *, dtype, device):
        self.owner = owner
        self.k = torch.zeros(num_slots, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, nkv, T, hd) of the step's query columns -> (B, nkv, K, hd), K = start + T."""
        ix = self.owner.step
        if ix is None or start + k.shape[2] != ix.K:
            raise RuntimeError("SlotKVCache used outside SlotCaches.forward")
        # NOTE: only real tokens are written; a padded query column's k/v is dropped.
        self.k[ix.write_slot, ix.write_pos] = k.transpose(1, 2)[ix.valid]  # (N, nkv, hd)
        self.v[ix.write_slot, ix.write_pos] = v.transpose(1, 2)[ix.valid]
        keys = self.k[ix.read_slot, ix.read_pos]  # (B, K, nkv, hd)
        values = self.v[ix.read_slot, ix.read_pos]
        return keys.transpose(1, 2), values.transpose(1, 2)  # (B, nkv, K, hd)

    def decode_layout(self, start: int, batch: int) -> DecodeLayout | None:
        """Where this step's keys live, for the fused decode kernel (kernels.decode): one new
        token per row; None where it cannot run."""
        ix = self.owner.step
        if ix is None or start + 1 != ix.K or ix.valid.shape != (batch, 1) or self.k.dtype is not torch.float32:
            return None
        write, read = self.owner.flat_index(self.k.shape[1])
        _, _, nkv, hd = self.k.shape
        return DecodeLayout(self.k, self.v, pos_stride=nkv * hd, head_stride=hd, K=ix.K, widx=write, ridx=read)


class LayerCaches:
    """What the slot cache and the paged cache (engine/paged.py) share: one cache object per
    attention layer the model holds, and a step through the unchanged forward. A subclass
    says how a step's positions map to its storage (`_begin`: sets `self.step`)."""

    step = None
    _flat: tuple | None = None

    def flat_index(self, per_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's positions as flat indices into a (slots * per_slot, ...) cache: each new
        token's (N,) and each row's keys' (B, K), int64 contiguous; computed once a step."""
        ix = self.step
        if self._flat is None or self._flat[0] is not ix:
            write = (ix.write_slot * per_slot + ix.write_pos).contiguous()
            read = (ix.read_slot * per_slot + ix.read_pos).contiguous()
            self._flat = (ix, write, read)
        return self._flat[1], self._flat[2]

    def _build(self, model: DecoderLM, make) -> None:
        """make(kv_heads, head_dim, dtype, device) -> one layer's cache."""
        self.layers: list = []
        self.by_layer: dict = {}  # global layer index -> cache (a stage holds some layers)
        modules = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
        for i, layer in zip(model.layer_indices(), modules, strict=True):
            _, kv_heads = KVCache.local_heads(layer.attn)
            w = layer.attn.qkv.weight
            cache = make(kv_heads, model.cfg.head_dim, w.dtype, w.device)
            self.layers.append(cache)
            self.by_layer[i] = cache

    @property
    def nbytes(self) -> int:
        """Bytes of cache this rank holds."""
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers)

    def _begin(self, batch: StepBatch) -> _StepIndex:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, model: DecoderLM, batch: StepBatch) -> torch.Tensor:
        """Run one step -> logits of each row's next token (B, V)."""
        ix = self._begin(batch)
        T = batch.ids.shape[1]
        try:
            logits = model(
                batch.ids,
                attention_mask=ix.key_mask,
                positions=ix.positions,
                caches=self.layers,  # type: ignore[arg-type]  (duck-typed KVCache)
                start=ix.K - T,
                last_only=True,
            )  # (B, 1, V)
        finally:
            self.step = None
        return logits[:, -1]

    @torch.no_grad()
    def stage_step(
        self, model: DecoderLM, batch: StepBatch, hidden: torch.Tensor | None, *, last: bool
    ) -> torch.Tensor:
        """One step through the layers this (stage's) model holds, with no communication:
        hidden (B, T, hidden) from the previous stage, or None on the first (it embeds ids)
        -> (B, T, hidden) for the next stage, or logits (B, V) when `last`."""
        ix = self._begin(batch)
        T = batch.ids.shape[1]
        try:
            x, rope, attn = model.prelude(batch.ids, ix.key_mask, ix.positions, True, ix.K - T, hidden=hidden)
            x = model.run_layers(x, rope, attn, self.by_layer, ix.K - T)  # type: ignore[arg-type]
        finally:
            self.step = None
        return model.head(x, last_only=True)[:, -1] if last else x


class SlotCaches(LayerCaches):
    """The slot caches of every layer of one model (this rank's KV heads), and the step forward."""

    def __init__(self, model: DecoderLM, num_slots: int, max_len: int) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots} and {max_len}")
        self.num_slots, self.max_len = num_slots, max_len
        self.step: _StepIndex | None = None
        self._build(
            model,
            lambda kv, hd, dtype, device: SlotKVCache(self, num_slots, max_len, kv, hd, dtype=dtype, device=device),
        )

    def check(self, batch: StepBatch) -> None:
        """Refuse a batch that does not fit the slots (a scheduler bug, not user input)."""
        if len(set(batch.slots.tolist())) != batch.slots.numel():
            raise ValueError(f"a slot appears twice in one step: {batch.slots.tolist()}")
        if int(batch.slots.min()) < 0 or int(batch.slots.max()) >= self.num_slots:
            raise ValueError(f"slots {batch.slots.tolist()} outside [0, {self.num_slots})")
        if int((batch.past + batch.n_new).max()) > self.max_len:
            raise ValueError(f"a sequence would exceed the {self.max_len} cached positions of a slot")

    def _begin(self, batch: StepBatch) -> _StepIndex:
        self.check(batch)
        self.step = _StepIndex.of(batch)
        return self.step
