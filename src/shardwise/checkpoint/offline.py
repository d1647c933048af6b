"""Offline resharding: rewrite a checkpoint for another tp x pp x dp layout, one chunk at a time.

    reshard_checkpoint("runs/x/checkpoints", "runs/x/tp4", tp=4)
    reshard_checkpoint("runs/x/checkpoints", "runs/x/pp2", tp=2, pp=2, pp_layers=[3, 1])

For every target rank of dp replica 0 (each tp rank of each pipeline stage) and every
tensor its stage owns (parameters and AdamW moments), the rows that rank will own are
read from the source chunks (partial reads of the memory-mapped files) and streamed
into the target file, whose header was written up front. At most one chunk is in memory
at a time, never the whole model. The result is an ordinary committed checkpoint
(manifest written last, directory renamed into place), laid out as the job of that
layout would have saved it; a job of any size can still load it. RNG states are per
rank and do not carry over (the loader re-seeds them from the seed and step).

ep > 1 (a mixture-of-experts model): each expert weight and its moments are written as ep
row blocks of whole experts, block j by the rank (tp 0, dp j) of each stage, as an
expert-parallel job saves them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from shardwise.checkpoint.files import SafetensorsWriter, dtype_from_name, fsync_dir, write_atomic
from shardwise.checkpoint.load import check_compatible
from shardwise.checkpoint.manifest import CheckpointError, Chunk, Manifest, TensorEntry
from shardwise.checkpoint.reader import MANIFEST, CheckpointReader
from shardwise.checkpoint.save import rank_file
from shardwise.checkpoint.stages import stage_layout, stage_names
from shardwise.comm import ParallelDims
from shardwise.layers import ShardSpec
from shardwise.models.config import ModelConfig
from shardwise.sharding.plans import check_tp
from shardwise.train.layout import all_rank_specs, owned_intervals

__all__ = ["reshard_checkpoint", "ReshardStats", "model_config"]


@dataclass
class ReshardStats:
    src: str
    dst: str
    tp_from: int
    tp_to: int
    tensors: int
    bytes_written: int
    peak_chunk_bytes: int
    """The largest single chunk held in memory while rewriting."""
    total_tensor_bytes: int
    """All tensor data of the checkpoint, for comparison."""
    pp_from: int = 1
    pp_to: int = 1
    dp_to: int = 1
    ep_to: int = 1
    files: int = 0
    """Tensor files written: tp * pp (the ranks of dp replica 0)."""
    stages: str = ""
    """The target split, StageLayout.describe()."""


def model_config(manifest: Manifest) -> ModelConfig:
    try:
        return ModelConfig(**manifest.model)
    except TypeError as e:
        raise CheckpointError(f"manifest model section does not describe a ModelConfig ({e})") from None


def _chunk_spec(spec: ShardSpec, start: int, length: int) -> ShardSpec:
    return spec if spec.dim is None else ShardSpec(spec.global_shape, spec.dim, ((start, length),))


def _check_dp(dp: int) -> None:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise CheckpointError(f"dp must be a positive int, got {dp!r}")


def _check_ep(cfg: ModelConfig, ep: int, dp: int, pp: int) -> None:
    from shardwise.train.experts import check_moe_training
    from shardwise.train.fields import ConfigError

    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise CheckpointError(f"ep must be a positive int, got {ep!r}")
    if dp % ep:
        raise CheckpointError(f"ep={ep} must divide dp={dp} (an expert-parallel job of ep={ep} has dp >= ep)")
    if ep > 1:
        try:
            check_moe_training(cfg, ep=ep, dp=dp, pp=pp)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None


def _is_expert(name: str) -> bool:
    return name.endswith(".experts.up") or name.endswith(".experts.down")


def reshard_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    virtual_stages: int = 1,
    pp_layers: list[int] | None = None,
    progress: bool = False,
) -> ReshardStats:
    """Write `src` (a checkpoint, or a directory with `latest`) at `dst`, laid out for tp x pp x dp
    (pp_layers: layers per virtual stage; None = balanced), experts over ep (dp = ep when dp is
    smaller). Every check comes before any write."""
    reader = CheckpointReader(src)
    m = reader.manifest
    cfg = model_config(m)
    check_tp(cfg, tp)
    layout = stage_layout(cfg, pp, virtual_stages, pp_layers)
    _check_dp(dp)
    dp = max(dp, ep) if isinstance(ep, int) and ep > 1 else dp
    _check_ep(cfg, ep, dp, pp)
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; choose a new directory")
    reader.verify()  # sizes, SHA-256 and keys of every file, before anything is written
    owners = stage_names(cfg, layout)  # the parameters each stage writes
    check_compatible(reader, cfg, [n for names in owners for n in names])
    dims = ParallelDims(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp)
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = all_rank_specs(cfg, tp)
    tensors: dict[str, dict] = {}
    files, peak, written = {}, 0, 0
    bar = tqdm(desc=f"reshard to {dims.tp}x{dims.pp}x{dims.dp}", unit="chunk", disable=not progress)
    blocks = {}  # ep > 1: an expert weight's row block on each ep rank
    if ep > 1:
        from shardwise.layers import expert_block_specs

        per_rank = [expert_block_specs(cfg.num_experts, cfg.hidden_size, cfg.expert_size, ep, j) for j in range(ep)]
        blocks = {p: [b[p] for b in per_rank] for p in ("up", "down")}
    for s, names in enumerate(owners):
        owned = set(names)
        mine = [(tname, e) for tname, e in m.tensors.items() if tname.split("/", 1)[1] in owned]
        jobs_by_file: dict[str, list] = {}  # file -> [(tensor name, file key, chunk spec, dtype)]
        for tname, entry in mine:
            name = tname.split("/", 1)[1]
            if blocks and _is_expert(name):
                for j, block in enumerate(blocks[name.rsplit(".", 1)[1]]):
                    file = rank_file(dims.rank_of(tp=0, pp=s, dp=j))
                    start, length = block.pieces[0]
                    jobs_by_file.setdefault(file, []).append((tname, f"{tname}@{start}", block, entry.dtype))
                    tensors.setdefault(tname, {"entry": entry, "dim": 0, "chunks": []})
                    tensors[tname]["chunks"].append(Chunk(file, f"{tname}@{start}", start, length))
                continue
            per_rank = specs[name]
            for t in range(tp):
                file = rank_file(dims.rank_of(tp=t, pp=s, dp=0))
                for start, length in owned_intervals(per_rank, t):
                    jobs_by_file.setdefault(file, []).append(
                        (tname, f"{tname}@{start}", _chunk_spec(per_rank[t], start, length), entry.dtype)
                    )
                    tensors.setdefault(tname, {"entry": entry, "dim": per_rank[t].dim, "chunks": []})
                    tensors[tname]["chunks"].append(Chunk(file, f"{tname}@{start}", start, length))
        for file, jobs in jobs_by_file.items():
            entries = [(key, dtype_from_name(dt), sp.local_shape) for _, key, sp, dt in jobs]
            meta = {"step": m.step, "rank": int(file.split("-")[1].split(".")[0])}
            with SafetensorsWriter(tmp / file, entries, metadata=meta) as w:
                for tname, key, spec, _ in jobs:
                    chunk = reader.read(tname, spec)  # only these rows are read from the source
                    peak = max(peak, chunk.numel() * chunk.element_size())
                    w.write(key, chunk)
                    del chunk
                    bar.update(1)
            files[w.record.name] = {"bytes": w.record.bytes, "sha256": w.record.sha256}
            written += w.record.bytes
    bar.close()
    for name, info in m.files.items():  # the tokenizer and other whole files carry over
        if not name.endswith(".safetensors"):
            shutil.copyfile(reader.dir / name, tmp / name)
            files[name] = dict(info)
    reader.close()
    order = {k: i for i, k in enumerate(m.tensors)}  # the source's order
    out = replace(
        m,
        layout={"tp": tp, "pp": pp, "dp": dp} | ({"ep": ep} if ep > 1 else {}),
        pipeline=layout.to_dict(),
        tensors={
            k: TensorEntry(v["entry"].global_shape, v["entry"].dtype, v["dim"], tuple(v["chunks"]))
            for k, v in sorted(tensors.items(), key=lambda kv: order[kv[0]])
        },
        files=files,
        rng=None,
        extra={**m.extra, "resharded_from": {"path": str(reader.dir), **m.layout}},
    )
    write_atomic(tmp / MANIFEST, out.to_json().encode())
    fsync_dir(tmp)
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    total = sum(_numel(e.global_shape) * dtype_from_name(e.dtype).itemsize for e in m.tensors.values())
    return ReshardStats(
        src=str(reader.dir),
        dst=str(dst),
        tp_from=m.layout["tp"],
        tp_to=tp,
        tensors=len(tensors),
        bytes_written=written,
        peak_chunk_bytes=peak,
        total_tensor_bytes=total,
        pp_from=m.layout["pp"],
        pp_to=pp,
        dp_to=dp,
        ep_to=ep,
        files=len(files) - sum(1 for n in files if not n.endswith(".safetensors")),
        stages=layout.describe(),
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
