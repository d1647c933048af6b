"""Stages: which decoder layers each pipeline rank holds, and cutting a model down to them.

    layout = StageLayout.build(num_layers=8, pp=2)              # [4, 4]
    layout = StageLayout.build(8, pp=2, pp_layers=[5, 3])         # explicit split
    layout = StageLayout.build(8, pp=2, virtual_stages=2)         # [2, 2, 2, 2]: rank 0 holds 0-1 and 4-5
    layout = StageLayout.weighted([11] * 8, pp=2, last=33)        # [5, 3]: the head weighs 3 layers
    keep_stage(model, layout, pp_rank)                            # drop every other layer, in place

StageLayout is pure arithmetic (no torch import); keep_stage works on a DecoderLM.

Virtual stage s holds a contiguous run of layers and lives on rank s % pp (model chunk
s // pp), as in pipeline/actions.py. The first virtual stage also holds the embedding,
the last the final norm and the LM head (and computes the loss).

Parameter names keep the global layer index ("layers.5.attn.qkv.weight" on whichever
rank holds layer 5), so a checkpoint, a plan and a name table are the same at every pp.

Tied embeddings: the last stage keeps `embed` as well, only for the weight its LM head
shares, under the same name "embed.weight". The first and last stage then each hold a
copy; the training step keeps them identical by summing their gradients over the
embedding group (ParallelDims.embed_groups), as Megatron-LM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from shardwise.models.config import ModelConfig

__all__ = ["StageError", "StageLayout", "keep_stage", "stage_plan", "inference_layout", "layer_weights"]


class StageError(ValueError):
    """A layer split that cannot be built (one line, numbers and valid choices named)."""


@dataclass(frozen=True)
class StageLayout:
    """Layers per virtual stage, in pipeline order (len = pp * virtual_stages)."""

    num_layers: int
    pp: int
    virtual_stages: int
    layers: tuple[int, ...]
    """Decoder layers on each virtual stage; they add up to num_layers."""

    @classmethod
    def build(
        cls, num_layers: int, pp: int, virtual_stages: int = 1, pp_layers: list[int] | tuple[int, ...] | None = None
    ) -> StageLayout:
        """Balanced (earlier stages take the leftover layers, since the last also runs the
        head and the loss), or `pp_layers` as given. Raises StageError naming the numbers."""
        for name, value in (("num_layers", num_layers), ("pp", pp), ("virtual_stages", virtual_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StageError(f"{name} must be a positive int, got {value!r}")
        stages = pp * virtual_stages
        if pp_layers is None:
            if stages > num_layers:
                raise StageError(_too_many(num_layers, pp, virtual_stages))
            base, extra = divmod(num_layers, stages)
            return cls(num_layers, pp, virtual_stages, tuple(base + (s < extra) for s in range(stages)))
        split = tuple(pp_layers)
        what = f"pp={pp}" if virtual_stages == 1 else f"pp={pp} x virtual_stages={virtual_stages}"
        if len(split) != stages:
            raise StageError(f"pp_layers={list(split)} has {len(split)} entries; {what} needs {stages} (one per stage)")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
            raise StageError(f"pp_layers={list(split)}: every stage needs at least one layer")
        if sum(split) != num_layers:
            raise StageError(f"pp_layers={list(split)} adds up to {sum(split)} layers, but the model has {num_layers}")
        return cls(num_layers, pp, virtual_stages, split)

    @classmethod
    def weighted(cls, costs: list[float], pp: int, first: float = 0.0, last: float = 0.0) -> StageLayout:
        """The contiguous split of layers with per-layer `costs` into pp stages whose largest
        stage cost is smallest, the first stage also paying `first` and the last `last` (an
        LM head). Ties go to the split closest to even. Raises StageError on pp > layers."""
        n = len(costs)
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise StageError(f"pp must be a positive int, got {pp!r}")
        if pp > n:
            raise StageError(_too_many(n, pp, 1))
        prefix = [0.0]
        for c in costs:
            prefix.append(prefix[-1] + c)

        def stage_cost(s: int, lo: int, hi: int) -> float:  # layers [lo, hi) on stage s
            return prefix[hi] - prefix[lo] + (first if s == 0 else 0.0) + (last if s == pp - 1 else 0.0)

        # best[s][i]: (largest stage cost, unevenness, split) placing layers [0, i) on stages 0..s
        best: list[dict[int, tuple[float, int, tuple[int, ...]]]] = [{} for _ in range(pp)]
        for i in range(1, n - pp + 2):
            best[0][i] = (stage_cost(0, 0, i), 0, (i,))
        for s in range(1, pp):
            for i in range(s + 1, n - (pp - 1 - s) + 1):
                options = []
                for j, (worst, spread, split) in best[s - 1].items():
                    if j < i:
                        w = max(worst, stage_cost(s, j, i))
                        options.append((w, spread + abs((i - j) - n // pp), (*split, i - j)))
                best[s][i] = min(options)
        return cls.build(n, pp, pp_layers=list(best[pp - 1][n][2]))

    @property
    def stages(self) -> int:
        """Virtual stages in the pipeline: pp * virtual_stages."""
        return self.pp * self.virtual_stages

    def ranges(self) -> list[range]:
        """The global layer indices of each virtual stage."""
        out, start = [], 0
        for n in self.layers:
            out.append(range(start, start + n))
            start += n
        return out

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages on pp rank `rank`, in chunk order."""
        return list(range(rank, self.stages, self.pp))

    def layers_of(self, rank: int) -> list[int]:
        """Every global layer index pp rank `rank` holds, ascending."""
        ranges = self.ranges()
        return [i for s in self.stages_of(rank) for i in ranges[s]]

    def rank_of_layer(self, layer: int) -> int:
        """The pp rank holding global layer `layer`."""
        for s, r in enumerate(self.ranges()):
            if layer in r:
                return s % self.pp
        raise StageError(f"layer {layer} is outside the model's {self.num_layers} layers")

    def holds_embedding(self, rank: int, tied: bool = False) -> bool:
        """The first rank (and, for tied weights, the last: its head's copy)."""
        return rank == 0 or (tied and rank == self.pp - 1)

    def holds_head(self, rank: int) -> bool:
        return rank == (self.stages - 1) % self.pp

    def to_dict(self) -> dict:
        return {"pp": self.pp, "virtual_stages": self.virtual_stages, "layers": list(self.layers)}

    def describe(self) -> str:
        """One line: which layers each rank holds, e.g. "stage 0: layers 0-4 + embed; stage 1: ..."."""
        parts = []
        for rank in range(self.pp):
            runs = [self.ranges()[s] for s in self.stages_of(rank)]
            text = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in runs)
            extra = (" + embed" if rank == 0 else "") + (" + norm, head, loss" if self.holds_head(rank) else "")
            parts.append(f"stage {rank}: layers {text}{extra}")
        return "; ".join(parts)


