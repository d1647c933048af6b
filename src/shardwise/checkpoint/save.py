"""Saving a sharded checkpoint with an atomic commit.

    root/.tmp-step-00000010/   1. rank 0 makes it (removing any stale one)
      rank-XXXXX.safetensors   2. every rank writes its file, fsyncs it, and a small
      rank-XXXXX.json             sidecar with its size and SHA-256            (barrier)
      manifest.json            3. rank 0 writes the manifest last, fsyncs the directory,
    root/step-00000010/           renames it into place, fsyncs root,
    root/latest                   then points `latest` at it (atomic rename), and prunes
                                  old checkpoints                               (barrier)

A process killed at any moment leaves either the previous checkpoint selected by
`latest` (the new one is an ignored .tmp directory, or committed but not yet pointed
to) or the new one, complete. Every phase ends with `agree`, so an error on any rank
(a full disk, an existing step) is raised on every rank.

Who writes what: the ranks of dp replica 0 (one per tp rank of each pipeline stage) write
the rows they own of each tensor their stage owns (a row held by several tp ranks is
written once, by the lowest; the tied embedding's copy on the last stage is not written,
stage 0 owns it); every rank writes its own RNG states. Each rank's sidecar lists the
chunks it wrote, so rank 0, which holds only its own stage, builds the manifest from them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from shardwise.checkpoint.files import SafetensorsWriter, dtype_name, fsync_dir, sha256_file, write_atomic
from shardwise.checkpoint.manifest import KINDS, CheckpointError, Chunk, Manifest, TensorEntry, tensor_key
from shardwise.checkpoint.reader import LATEST, MANIFEST
from shardwise.comm import agree
from shardwise.pipeline.stage import StageLayout
from shardwise.train import Trainer, owned_intervals
from shardwise.train.distopt import DistributedOptimizer
from shardwise.train.layout import gather_tp, local_segments, plan_summary

__all__ = ["save_checkpoint", "step_dir_name", "rank_file", "committed_steps"]


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def committed_steps(root: Path) -> list[Path]:
    """Committed checkpoint directories under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def _state_tensor(tr: Trainer, name: str, kind: str, states: dict | None) -> torch.Tensor:
    """This rank's tp-local weight (or fp32 master) or AdamW moment of `name`."""
    if states is not None:
        return states[(kind, name)]
    p = dict(tr.model.named_parameters())[name]
    if kind == "param":
        return p.detach()
    state = tr.optimizer.state.get(p, {})
    return state[kind].detach() if kind in state else torch.zeros_like(p)


def gathered_states(tr: Trainer) -> dict[tuple[str, str], torch.Tensor] | None:
    """Under the distributed optimizer (or a bf16 model's fp32 master), with experts: every
    expert tensor's tp-local master and moments, gathered from the edp slices (collective, the
    same order on every rank), for expert_blocks to gather over tp; None otherwise. The dense
    tensors are gathered one at a time while the file is written (_write_rank_file)."""
    opt = tr.optimizer
    if not isinstance(opt, DistributedOptimizer) or tr.experts is None:
        return None
    return {(kind, name): opt.state_tensor(name, kind) for kind in KINDS for name in sorted(tr.experts.names)}


def _chunk_plan(tr: Trainer, rank_tp: int) -> list[tuple[str, str, int, int, tuple[int, ...]]]:
    """(tensor key, file key, global start, length, chunk shape) of every chunk tp rank `rank_tp`
    of this stage writes: the rows it owns of the parameters the stage owns (tr.copies left out)."""
    out = []
    experts = tr.experts.names if tr.experts is not None else set()
    for kind in KINDS:
        for name, per_rank in tr.specs.items():
            if name in tr.copies or name in experts:
                continue
            spec = per_rank[rank_tp]
            for start, length in owned_intervals(per_rank, rank_tp):
                shape = list(spec.global_shape)
                if spec.dim is not None:
                    shape[spec.dim] = length
                out.append((tensor_key(kind, name), f"{tensor_key(kind, name)}@{start}", start, length, tuple(shape)))
    return out


