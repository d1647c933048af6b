"""Where each of our parameters comes from in a Hugging Face checkpoint, and how to read
just one rank's slice of it.

Our unsharded ("global") tensor is the concatenation along dim 0 of one or more
checkpoint tensors, each possibly transposed (GPT-2's Conv1D stores (in, out)) or
stored per head interleaved (GPT-NeoX's [h0: q k v | h1: q k v | ...]). A ShardSpec
names row or column ranges of the global tensor; `read_shard` maps those ranges back
onto the checkpoint tensors and reads only them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardwise.hf.checkpoint import Checkpoint, CheckpointError
from shardwise.kernels import NATIVE_FORMATS, Part
from shardwise.layers import ShardSpec
from shardwise.memory import empty_huge

__all__ = ["Src", "Segment", "segments", "read_shard", "read_shard_rows", "read_shard_blocks", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 20
"""Elements per block of rows read_shard_rows yields by default (4 MiB of float32)."""


@dataclass(frozen=True)
class Src:
    """One checkpoint tensor contributing rows to one of our parameters."""

    name: str
    rows: int | None = None
    """Rows it must contribute (checked against its shape); None = whatever it holds."""
    transposed: bool = False
    """Stored as (in, out): our rows are its columns (GPT-2 Conv1D)."""
    heads: int = 0
    """> 0: rows stored per head, [h0: part0 part1 .. | h1: ...] (GPT-NeoX's fused qkv)."""
    parts: int = 1
    """Parts per head in a head-interleaved tensor (3 for q, k, v)."""
    start: int | None = None
    """First row it contributes (with `rows` set): one expert's block of a stacked tensor
    (GGUF's ffn_*_exps, (E, I, H) read as E * I rows); None: the whole tensor."""


@dataclass(frozen=True)
class Segment:
    """Global rows [offset, offset + length) = rows [src_start, src_start + length) of `name`."""

    name: str
    offset: int
    src_start: int
    length: int
    transposed: bool


def segments(ckpt: Checkpoint, param: str, sources: list[Src], global_shape: tuple[int, ...]) -> list[Segment]:
    """Expand sources into row segments, checking every shape against `global_shape`."""
    segs: list[Segment] = []
    offset = 0
    for src in sources:
        info = ckpt.info(src.name, needed_for=param)
        shape = info.shape[::-1] if src.transposed and len(info.shape) == 2 else info.shape
        where = f"{info.file.name}: tensor {src.name!r} (for {param})"
        if len(shape) != len(global_shape) or tuple(shape[1:]) != tuple(global_shape[1:]):
            want = ("rows", *global_shape[1:]) if len(sources) > 1 else global_shape
            raise CheckpointError(f"{where} has shape {info.shape}, expected {want} from config.json")
        rows = shape[0]
        if src.start is not None:  # a block of rows of a stacked tensor
            if src.rows is None or src.start + src.rows > rows:
                raise CheckpointError(
                    f"{where} has {rows} rows, too few for rows {src.start}..{src.start + (src.rows or 0)}"
                )
            rows = src.rows
        elif src.rows is not None and rows != src.rows:
            raise CheckpointError(f"{where} has {rows} rows, expected {src.rows} from config.json")
        if src.heads:
            hd = rows // (src.heads * src.parts)
            if hd * src.heads * src.parts != rows:
                raise CheckpointError(f"{where}: {rows} rows do not split into {src.heads} heads x {src.parts} parts")
            for part in range(src.parts):
                for h in range(src.heads):
                    segs.append(Segment(src.name, offset, (h * src.parts + part) * hd, hd, False))
                    offset += hd
        else:
            segs.append(Segment(src.name, offset, src.start or 0, rows, src.transposed))
            offset += rows
    if offset != global_shape[0]:
        names = ", ".join(s.name for s in sources)
        raise CheckpointError(
            f"{names} hold {offset} rows for {param}, but config.json implies {global_shape[0]} "
            f"(global shape {global_shape}): the config does not match the weights"
        )
    return segs


def _read_rows(ckpt: Checkpoint, segs: list[Segment], region: list[slice]) -> torch.Tensor:
    rows, out = region[0], []
    for seg in segs:
        lo, hi = max(rows.start, seg.offset), min(rows.stop, seg.offset + seg.length)
        if lo >= hi:
            continue
        src_rows = slice(seg.src_start + lo - seg.offset, seg.src_start + hi - seg.offset)
        if len(region) == 1:
            out.append(ckpt.read(seg.name, (src_rows,)))
        elif seg.transposed:
            out.append(ckpt.read(seg.name, (region[1], src_rows)).t())
        else:
            out.append(ckpt.read(seg.name, (src_rows, *region[1:])))
    return torch.cat(out, dim=0) if len(out) > 1 else out[0]


def read_shard(ckpt: Checkpoint, segs: list[Segment], spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
    """This rank's local tensor for `spec`, reading only its pieces from the checkpoint.

    The reads are views of the memory-mapped file; the result is copied exactly once into
    memory the rank owns, so parameters never alias the checkpoint file (which could be
    rewritten or truncated under a running job).
    """
    full = [slice(0, n) for n in spec.global_shape]
    if spec.dim is None:
        parts = [_read_rows(ckpt, segs, full)]
    else:
        parts = []
        for start, n in spec.pieces:
            if n == 0:
                continue
            region = list(full)
            region[spec.dim] = slice(start, start + n)
            parts.append(_read_rows(ckpt, segs, region))
        if spec.pad:
            shape = list(spec.global_shape)
            shape[spec.dim] = spec.pad
            parts.append(torch.zeros(shape, dtype=dtype))
    return _fresh(ckpt, parts, dtype, spec.dim or 0)


def read_shard_rows(
    ckpt: Checkpoint, segs: list[Segment], spec: ShardSpec, dtype: torch.dtype, *, max_elements: int | None = None
) -> Iterator[torch.Tensor]:
    """This rank's local 2-D tensor for `spec` (what read_shard returns) as blocks of its rows,
    in order, each a fresh tensor of at most max(max_elements, one row) elements
    (CHUNK_ELEMENTS by default): a converter that needs one row at a time (per-row int8
    scales) never holds the whole."""
    rows, cols = spec.local_shape
    if len(spec.global_shape) != 2:
        raise ValueError(f"read_shard_rows reads 2-D tensors, got global shape {spec.global_shape}")
    if rows * cols == 0:  # nothing to read (a rank with no columns of a row-parallel matrix)
        yield torch.zeros(rows, cols, dtype=dtype)
        return
    step = max(1, (max_elements or CHUNK_ELEMENTS) // cols)
    if spec.dim == 0:  # whole rows: the pieces' rows in order, then the padding
        runs = [(start, n) for start, n in spec.pieces if n]
        col_ranges = [slice(0, cols)]
    else:  # every row, cut to this rank's columns (dim None: all of them)
        runs = [(0, spec.global_shape[0])]
        col_ranges = [slice(s, s + n) for s, n in spec.pieces if n] if spec.dim == 1 else [slice(0, cols)]
    pad = spec.pad if spec.dim == 1 else 0
    for start, n in runs:
        for r in range(start, start + n, step):
            # NOTE: yielded straight from the call: no local of this frame keeps the block
            # alive while the next one is read
            yield _row_block(ckpt, segs, slice(r, min(r + step, start + n)), col_ranges, pad, dtype)
    if spec.dim == 0:
        for r in range(0, spec.pad, step):
            yield torch.zeros(min(step, spec.pad - r), cols, dtype=dtype)


def _row_block(
    ckpt: Checkpoint, segs: list[Segment], rows: slice, col_ranges: list[slice], pad: int, dtype: torch.dtype
) -> torch.Tensor:
    """Global rows `rows`, cut to `col_ranges` (joined) and `pad` zero columns, as a fresh tensor."""
    parts = [_read_rows(ckpt, segs, [rows, c]) for c in col_ranges]
    if pad:
        parts.append(torch.zeros(rows.stop - rows.start, pad, dtype=dtype))
    return _fresh(ckpt, parts, dtype, 1)


def _fresh(ckpt: Checkpoint, parts: list[torch.Tensor], dtype: torch.dtype, dim: int) -> torch.Tensor:
    """parts joined along `dim` into memory the rank owns, copied exactly once: the reads are
    views of the memory-mapped file, or fresh tensors from a reader that makes them (GGUF)."""
    fresh = getattr(ckpt, "fresh_reads", False)
    if len(parts) == 1 and (fresh or parts[0].dim() == 0):
        return parts[0].to(dtype, copy=not fresh, memory_format=torch.contiguous_format)
    return _joined(parts, dtype, dim)


def _joined(parts: list[torch.Tensor], dtype: torch.dtype, dim: int) -> torch.Tensor:
    """parts joined along `dim` in `dtype`, copied once into fresh memory: on huge pages where
    2 MiB or more (shardwise.memory.empty_huge), as weights a decode step streams every token."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.cat([p.to(dtype) for p in parts], dim=dim, out=empty_huge(tuple(shape), dtype))


def read_shard_blocks(ckpt, segs: list[Segment], spec: ShardSpec) -> list[Part] | None:
    """This rank's local 2-D tensor for `spec` kept in its sources' own block formats: Parts
    along the rows (shardwise.kernels.block), one per run of rows from sources of one
    format, each (rows, blocks * bytes) uint8; a source stored as floats (F16/F32) gives a
    float part. None when no source is a block format (the caller reads floats).

    `ckpt` is a GGUFCheckpoint (format_of, read_raw). A column-parallel rank holds whole
    rows of blocks; a row-parallel rank's columns must start and end on block boundaries
    (GGUFFile.read_raw refuses a cut inside a block, naming the numbers)."""
    fmts = {ckpt.format_of(s.name) for s in segs}
    if not fmts & set(NATIVE_FORMATS):
        return None
    if len(spec.global_shape) != 2 or any(s.transposed for s in segs):
        raise CheckpointError(f"block-format sources of a {spec.global_shape} tensor must be untransposed matrices")
    rows, cols = spec.global_shape
    pieces: list[tuple[str, torch.Tensor]] = []

    def read(seg: Segment, lo: int, hi: int, col_ranges: list[slice]) -> None:
        src_rows = slice(seg.src_start + lo - seg.offset, seg.src_start + hi - seg.offset)
        fmt = ckpt.format_of(seg.name)
        if fmt in NATIVE_FORMATS:
            got = [ckpt.read_raw(seg.name, (src_rows, c)) for c in col_ranges]
        else:
            fmt, got = "F32", [ckpt.read(seg.name, (src_rows, c)).float() for c in col_ranges]
        pieces.append((fmt, torch.cat(got, dim=1) if len(got) > 1 else got[0]))

    if spec.dim == 1:  # every row, this rank's runs of columns
        col_ranges = [slice(s, s + n) for s, n in spec.pieces if n]
        for seg in segs:
            read(seg, seg.offset, seg.offset + seg.length, col_ranges)
        if spec.pad:
            raise CheckpointError(
                f"a block-format tensor of shape {spec.global_shape} cannot take {spec.pad} padding columns"
            )
    else:  # whole rows: this rank's row ranges (all of them when replicated)
        runs = [(0, rows)] if spec.dim is None else [(s, n) for s, n in spec.pieces if n]
        for start, n in runs:
            for seg in segs:
                lo, hi = max(start, seg.offset), min(start + n, seg.offset + seg.length)
                if lo < hi:
                    read(seg, lo, hi, [slice(0, cols)])
        if spec.dim == 0 and spec.pad:  # padded vocabulary rows: zero blocks decode to zero weights
            fmt, last = pieces[-1]
            pieces.append((fmt, last.new_zeros(spec.pad, last.shape[1])))
    runs: list[tuple[str, list[torch.Tensor]]] = []  # consecutive pieces of one format, joined once
    for fmt, data in pieces:
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(data)
        else:
            runs.append((fmt, [data]))
    return [Part(fmt, _joined(run, run[0].dtype, 0)) for fmt, run in runs]