def layer_weights(cfg: ModelConfig, i: int) -> int:
    """Matmul weights decoder layer i reads per decode step: attention, and its MLP (for a
    mixture of experts: the router, top-k experts and the shared expert)."""
    h = cfg.hidden_size
    attn = cfg.qkv_size * h + cfg.num_heads * cfg.head_dim * h
    if cfg.is_moe_layer(i):
        mlp = cfg.num_experts * h + 3 * h * (cfg.experts_per_token * cfg.expert_size + cfg.shared_expert_size)
    else:
        mlp = (3 if cfg.gated_mlp else 2) * h * cfg.intermediate_size
    return attn + mlp


def inference_layout(cfg: ModelConfig, pp: int, pp_layers: list[int] | tuple[int, ...] | None = None) -> StageLayout:
    """The split of a model's layers into pp inference stages: `pp_layers` as given, or the
    one that balances the weights each stage reads per step (a decode step's time follows
    them), the LM head (vocab x hidden) counted on the last stage. StageError on pp > layers."""
    if pp_layers is not None:
        return StageLayout.build(cfg.num_layers, pp, pp_layers=list(pp_layers))
    costs = [layer_weights(cfg, i) for i in range(cfg.num_layers)]
    return StageLayout.weighted(costs, pp, last=cfg.vocab_size * cfg.hidden_size)


def _too_many(num_layers: int, pp: int, v: int) -> str:
    valid = ", ".join(str(p) for p in range(1, num_layers // v + 1))
    if v == 1:
        return f"pp={pp} is more than the model's {num_layers} layers; valid pp sizes: {valid}"
    return (
        f"pp={pp} x virtual_stages={v} = {pp * v} stages is more than the model's {num_layers} layers; "
        f"valid pp sizes at virtual_stages={v}: {valid}"
    )


def keep_stage(model: nn.Module, layout: StageLayout, rank: int) -> nn.Module:
    """Cut a DecoderLM (plain or sharded, on any device) down to pp rank `rank`'s part, in
    place: its layers (a ModuleDict keyed by global index), the embedding on the first
    rank, norm and head on the last, and the tied embedding's copy. Returns `model`."""
    from torch import nn  # here, so that StageLayout needs no torch (the planner uses it)

    num = len(model.layers) if isinstance(model.layers, nn.ModuleList) else model.cfg.num_layers
    if num != layout.num_layers:
        raise StageError(f"the layout splits {layout.num_layers} layers, the model has {num}")
    if not isinstance(model.layers, nn.ModuleList):
        raise StageError("keep_stage: the model is already cut to a stage")
    keep = layout.layers_of(rank)
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in keep})
    tied = bool(model.cfg.tie_embeddings)
    if not layout.holds_embedding(rank, tied):
        model.embed = None
    if rank != 0:
        model.pos_embed = None
    if not layout.holds_head(rank):
        model.norm = None
        model.lm_head = None
    return model


def stage_plan(plan: dict, model: nn.Module) -> dict:
    """The entries of a model's plan that match a module this stage holds."""
    from shardwise.sharding.plan import matches

    paths = [p for p, _ in model.named_modules() if p]
    return {pattern: style for pattern, style in plan.items() if any(matches(pattern, p) for p in paths)}