def _local_rows(spec, local: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Global rows [start, start + length) of this rank's local tensor (they are held here)."""
    if spec.dim is None:
        return local
    for l_start, g_start, n in local_segments(spec):
        if g_start <= start and start + length <= g_start + n:
            return local.narrow(spec.dim, l_start + start - g_start, length)
    raise AssertionError(f"rows [{start}, {start + length}) are not within one local piece")


def expert_blocks(tr: Trainer, states: dict | None = None) -> list[tuple[str, str, int, int, torch.Tensor]]:
    """(tensor key, file key, global start, rows, block) of the expert row blocks this rank
    writes (ep > 1): gathered over tp (collective: every rank calls it), kept on the writers."""
    if tr.experts is None:
        return []
    writer = tr.experts.edp.rank == 0 and tr.mesh.tp.rank == 0
    out = []
    for kind in KINDS:
        for name in sorted(tr.experts.names):
            block = gather_tp(_state_tensor(tr, name, kind, states), tr.specs[name], tr.mesh.tp)
            start, rows = tr.experts.block(name).pieces[0]
            if writer:
                out.append((tensor_key(kind, name), f"{tensor_key(kind, name)}@{start}", start, rows, block))
    return out


def _write_rank_file(tr: Trainer, tmp: Path, blocks: list, states: dict | None) -> None:
    """This rank's file and sidecar. Under the distributed optimizer each tensor is gathered
    from the dp slices as its turn comes (one all-gather over dp per tensor, on every rank of
    the dp group, in the same order), so dp rank 0 holds its share plus one tensor; an error
    while writing is kept until every gather has run, then raised (agreed by the caller)."""
    world, tp, dp = tr.mesh.world, tr.mesh.tp, tr.mesh.dp
    chunks = _chunk_plan(tr, tp.rank) if dp.rank == 0 else []
    streamed = isinstance(tr.optimizer, DistributedOptimizer)
    rng = tr.rng.state()
    dtypes = {
        tkey: torch.float32
        if streamed
        else _state_tensor(tr, tkey.split("/", 1)[1], tkey.split("/", 1)[0], states).dtype
        for tkey, *_ in chunks
    }  # the distributed optimizer's master and moments are fp32
    entries = [(fkey, dtypes[tkey], shape) for tkey, fkey, _, _, shape in chunks]
    entries += [(fkey, block.dtype, tuple(block.shape)) for _, fkey, _, _, block in blocks]
    entries += [(f"rng/{k}", torch.uint8, tuple(v.shape)) for k, v in rng.items()]
    path = tmp / rank_file(world.rank)
    todo: dict[str, list] = {}
    for c in chunks:
        todo.setdefault(c[0], []).append(c)
    experts = tr.experts.names if tr.experts is not None else set()
    error: BaseException | None = None
    w = None
    try:
        w = SafetensorsWriter(path, entries, metadata={"step": tr.step, "rank": world.rank})
    except OSError as e:
        error = e
    for kind in KINDS:
        for name in tr.specs:
            tkey = tensor_key(kind, name)
            if name in tr.copies or name in experts or (not streamed and tkey not in todo):
                continue
            t = tr.optimizer.state_tensor(name, kind) if streamed else _state_tensor(tr, name, kind, states)
            if error is not None:
                continue
            try:
                for _, fkey, start, length, _ in todo.get(tkey, []):
                    w.write(fkey, _local_rows(tr.specs[name][tp.rank], t, start, length))
            except (OSError, ValueError) as e:
                error = e
            del t
    if error is None:
        try:
            for _, fkey, _, _, block in blocks:
                w.write(fkey, block)
            for k, v in rng.items():
                w.write(f"rng/{k}", v)
            w.close()
        except (OSError, ValueError) as e:
            error = e
    if error is not None:
        if w is not None:
            w._file.close()
        raise error
    written = []  # what the manifest says of each chunk
    for tkey, fkey, start, length, _ in chunks:
        name = tkey.split("/", 1)[1]
        spec = tr.specs[name][tp.rank]
        shape, dtype = list(spec.global_shape), dtype_name(dtypes[tkey])
        written.append({"tensor": tkey, "key": fkey, "start": start, "length": length, "global_shape": shape,
                        "dtype": dtype, "dim": spec.dim})  # fmt: skip
    for tkey, fkey, start, length, block in blocks:
        name = tkey.split("/", 1)[1]
        shape = list(tr.experts.block(name).global_shape)
        written.append({"tensor": tkey, "key": fkey, "start": start, "length": length, "global_shape": shape,
                        "dtype": dtype_name(block.dtype), "dim": 0})  # fmt: skip
    names = {id(p): n for n, p in tr.model.named_parameters()}
    if isinstance(tr.optimizer, DistributedOptimizer):
        groups = [[n for n in g if n not in tr.copies] for g in tr.optimizer.group_names()]
    else:
        groups = [
            [names[id(p)] for p in g["params"] if names[id(p)] not in tr.copies] for g in tr.optimizer.param_groups
        ]
    record = {
        "file": path.name,
        "bytes": w.record.bytes,
        "sha256": w.record.sha256,
        "rng_keys": sorted(rng),
        "chunks": written,
        "groups": groups if dp.rank == 0 and tp.rank == 0 else None,  # one rank per stage names its parameters
    }
    write_atomic(tmp / f"rank-{world.rank:05d}.json", json.dumps(record).encode())


def _manifest(tr: Trainer, tmp: Path) -> Manifest:
    """Rank 0 builds the manifest from every rank's sidecar (it holds only its own stage)."""
    world, dims = tr.mesh.world, tr.mesh.dims
    files, rng_files, records = {}, {}, []
    for r in range(world.size):
        side = tmp / f"rank-{r:05d}.json"
        if not side.is_file():
            raise CheckpointError(f"{side}: rank {r} wrote no record of its file")
        rec = json.loads(side.read_text())
        files[rec["file"]] = {"bytes": rec["bytes"], "sha256": rec["sha256"]}
        rng_files[str(r)] = rec["file"]
        records.append(rec)
    tensors: dict[str, dict] = {}
    for kind in KINDS:  # parameters, then each moment; stage by stage within each
        for rec in records:
            for c in rec["chunks"]:
                if not c["tensor"].startswith(f"{kind}/"):
                    continue
                entry = tensors.setdefault(
                    c["tensor"],
                    {"global_shape": tuple(c["global_shape"]), "dtype": c["dtype"], "dim": c["dim"], "chunks": []},
                )
                entry["chunks"].append(Chunk(rec["file"], c["key"], c["start"], c["length"]))
    opt = tr.optimizer
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [n for rec in records if rec["groups"] is not None for n in rec["groups"][i]],
        }
        for i, g in enumerate(opt.param_groups)
    ]
    extra = {
        "history": tr.history,
        "config": tr.cfg.to_dict(),
        "data": {
            "seed": tr.cfg.data.seed,
            "global_batch_size": tr.cfg.data.global_batch_size,
            "seq_len": tr.cfg.data.seq_len,
        },
        **{k: v for k, v in tr.extra.items() if k in ("bos_token_id", "eos_token_id")},
    }
    tok = tr.extra.get("tokenizer")
    if tok and Path(tok).is_file():
        shutil.copyfile(tok, tmp / "tokenizer.json")
        with open(tmp / "tokenizer.json", "rb+") as f:
            os.fsync(f.fileno())
        files["tokenizer.json"] = {
            "bytes": (tmp / "tokenizer.json").stat().st_size,
            "sha256": sha256_file(tmp / "tokenizer.json"),
        }
        extra["tokenizer"] = "tokenizer.json"
    return Manifest(
        step=tr.step,
        model=asdict(tr.model_cfg),
        plan=_plan(tr),
        layout={"tp": dims.tp, "pp": dims.pp, "dp": dims.dp} | ({"ep": tr.cfg.parallel.ep} if tr.experts else {}),
        pipeline=(tr.layout or StageLayout.build(tr.model_cfg.num_layers, 1)).to_dict(),
        tensors={
            k: TensorEntry(tuple(v["global_shape"]), v["dtype"], v["dim"], tuple(v["chunks"]))
            for k, v in tensors.items()
        },
        files=files,
        optimizer={
            "type": "AdamW",
            "distributed": bool(tr.cfg.optim.distributed),
            "state_keys": list(KINDS[1:]),
            "param_groups": groups,
            "step": tr.step,
        },
        rng={"seed": tr.cfg.run.seed, "files": rng_files, "keys": ["rng/default", "rng/tp"]},
        extra=extra,
    )


