"""A Hugging Face safetensors checkpoint on disk, read a slice at a time.

Handles a single `model.safetensors` and sharded `model.safetensors.index.json`
checkpoints. Every file's header is parsed and checked up front (JSON only, never
pickle), so a missing shard, a truncated file or an unknown tensor fails with the file
and tensor named before any rank reads data. Reads go through safetensors'
`get_slice`, which copies only the requested slice out of the memory-mapped file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["Checkpoint", "CheckpointError", "TensorInfo", "raw_config"]

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


def raw_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory (or that file itself), as a dict."""
    path = Path(path)
    cfg_file = path if path.is_file() else path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} does not exist")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


class Checkpoint:
    """The tensors of a checkpoint directory: names, shapes, dtypes, and slice reads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            for name, info in _read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {self.tensors[name].file.name} and {file.name}"
                    )
                self.tensors[name] = info
        self._handles: dict[Path, object] = {}

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).exists()]
            if missing:
                raise CheckpointError(
                    f"{index.name} lists shard file(s) missing from {self.path}: {', '.join(missing)}"
                )
            return [self.path / f for f in files]
        if single.exists():
            return [single]
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if found:
            return [self.path / f for f in found]
        pickled = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickled)}: pickle files are never loaded; convert them to safetensors)"
            if pickled
            else ""
        )
        raise CheckpointError(f"no *.safetensors weights in {self.path}{hint}")

    def info(self, name: str, *, needed_for: str = "") -> TensorInfo:
        if name not in self.tensors:
            why = f" (needed for {needed_for})" if needed_for else ""
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}{why}")
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or only `index` of it (one slice per dim), copied from the mmap."""
        info = self.info(name)
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        sl = handle.get_slice(name)
        return sl[index] if index is not None else sl[:]

    def close(self) -> None:
        self._handles.clear()


def _read_header(file: Path) -> dict[str, TensorInfo]:
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: truncated (only {size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{file}: truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    data_bytes = size - 8 - n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        end = meta["data_offsets"][1]
        if end > data_bytes:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of the data, but the file holds {data_bytes}"
            )
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        out[name] = TensorInfo(file, _DTYPES[meta["dtype"]], tuple(meta["shape"]))
    return out
