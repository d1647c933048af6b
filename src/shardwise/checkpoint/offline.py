"""Offline resharding: rewrite a checkpoint for another tp size, one chunk at a time.

    reshard_checkpoint("runs/x/checkpoints", "runs/x/tp4", tp=4)

For every target rank and every tensor (parameters and AdamW moments), the rows that
rank will own are read from the source chunks (partial reads of the memory-mapped
files) and streamed into the target file, whose header was written up front. At most one
chunk is in memory at a time, never the whole model. The result is an ordinary committed
checkpoint (manifest written last, directory renamed into place) laid out as tp ranks of
one dp replica; a job of any size can still load it. RNG states are per rank and do not
carry over (the loader re-seeds them from the seed and step).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from shardwise.checkpoint.files import SafetensorsWriter, dtype_from_name, fsync_dir, write_atomic
from shardwise.checkpoint.manifest import CheckpointError, Chunk, Manifest, TensorEntry
from shardwise.checkpoint.reader import MANIFEST, CheckpointReader
from shardwise.checkpoint.save import rank_file
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


def model_config(manifest: Manifest) -> ModelConfig:
    try:
        return ModelConfig(**manifest.model)
    except TypeError as e:
        raise CheckpointError(f"manifest model section does not describe a ModelConfig ({e})") from None


def _chunk_spec(spec: ShardSpec, start: int, length: int) -> ShardSpec:
    return spec if spec.dim is None else ShardSpec(spec.global_shape, spec.dim, ((start, length),))


def reshard_checkpoint(src: str | Path, dst: str | Path, *, tp: int, progress: bool = False) -> ReshardStats:
    """Write `src` (a checkpoint, or a directory with `latest`) as a tp-sized checkpoint at `dst`."""
    reader = CheckpointReader(src)
    reader.verify()  # sizes, SHA-256 and keys of every file, before anything is written
    m = reader.manifest
    cfg = model_config(m)
    check_tp(cfg, tp)
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; choose a new directory")
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = all_rank_specs(cfg, tp)
    tensors: dict[str, dict] = {}
    files, peak, written = {}, 0, 0
    bar = tqdm(desc=f"reshard to tp={tp}", unit="chunk", disable=not progress)
    for t in range(tp):
        jobs = []  # (tensor name, file key, chunk spec, dtype)
        for tname, entry in m.tensors.items():
            per_rank = specs[tname.split("/", 1)[1]]
            for start, length in owned_intervals(per_rank, t):
                jobs.append((tname, f"{tname}@{start}", _chunk_spec(per_rank[t], start, length), entry.dtype))
                tensors.setdefault(tname, {"entry": entry, "dim": per_rank[t].dim, "chunks": []})
                tensors[tname]["chunks"].append(Chunk(rank_file(t), f"{tname}@{start}", start, length))
        entries = [(key, dtype_from_name(dt), s.local_shape) for _, key, s, dt in jobs]
        with SafetensorsWriter(tmp / rank_file(t), entries, metadata={"step": m.step, "rank": t}) as w:
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
    out = replace(
        m,
        layout={"tp": tp, "dp": 1},
        tensors={
            k: TensorEntry(v["entry"].global_shape, v["entry"].dtype, v["dim"], tuple(v["chunks"]))
            for k, v in tensors.items()
        },
        files=files,
        rng=None,
        extra={**m.extra, "resharded_from": {"path": str(reader.dir), "tp": m.layout["tp"], "dp": m.layout["dp"]}},
    )
    write_atomic(tmp / MANIFEST, out.to_json().encode())
    fsync_dir(tmp)
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    total = sum(_numel(e.global_shape) * dtype_from_name(e.dtype).itemsize for e in m.tensors.values())
    return ReshardStats(str(reader.dir), str(dst), m.layout["tp"], tp, len(m.tensors), written, peak, total)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
