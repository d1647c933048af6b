"""Loading a checkpoint into a training job of any tp x pp x dp size, resharding on the way in.

Each rank:
1. parses the manifest and checks it against the job: architecture, format version,
   every expected tensor present and none unexpected, global shapes, chunk coverage;
2. checks the files it will read: present, full size, SHA-256, keys;
3. reads exactly the rows its ShardSpecs name, for the parameters and the AdamW moments
   of its pipeline stage (a tied embedding's copy on the last stage reads the same stored
   tensors as the first stage's, so the two copies start identical, moments included).

All of it runs inside `agree`, so a bad checkpoint raises the same CheckpointError
(naming the file or key) on every rank and no rank is left waiting. RNG states are
restored when the layout (tp, pp, dp and the layer split) is unchanged, else re-seeded
from (seed, step).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from shardwise.checkpoint.manifest import KINDS, CheckpointError, Manifest, layout_text, tensor_key
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.reshard import check_cover
from shardwise.comm import agree
from shardwise.log import get_logger
from shardwise.pipeline.stage import StageLayout
from shardwise.train import Trainer, rank_specs
from shardwise.train.distopt import DistributedOptimizer

__all__ = ["load_checkpoint", "check_compatible"]

log = get_logger("checkpoint")


def check_compatible(reader: CheckpointReader, model_cfg, param_names: list[str]) -> None:
    """Architecture, keys and chunk coverage; CheckpointError naming what differs.
    param_names: every parameter of the whole model (all pipeline stages)."""
    m, where = reader.manifest, reader.dir / "manifest.json"
    diff = m.architecture_diff(asdict(model_cfg))
    if diff:
        raise CheckpointError(f"{where}: checkpoint is for a different architecture: {'; '.join(diff)}")
    expected = {tensor_key(kind, n) for kind in KINDS for n in param_names}
    missing = sorted(expected - set(m.tensors))
    unexpected = sorted(set(m.tensors) - expected)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}{more} that the model needs")
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r}{more}, not part of this model")
    for tname, entry in m.tensors.items():
        if entry.dim is None:
            continue
        span = entry.global_shape[entry.dim]
        check_cover([(c.start, c.length) for c in entry.chunks], span, what=f"{where}: {tname}")


def _job_layout(tr: Trainer) -> tuple[dict[str, int], dict]:
    dims = tr.mesh.dims
    layout = tr.layout or StageLayout.build(tr.model_cfg.num_layers, 1)
    ep = {"ep": tr.experts.ep.size} if tr.experts is not None else {}
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp} | ep, layout.to_dict()


def same_layout(m: Manifest, tr: Trainer) -> bool:
    """Saved by a job of this very layout (tp, pp, dp and the layer split): its RNG states fit."""
    sizes, split = _job_layout(tr)
    return m.layout == sizes and m.stage_layout().to_dict() == split


def _read_local(tr: Trainer, source: str) -> tuple[CheckpointReader, dict, dict | None]:
    reader = CheckpointReader(source)
    m = reader.manifest
    tp, world = tr.mesh.tp, tr.mesh.world
    check_compatible(reader, tr.model_cfg, list(rank_specs(tr.model_cfg, 1, 0)))  # every stage's names
    mine = {n: per_rank[tp.rank] for n, per_rank in tr.specs.items()}  # this stage's, a tied copy included
    # ep > 1: an expert weight is read as this ep rank's row block, then cut to its tp slice
    blocks = {n: tr.experts.block(n) for n in tr.experts.names} if tr.experts is not None else {}
    rng_file = m.rng["files"].get(str(world.rank)) if m.rng is not None and same_layout(m, tr) else None
    needed = {
        f for kind in KINDS for n, s in mine.items() for f in reader.files_for(tensor_key(kind, n), blocks.get(n, s))
    }
    reader.verify(needed | ({rng_file} if rng_file else set()))
    params = dict(tr.model.named_parameters())
    opt = tr.optimizer if isinstance(tr.optimizer, DistributedOptimizer) else None
    tensors = {}
    for kind in KINDS:
        for name, spec in mine.items():
            dtype = torch.float32 if opt is not None else params[name].dtype  # the master copy is fp32
            if name in blocks:
                t = spec.take(reader.read(tensor_key(kind, name), blocks[name], dtype))
            else:
                t = reader.read(tensor_key(kind, name), spec, dtype)
            if opt is not None:  # keep only this rank's dp slice (the weight itself whole, for the model)
                if kind == "param":
                    tensors[("master", name)] = opt.local_piece(name, t)
                else:
                    t = opt.local_piece(name, t)
            tensors[tensor_key(kind, name)] = t
    rng = {k.split("/", 1)[1]: reader.read_key(rng_file, k) for k in m.rng["keys"]} if rng_file else None
    reader.close()
    return reader, tensors, rng


def load_checkpoint(tr: Trainer, source: str) -> None:
    """Fill tr's model, optimizer state, step, loss history and RNG from a checkpoint. Collective."""
    reader, tensors, rng = agree(
        tr.mesh.world, lambda: _read_local(tr, source), catch=(CheckpointError, OSError), what=f"loading {source}"
    )
    m = reader.manifest
    opt = tr.optimizer if isinstance(tr.optimizer, DistributedOptimizer) else None
    with torch.no_grad():
        for name, p in tr.model.named_parameters():
            p.copy_(tensors[tensor_key("param", name)])
            if opt is not None:
                opt.load_piece(name, "param", tensors[("master", name)], m.step)
                for kind in KINDS[1:] if m.step > 0 else ():
                    opt.load_piece(name, kind, tensors[tensor_key(kind, name)], m.step)
            elif m.step > 0:
                tr.optimizer.state[p] = {
                    "step": torch.tensor(float(m.optimizer.get("step", m.step))),
                    **{kind: tensors[tensor_key(kind, name)] for kind in KINDS[1:]},
                }
    tr.step = m.step
    tr.history[:] = [tuple(x) for x in m.extra.get("history", [])]
    saved = layout_text(m.layout, ", ")
    if rng is not None:
        tr.rng.load_state(rng)
    else:
        tr.rng.reseed(step=m.step)
        log.info("layout changed (%s -> %s): RNG streams re-seeded from (seed, step %d)",
                 saved, layout_text(_job_layout(tr)[0], ", "), m.step)  # fmt: skip
    log.info("resumed from %s at step %d (saved at %s)", reader.dir, m.step, saved)
