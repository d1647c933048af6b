"""A GGUF file (llama.cpp's format), read a row range and column range at a time.

    f = GGUFFile("model.Q8_0.gguf")
    f.get("llama.block_count")               # 32
    f.read_block_range("blk.0.attn_q.weight", rows=slice(0, 128), cols=slice(100, 300))

The header (metadata, tensor names, types, shapes, offsets) is parsed here, directly off
the memory-mapped file: array values (a vocabulary of 150k strings) are only skipped
over until asked for, so opening a file costs milliseconds on every rank, where the `gguf`
package's reader parses every string of every array. Every tensor's type is checked
against the formats shardwise decodes and its bytes against the file's end before any
data is read, so an unsupported type or a truncated file fails here with one line.
A read copies out only the bytes of the requested rows and of the whole blocks that
overlap the requested columns, dequantizes them in chunks of rows, and trims the
columns: a rank whose column range does not start on a block boundary (an uneven
row-parallel split) reads the blocks it shares with its neighbour, nothing more.

Shapes here are torch's: (rows, cols) = (output features, input features), the reverse
of ggml's ne[] order.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.kernels.blocks import FORMATS, Format, dequantize_blocks

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "is_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value types with a fixed size (8 is a string, 9 an array)."""
_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
"""ggml's type ids (ggml.h), for naming the ones shardwise cannot read."""
_MAX_DIMS = 4
"""GGML_MAX_DIMS."""
_MAX_PER_BYTE = 64
"""Elements a byte of the file can hold at most (ternary types: about 4 per byte); a shape
above this times the file size is corrupt, and refused before its byte count is computed."""
_CHUNK = 1 << 22
"""Weights dequantized at a time (the float temporaries of a chunk are a few times this)."""


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file (and tensor)."""


def is_gguf(path: str | Path) -> bool:
    """A path to load as a GGUF file: a file named *.gguf."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and not path.is_dir()


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str
    """The ggml type name, e.g. "Q8_0"."""
    shape: tuple[int, ...]
    """torch order: (rows, cols) for a matrix."""
    offset: int
    """Byte offset of its data in the file."""

    @property
    def fmt(self) -> Format:
        return FORMATS[self.type]

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.fmt.block * self.fmt.nbytes

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        return rows * self.row_bytes


