"""What each rank will hold of a GGUF file computed in its own block formats, known before
any rank starts: per tensor, its formats and bytes on a rank, and the row-parallel cuts
that would fall inside a block.

    layout = stored_layout(path, cfg, tp=2, rank=0)     # {param: {format: bytes}}
    check_block_cuts(path, cfg, tp=3)                   # ShardError naming the tensor and columns
    by_format(layout)                                   # {"Q4_K": bytes, "Q6_K": ..., "F32": ...}

The same arithmetic as the load (shardwise.hf.load, shardwise.hf.sources.read_shard_blocks):
a block-format matrix keeps each source's blocks (a column-parallel rank its whole rows, a
row-parallel rank its runs of whole blocks); a float source inside it becomes fp32 rows;
every other parameter is read in the model's dtype. Built on the meta device with a dry-run
communicator: no tensor data is read and no collective runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.layers import ShardError, ShardSpec, model_shard_specs

__all__ = ["stored_layout", "check_block_cuts", "by_format", "stored_summary"]

_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
_FLOAT_NAME = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _sharded_meta(cfg, tp: int, rank: int, expert_parallel: bool):
    from shardwise.comm.dryrun import DryRunCommunicator
    from shardwise.hf import FAMILIES
    from shardwise.models.meta import on_meta
    from shardwise.sharding import parallelize

    family = FAMILIES[cfg.family]
    with on_meta():
        model = family.model(cfg)
    plan = family.plan(cfg, expert_parallel=True) if expert_parallel else family.plan(cfg)
    parallelize(model, plan, comm=DryRunCommunicator(tp, rank))
    return family, model


def stored_layout(
    path: str | Path, cfg, *, tp: int, rank: int = 0, expert_parallel: bool = False
) -> dict[str, dict[str, int]]:
    """{parameter name: {format: bytes this rank holds}} for a GGUF file loaded without
    --quantize on the CPU. Raises ShardError where a row-parallel cut falls inside a block."""
    from shardwise.gguf import GGUFFile
    from shardwise.gguf.model import GGUFCheckpoint, gguf_names
    from shardwise.hf.sources import segments
    from shardwise.kernels import NATIVE_FORMATS
    from shardwise.kernels.blocks import FORMATS
    from shardwise.quant.convert import conversion_targets

    f = GGUFFile(path)
    try:
        family, model = _sharded_meta(cfg, tp, rank, expert_parallel)
        ckpt = GGUFCheckpoint(f, cfg)
        table = gguf_names(family.names(cfg, family.prefixes[0]), f)
        stored = conversion_targets(model, "int8")  # the matrices a block format can hold
        width, plain = _WIDTH[cfg.dtype], _FLOAT_NAME[cfg.dtype]
        out: dict[str, dict[str, int]] = {}
        for name, spec in model_shard_specs(model).items():
            local = torch.Size(spec.local_shape).numel()
            segs = segments(ckpt, name, table[name], spec.global_shape) if name in stored else []
            fmts = {f.tensors[s.name].type for s in segs}
            if not fmts & set(NATIVE_FORMATS):
                out[name] = {plain: width * local}
                continue
            held: dict[str, int] = {}
            pieces = list(_pieces(segs, spec))
            if spec.dim == 0 and spec.pad:  # padded vocabulary rows: zero blocks of the last piece's format
                pieces.append((pieces[-1][0], spec.pad, pieces[-1][2]))
            for seg, rows, cols in pieces:
                fmt = f.tensors[seg.name].type
                if fmt not in NATIVE_FORMATS:  # a float source inside a block matrix: fp32 rows
                    held["F32"] = held.get("F32", 0) + 4 * rows * sum(c1 - c0 for c0, c1 in cols)
                    continue
                b = FORMATS[fmt]
                full = spec.global_shape[1]
                for c0, c1 in cols:
                    if c0 % b.block or (c1 % b.block and c1 != full):
                        raise ShardError(
                            f"{Path(path)}: tensor {seg.name!r} ({fmt}, blocks of {b.block}) cannot be cut at "
                            f"columns {c0}..{c1} for rank {rank} of tp={tp}: not on a block boundary "
                            f"(its {full} columns split as {[n for _, n in spec.pieces]}); "
                            f"use a tp whose cut falls on whole blocks, or --quantize none to compute it dequantized"
                        )
                    held[fmt] = held.get(fmt, 0) + rows * (-(-c1 // b.block) - c0 // b.block) * b.nbytes
            out[name] = held
        return out
    finally:
        f.close()


def _pieces(segs, spec: ShardSpec):
    """(segment, rows this rank holds of it, [(col start, col end)]) as read_shard_blocks reads them."""
    rows, cols = spec.global_shape
    if spec.dim == 1:  # every row, this rank's runs of columns
        ranges = [(s, s + n) for s, n in spec.pieces if n]
        for seg in segs:
            yield seg, seg.length, ranges
        return
    runs = [(0, rows)] if spec.dim is None else [(s, n) for s, n in spec.pieces if n]
    for start, n in runs:
        for seg in segs:
            lo, hi = max(start, seg.offset), min(start + n, seg.offset + seg.length)
            if lo < hi:
                yield seg, hi - lo, [(0, cols)]


def check_block_cuts(path: str | Path, cfg, *, tp: int, expert_parallel: bool = False) -> None:
    """Refuse (ShardError, one line) a tp whose row-parallel cuts fall inside a block of the
    file, checked for every rank before any starts."""
    for rank in range(tp):
        stored_layout(path, cfg, tp=tp, rank=rank, expert_parallel=expert_parallel)


def by_format(layout: dict[str, dict[str, int]]) -> dict[str, int]:
    """{format: bytes} over every tensor of a stored_layout, largest first."""
    total: dict[str, int] = {}
    for held in layout.values():
        for fmt, n in held.items():
            total[fmt] = total.get(fmt, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def stored_summary(totals: dict[str, int]) -> str:
    """'Q4_K 301.2 MiB, Q6_K 98.0 MiB, F32 0.3 MiB'."""
    return ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in totals.items())
