"""Reading a committed checkpoint: find it, check its files, and read slices of its tensors.

Every check happens before any tensor is used, and names what is wrong: a missing or
truncated file, a SHA-256 mismatch, a key the manifest names but the file lacks.
Slices are read through safetensors' memory map (`get_slice`), so a rank reads only the
rows it needs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.checkpoint.files import dtype_from_name, sha256_file
from shardwise.checkpoint.manifest import CheckpointError, Manifest, TensorEntry
from shardwise.checkpoint.reshard import assemble_any
from shardwise.hf.checkpoint import _read_header
from shardwise.layers import ShardSpec

__all__ = ["resolve_checkpoint", "CheckpointReader", "LATEST", "MANIFEST"]

LATEST = "latest"
MANIFEST = "manifest.json"


def resolve_checkpoint(path: str | Path) -> Path:
    """A committed checkpoint directory: `path` itself, or the one its `latest` pointer names."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        target = path / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{pointer} names {name!r}, which is not a committed checkpoint in {path}")
        return target
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a directory with a {LATEST!r} pointer")


class CheckpointReader:
    """One committed checkpoint, its manifest parsed; files opened lazily."""

    def __init__(self, path: str | Path) -> None:
        self.dir = resolve_checkpoint(path)
        self.manifest = Manifest.read(self.dir / MANIFEST)
        self._handles: dict[str, object] = {}
        self._verified: set[str] = set()

    def verify(self, names: set[str] | None = None, *, hashes: bool = True) -> None:
        """Check that files exist, have the recorded size and SHA-256, and hold the keys the
        manifest places in them, with the recorded shapes (default: every file)."""
        m = self.manifest
        names = set(m.files) if names is None else names
        keys_by_file: dict[str, dict[str, tuple]] = {}
        for tname, entry in m.tensors.items():
            for c in entry.chunks:
                if c.file not in m.files:
                    raise CheckpointError(
                        f"{self.dir / 'manifest.json'}: tensor {tname!r} names unlisted file {c.file!r}"
                    )
                keys_by_file.setdefault(c.file, {})[c.key] = _chunk_shape(entry, c.length)
        for name in sorted(names - self._verified):
            path, info = self.dir / name, m.files.get(name)
            if info is None:
                raise CheckpointError(f"{self.dir}: file {name!r} is not listed in the manifest")
            if not path.is_file():
                raise CheckpointError(f"{path}: missing file of checkpoint step {m.step}")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"{path}: truncated or altered: {size} bytes, the manifest records {info['bytes']}"
                )
            if hashes and sha256_file(path) != info["sha256"]:
                raise CheckpointError(
                    f"{path}: SHA-256 mismatch: the file is corrupted (manifest {info['sha256'][:16]}...)"
                )
            if name.endswith(".safetensors"):
                header = _read_header(path)
                for key, shape in keys_by_file.get(name, {}).items():
                    if key not in header:
                        raise CheckpointError(f"{path}: missing tensor {key!r} that the manifest places there")
                    if header[key].shape != shape:
                        raise CheckpointError(
                            f"{path}: tensor {key!r} has shape {header[key].shape}, manifest says {shape}"
                        )
            self._verified.add(name)

    def files_for(self, tname: str, spec: ShardSpec | None) -> set[str]:
        """Files holding the rows of tensor `tname` that `spec` needs (all of them for None)."""
        entry = self.entry(tname)
        if spec is None or spec.dim is None or spec.dim != entry.dim:
            return {c.file for c in entry.chunks}
        want = [(s, s + n) for s, n in spec.pieces if n]
        return {c.file for c in entry.chunks if any(a < c.start + c.length and c.start < b for a, b in want)}

    def entry(self, tname: str) -> TensorEntry:
        if tname not in self.manifest.tensors:
            raise CheckpointError(f"{self.dir}: checkpoint has no tensor {tname!r}")
        return self.manifest.tensors[tname]

    def read(self, tname: str, spec: ShardSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The local tensor `spec` describes, cut from the stored chunks of `tname`."""
        entry = self.entry(tname)
        if tuple(entry.global_shape) != spec.global_shape:
            raise CheckpointError(
                f"{self.dir}: tensor {tname!r} has global shape {tuple(entry.global_shape)}, the model expects "
                f"{spec.global_shape}"
            )
        stored = dtype_from_name(entry.dtype)

        def fetch(i: int, start: int, length: int) -> torch.Tensor:
            c = entry.chunks[i]
            index = [slice(None)] * len(entry.global_shape)
            index[entry.dim] = slice(start, start + length)
            return self._slice(c.file, c.key)[tuple(index)]

        def fetch_whole(i: int) -> torch.Tensor:
            c = entry.chunks[i]
            return self._slice(c.file, c.key)[:]

        chunks = [(c.start, c.length) for c in entry.chunks]
        out = assemble_any(spec, stored, chunks, entry.dim, fetch, fetch_whole, what=f"{self.dir.name}: {tname}")
        return out if dtype is None else out.to(dtype)

    def read_key(self, file: str, key: str) -> torch.Tensor:
        return self._slice(file, key)[:]

    def _slice(self, file: str, key: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(self.dir / file), framework="pt")
        try:
            return handle.get_slice(key)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{self.dir / file}: cannot read tensor {key!r} ({e})") from None

    def close(self) -> None:
        self._handles.clear()


def _chunk_shape(entry: TensorEntry, length: int) -> tuple[int, ...]:
    shape = list(entry.global_shape)
    if entry.dim is not None:
        shape[entry.dim] = length
    return tuple(shape)