def _plan(tr: Trainer) -> dict[str, str]:
    """The plan as strings; under expert parallelism each MoE block's entry says how its
    experts were stored and cut."""
    plan = plan_summary(tr.model_cfg)
    if tr.experts is not None:
        ep = tr.experts.ep.size
        for k, v in plan.items():
            if v.startswith("MixtureOfExperts"):
                plan[k] = f"moe(ep={ep}: experts stored as row blocks by ep, each expert's width split over tp)"
    return plan


def _commit(tr: Trainer, root: Path, tmp: Path, final: Path, keep_last: int) -> None:
    manifest = _manifest(tr, tmp)
    for r in range(tr.mesh.world.size):
        (tmp / f"rank-{r:05d}.json").unlink()
    write_atomic(tmp / MANIFEST, manifest.to_json().encode())  # the commit marker, written last
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    write_atomic(root / LATEST, (final.name + "\n").encode())
    for old in committed_steps(root)[:-keep_last]:
        if old != final:
            _discard(old)


def _discard(path: Path) -> None:
    trash = path.with_name(f".trash-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)  # no longer looks committed, even if the delete is cut short
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(tr: Trainer, root: str | Path, *, keep_last: int = 3) -> Path:
    """Commit a checkpoint of `tr` as root/step-<step>; collective over the whole world."""
    root = Path(root)
    world = tr.mesh.world
    final, tmp = root / step_dir_name(tr.step), root / f".tmp-{step_dir_name(tr.step)}"
    catch = (CheckpointError, OSError)

    def prepare() -> None:
        if world.rank != 0:
            return
        if final.exists():
            pointer = root / LATEST
            if pointer.is_file() and pointer.read_text().strip() == final.name:
                raise CheckpointError(
                    f"{final} already exists and is the latest checkpoint; it is never overwritten "
                    "(a run resumed from an earlier step needs its own run.out_dir)"
                )
            # Not selected by `latest`: committed by a save killed before it moved the pointer,
            # or superseded. Nothing loads it; move it out of the way.
            _discard(final)
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()

    agree(world, prepare, catch=catch, what="preparing the checkpoint")
    states = gathered_states(tr)  # collective over edp, outside agree
    blocks = expert_blocks(tr, states)  # collective over tp, outside agree
    # NOTE: under the distributed optimizer the writing gathers over dp: every rank runs every
    # gather, keeping a write error until the end (see _write_rank_file).
    agree(world, lambda: _write_rank_file(tr, tmp, blocks, states), catch=catch, what=f"writing {tmp}")
    agree(world, lambda: _commit(tr, root, tmp, final, keep_last) if world.rank == 0 else None, catch=catch)
    return final
