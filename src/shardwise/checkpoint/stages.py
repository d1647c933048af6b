"""Pipeline stages in a checkpoint: which stored tensors each stage writes and reads.

A checkpoint stores every parameter once, under its global name ("layers.5.attn.qkv.weight"),
whichever pipeline stage held it; the manifest records the split it was saved with
(`pipeline`: StageLayout.to_dict()) only to describe it and to decide whether the RNG
states still fit. So moving a checkpoint between pp sizes is a matter of names:

    stage_names(cfg, StageLayout.build(4, pp=2))   # [[embed.weight, layers.0..., layers.1...],
                                                   #  [layers.2..., layers.3..., norm.weight, lm_head.weight]]

Each stage writes the parameters it owns; a name held by several stages (the tied
embedding, which the last stage keeps as a copy for its head) is owned by the lowest,
as a row held by several tp ranks is. On loading, every rank reads each parameter it
holds, copies included, so the tied copy gets the first stage's values and AdamW moments.
"""

from __future__ import annotations

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.meta import on_meta
from shardwise.pipeline.stage import StageError, StageLayout, keep_stage

__all__ = ["stage_layout", "stage_names", "held_names"]


def stage_layout(
    cfg: ModelConfig, pp: int, virtual_stages: int = 1, pp_layers: list[int] | tuple[int, ...] | None = None
) -> StageLayout:
    """StageLayout.build for cfg's layers, as a CheckpointError (one line naming the numbers)."""
    try:
        return StageLayout.build(cfg.num_layers, pp, virtual_stages, pp_layers)
    except StageError as e:
        raise CheckpointError(f"cannot split the checkpoint's model into stages: {e}") from None


def held_names(cfg: ModelConfig, layout: StageLayout, rank: int) -> list[str]:
    """Every parameter pp rank `rank` holds (a tied copy included), in the model's order."""
    with on_meta():  # shapes only, no memory
        model = DecoderLM(cfg)
    if layout.pp > 1:
        keep_stage(model, layout, rank)
    return [name for name, _ in model.named_parameters()]


def stage_names(cfg: ModelConfig, layout: StageLayout) -> list[list[str]]:
    """The parameters each pp rank owns (holds, and no lower rank holds): every parameter
    of the model exactly once."""
    out, seen = [], set()
    for rank in range(layout.pp):
        names = [n for n in held_names(cfg, layout, rank) if n not in seen]
        seen.update(names)
        out.append(names)
    return out