class GGUFFile:
    """Metadata and tensors of one GGUF file; reads copy out of its memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        infos, data_start = self._parse_header()
        self.tensors: dict[str, GGUFTensor] = {}
        unsupported: dict[str, str] = {}
        for name, shape, kind_id, offset in infos:
            kind = _GGML_TYPES.get(kind_id, f"type {kind_id}")
            if kind not in FORMATS:
                unsupported.setdefault(kind, name)
                continue
            info = GGUFTensor(name, kind, shape, data_start + offset)
            if not shape or shape[-1] % info.fmt.block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} of type {kind} has shape {shape}: rows are not whole "
                    f"blocks of {info.fmt.block}"
                )
            if info.offset + info.nbytes > size:
                raise GGUFError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                    f"the file has {size}"
                )
            self.tensors[name] = info
        if unsupported:
            kind, name = next(iter(unsupported.items()))
            raise GGUFError(
                f"{self.path}: tensor {name!r} has quantization type {kind}, which shardwise cannot read; "
                f"supported: {', '.join(FORMATS)}"
            )
        self._data = np.frombuffer(self._mm, dtype=np.uint8)

    def _corrupt(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path}: corrupt GGUF header: {why}")

    def _unpack(self, fmt: str, pos: int, what: str) -> tuple:
        """struct.unpack_from(fmt) at `pos`, or a GGUFError naming `what` when the file ends first."""
        n = struct.calcsize(fmt)
        if pos + n > len(self._mm):
            raise GGUFError(
                f"{self.path}: truncated GGUF header: {what} at byte {pos} needs {n} bytes, "
                f"the file has {len(self._mm)}"
            )
        return struct.unpack_from(fmt, self._mm, pos)

    def _parse_header(self) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        """(tensor infos (name, torch shape, ggml type id, data offset), start of the data);
        metadata values are recorded by offset in self._fields. Every count and length is
        checked against the bytes left before it is used: a corrupt header fails here, in
        one line naming what is wrong, never with a struct or decoding error."""
        (version,) = self._unpack("<I", 4, "the version")
        if version not in _VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version}; shardwise reads versions {_VERSIONS}")
        n_tensors, n_kv = self._unpack("<QQ", 8, "the tensor and metadata counts")
        pos, size = 24, len(self._mm)
        for count, what, least in ((n_kv, "metadata entries", 13), (n_tensors, "tensors", 24)):
            if count * least > size - pos:  # each takes at least `least` bytes
                raise GGUFError(
                    f"{self.path}: truncated or corrupt GGUF header: {count} {what} cannot fit in a file of {size} bytes"
                )
        self._fields: dict[str, tuple[int, int]] = {}  # key -> (value type, offset of the value)
        for i in range(n_kv):
            key, pos = self._string(pos, f"metadata key {i}")
            (kind,) = self._unpack("<I", pos, f"the type of metadata {key!r}")
            if key in self._fields:
                raise self._corrupt(f"metadata key {key!r} appears twice")
            self._fields[key] = (kind, pos + 4)
            pos = self._skip(kind, pos + 4, f"metadata {key!r}")
        infos, seen = [], set()
        for i in range(n_tensors):
            name, pos = self._string(pos, f"tensor name {i}")
            if name in seen:
                raise self._corrupt(f"tensor {name!r} appears twice")
            seen.add(name)
            (n_dims,) = self._unpack("<I", pos, f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise self._corrupt(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1-{_MAX_DIMS}")
            dims = self._unpack(f"<{n_dims}Q", pos + 4, f"the shape of tensor {name!r}")
            kind, offset = self._unpack("<IQ", pos + 4 + 8 * n_dims, f"the type and offset of tensor {name!r}")
            pos += 4 + 8 * n_dims + 12
            if math.prod(dims) > size * _MAX_PER_BYTE:
                raise self._corrupt(f"tensor {name!r} has shape {tuple(reversed(dims))}, larger than the file")
            infos.append((name, tuple(int(d) for d in reversed(dims)), kind, offset))
        align = self.get("general.alignment", 32)
        if type(align) is not int or align < 1 or align & (align - 1):
            raise self._corrupt(f"general.alignment is {align!r}, not a power of two")
        for name, _, _, offset in infos:
            if offset % align:
                raise self._corrupt(f"tensor {name!r} starts at data offset {offset}, not a multiple of {align}")
        return infos, -(-pos // align) * align

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        (n,) = self._unpack("<Q", pos, f"the length of {what}")
        if pos + 8 + n > len(self._mm):
            raise GGUFError(
                f"{self.path}: truncated GGUF header: {what} at byte {pos} is {n} bytes long, "
                f"past the end of the file ({len(self._mm)} bytes)"
            )
        raw = self._mm[pos + 8 : pos + 8 + n]
        try:
            return raw.decode("utf-8"), pos + 8 + n
        except UnicodeDecodeError as e:
            raise self._corrupt(f"{what} at byte {pos} is not UTF-8 (byte {raw[e.start]:#04x} at {e.start})") from None

    def _skip(self, kind: int, pos: int, what: str) -> int:
        """The offset after a value of type `kind` at `pos`, checked to lie within the file."""
        if kind in _SCALARS:
            end = pos + struct.calcsize(_SCALARS[kind])
        elif kind == 8:
            end = pos + 8 + self._unpack("<Q", pos, f"the length of {what}")[0]
        elif kind == 9:
            item, count = self._unpack("<IQ", pos, f"the item type and count of {what}")
            pos += 12
            if item in _SCALARS:
                end = pos + count * struct.calcsize(_SCALARS[item])
            elif item in (8, 9):
                if count * (8 if item == 8 else 12) > len(self._mm) - pos:
                    raise self._corrupt(f"{what} has {count} items, more than the file can hold")
                for i in range(count):
                    pos = self._skip(item, pos, f"item {i} of {what}")
                end = pos
            else:
                raise self._corrupt(f"{what} is an array of unknown value type {item}")
        else:
            raise self._corrupt(f"{what} has unknown value type {kind} (at byte {pos})")
        if end > len(self._mm):
            raise GGUFError(
                f"{self.path}: truncated GGUF header: {what} at byte {pos} ends at byte {end}, "
                f"the file has {len(self._mm)}"
            )
        return end

    def _value(self, kind: int, pos: int, what: str):
        if kind in _SCALARS:
            return struct.unpack_from(_SCALARS[kind], self._mm, pos)[0]
        if kind == 8:
            return self._string(pos, what)[0]
        item, count = struct.unpack_from("<IQ", self._mm, pos)
        pos += 12
        if item in _SCALARS:
            return list(struct.unpack_from(f"<{count}{_SCALARS[item][1]}", self._mm, pos))
        out = []
        for i in range(count):
            out.append(self._value(item, pos, f"item {i} of {what}"))
            pos = self._skip(item, pos, what)
        return out

    def get(self, key: str, default=None):
        """Metadata value `key` (a str, a number, or a list of them); parsed on demand, as a
        vocabulary's fields alone can hold hundreds of thousands of strings."""
        field = self._fields.get(key)
        return default if field is None else self._value(*field, f"metadata {key!r}")

    def keys(self) -> list[str]:
        return [k for k in self._fields if not k.startswith("GGUF.")]

    def read_block_range(
        self, name: str, rows: slice | None = None, cols: slice | None = None, *, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows `rows` and columns `cols` of tensor `name` as a fresh tensor of `dtype` (torch
        shape); a 1-D tensor takes `rows` as its only index, and a tensor of 3 or more
        dimensions is read as the matrix of all its rows (stacked experts (E, I, H): E * I
        rows of H). Reads whole blocks only, and converts chunk by chunk: no float32 copy of
        the whole range is ever held."""
        t = self.tensors[name]
        n_rows = math.prod(t.shape[:-1])
        n_cols = t.shape[-1]
        if len(t.shape) == 1:
            rows, cols = None, rows
        r0, r1, _ = (rows or slice(None)).indices(n_rows)
        c0, c1, _ = (cols or slice(None)).indices(n_cols)
        fmt = t.fmt
        b0, b1 = c0 // fmt.block, -(-c1 // fmt.block)  # whole blocks overlapping [c0, c1)
        out = torch.empty(max(r1 - r0, 0), c1 - c0, dtype=dtype)
        step = max(1, _CHUNK // max(1, (b1 - b0) * fmt.block))
        mm = self._data[t.offset : t.offset + n_rows * t.row_bytes].reshape(n_rows, t.row_bytes)
        for r in range(r0, r1, step):
            e = min(r + step, r1)
            raw = torch.from_numpy(np.array(mm[r:e, b0 * fmt.nbytes : b1 * fmt.nbytes]))  # a copy
            out[r - r0 : e - r0] = dequantize_blocks(raw, fmt)[:, c0 - b0 * fmt.block : c1 - b0 * fmt.block]
        return out if len(t.shape) > 1 else out.reshape(-1)

    def read_raw(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows `rows` and columns `cols` of matrix `name` as its own blocks, undecoded: a
        fresh (rows, blocks * bytes per block) uint8 tensor. The columns must start and end
        on block boundaries (the caller checked the split; a GGUFError names the numbers)."""
        t = self.tensors[name]
        n_rows, n_cols, fmt = math.prod(t.shape[:-1]), t.shape[-1], t.fmt
        r0, r1, _ = (rows or slice(None)).indices(n_rows)
        c0, c1, _ = (cols or slice(None)).indices(n_cols)
        if c0 % fmt.block or (c1 % fmt.block and c1 != n_cols):
            raise GGUFError(
                f"{self.path}: tensor {name!r} ({t.type}, blocks of {fmt.block}) cannot be cut at columns "
                f"{c0}..{c1}: not on a block boundary"
            )
        b0, b1 = c0 // fmt.block, -(-c1 // fmt.block)
        mm = self._data[t.offset : t.offset + n_rows * t.row_bytes].reshape(n_rows, t.row_bytes)
        return torch.from_numpy(np.array(mm[r0:r1, b0 * fmt.nbytes : b1 * fmt.nbytes]))  # a copy

    def bytes_of(self, name: str, rows: slice | None = None, cols: slice | None = None) -> int:
        """Bytes of the file that read_block_range(name, rows, cols) copies."""
        t = self.tensors[name]
        if len(t.shape) == 1:
            rows, cols = slice(0, 1), rows
        r0, r1, _ = (rows or slice(None)).indices(math.prod(t.shape[:-1]))
        c0, c1, _ = (cols or slice(None)).indices(t.shape[-1])
        fmt = t.fmt
        return max(r1 - r0, 0) * (-(-c1 // fmt.block) - c0 // fmt.block) * fmt.nbytes

    def close(self) -> None:
        self._data = None
        with contextlib.suppress(BufferError):  # a view is still alive: the map closes with it
            self._mm.close()
