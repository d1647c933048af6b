"""Files on disk: a streaming safetensors writer, SHA-256, fsync, and atomic small writes.

A safetensors file is  u64 header length | JSON header | raw tensor bytes.  The header
(names, dtypes, shapes, byte offsets) depends only on metadata, so it is written first and
tensors are then streamed in one at a time: writing a file never needs all its tensors
in memory. The SHA-256 of the file is computed on the way out.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "SafetensorsWriter",
    "FileRecord",
    "sha256_file",
    "fsync_dir",
    "write_atomic",
    "DTYPE_CODES",
    "dtype_name",
    "dtype_from_name",
]

DTYPE_CODES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.bool: "BOOL",
}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class FileRecord:
    name: str
    bytes: int
    sha256: str


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` via a temporary file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class SafetensorsWriter:
    """Write a safetensors file whose tensors are declared up front and streamed in order.

    with SafetensorsWriter(path, [("a", torch.float32, (2, 3)), ...]) as w:
        w.write("a", tensor_a)
    w.record  # FileRecord(name, bytes, sha256), after fsync
    """

    def __init__(
        self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None
    ) -> None:
        self.path = Path(path)
        self._order = [key for key, _, _ in entries]
        if len(set(self._order)) != len(self._order):
            raise ValueError(f"{self.path}: duplicate tensor keys")
        self._expect = {key: (dtype, tuple(shape)) for key, dtype, shape in entries}
        header: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}} if metadata else {}
        offset = 0
        for key, dtype, shape in entries:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = hashlib.sha256()
        self._bytes = 0
        self._next = 0
        self._put(struct.pack("<Q", len(raw)) + raw)
        self.record: FileRecord | None = None

    def _put(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._bytes += len(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != key:
            want = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise ValueError(f"{self.path}: expected tensor {want!r} next, got {key!r}")
        dtype, shape = self._expect[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {key!r} declared {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            self._put(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> FileRecord:
        if self._next != len(self._order):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensor(s) were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.record = FileRecord(self.path.name, self._bytes, self._hash.hexdigest())
        return self.record

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
