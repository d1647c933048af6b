"""Inference across pipeline stages: each rank runs its stage's layers on its tp slice.

    layout = stage_layout(cfg, pp)                     # balanced by weights; refuses pp > layers
    stages = StageForward(model, mesh)                 # model cut to mesh.pp_rank's stage
    logits = stages.forward(ids, mask, caches, start)  # (B, T|1, V) on the last stage, else None
    tok = stages.choose(logits, B, sampling, gen)      # (B,) on every rank

One forward, stage by stage (blocking point-to-point on the pp group, one message per hop):

    stage 0     embed ids -> its layers -> send (B, T, hidden) to stage 1
    stage s     recv (B, T, hidden) -> its layers (its own KV caches) -> send to stage s + 1
    last stage  recv -> its layers -> final norm, LM head -> logits; tp rank 0 samples

The shapes are known on every rank from the token stream (B, T and the model's hidden
size), so no shape header travels; attention masks and positions are derived on every
stage from the same mask, so only hidden states and the sampled tokens move. Each tp rank
of a stage sends the full (replicated) hidden state to the same tp rank of the next stage.

The sampled tokens then reach every rank with one broadcast over the world from the
sampling rank (B int64s): every stage needs them, stage 0 to embed the next step and all
stages to agree on when a prompt stops. One collective, where "send back to stage 0, then
broadcast over each tp group" would take two on the critical path.

NOTE: stages run one after another (no microbatches in flight), so pp splits memory, not
time: a token costs the sum of the stages' times plus pp - 1 hops. A server can keep
several requests' batches in flight on different stages; the pieces here take any (B, T).
"""

from __future__ import annotations

import torch

from shardwise.comm import Communicator, Mesh
from shardwise.engine.sampling import SamplingParams, sample
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import KVCache
from shardwise.pipeline.stage import StageLayout, inference_layout

__all__ = ["StageForward", "stage_layout", "gather_snapshots"]


def stage_layout(cfg: ModelConfig, pp: int, pp_layers: list[int] | tuple[int, ...] | None = None) -> StageLayout:
    """The split of the model's layers into `pp` inference stages: `pp_layers` as given, or the
    one that balances the weights each stage reads per step (shardwise.pipeline.stage.inference_layout)."""
    return inference_layout(cfg, pp, pp_layers)


class StageForward:
    """This rank's part of a pipelined inference forward, and the token every rank continues with."""

    def __init__(self, model: DecoderLM, mesh: Mesh) -> None:
        if mesh.dims.dp != 1:
            raise ValueError(f"pipelined inference runs one replica: dp must be 1, got dp={mesh.dims.dp}")
        self.model, self.mesh = model, mesh
        self.hidden_size = model.cfg.hidden_size
        self.dtype = next(model.parameters()).dtype
        # the sampling rank: tp rank 0 of the last stage, as a world rank
        self.sampler = mesh.dims.rank_of(tp=0, pp=mesh.dims.pp - 1)

    @property
    def samples(self) -> bool:
        """True on the one rank that draws the tokens (it owns the sampling generator)."""
        return self.mesh.world.rank == self.sampler

    def new_caches(self, batch: int, max_len: int) -> dict[int, KVCache]:
        """This stage's KV caches, keyed by global layer index (what run_layers looks up)."""
        return dict(zip(self.model.layer_indices(), self.model.new_caches(batch, max_len), strict=True))

    def forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        caches: dict[int, KVCache] | None = None,
        start: int = 0,
        *,
        last_only: bool = True,
    ) -> torch.Tensor | None:
        """ids: (B, T) at slots [start, start + T); mask: (B, start + T) or None (no padding).
        -> logits (B, 1 or T, vocab) on the last stage, None on the others."""
        pp, model = self.mesh.pp, self.model
        B, T = ids.shape
        hidden = None
        if not self.mesh.is_first_stage:
            hidden = pp.recv((B, T, self.hidden_size), self.dtype, pp.rank - 1, device=ids.device)
        x, rope, attn = model.prelude(ids, mask, None, caches is not None, start, hidden=hidden)
        x = model.run_layers(x, rope, attn, caches, start)  # (B, T, hidden)
        if not self.mesh.is_last_stage:
            pp.send(x, pp.rank + 1)
            return None
        return model.head(x, last_only)

    def choose(
        self, logits: torch.Tensor | None, batch: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> torch.Tensor:
        """logits (B, V) on the sampling rank (ignored elsewhere) -> the next tokens (B,) on every rank."""
        tokens = sample(logits, sampling, generator) if self.samples else torch.empty(batch, dtype=torch.long)
        return self.mesh.world.broadcast(tokens, src=self.sampler)


def gather_snapshots(pp: Communicator, snapshot: dict, *, capacity: int = 1 << 14) -> list[dict]:
    """Every stage's accounting snapshot (JSON-sized dicts), in stage order, on every rank of
    `pp`. Not part of any step: call it after generation, outside the accounting."""
    import json

    raw = json.dumps(snapshot).encode()
    if len(raw) > capacity:
        raise ValueError(f"an accounting snapshot of {len(raw)} bytes exceeds {capacity}")
    buf = torch.zeros(1, capacity + 4, dtype=torch.uint8)
    buf[0, :4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[0, 4 : 4 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    rows = pp.all_gather(buf, dim=0)  # (pp, capacity + 4)
    out = []
    for row in rows:
        n = int.from_bytes(bytes(row[:4].tolist()), "little")
        out.append(json.loads(bytes(row[4 : 4 + n].tolist()).decode()))
    return out
