"""Load a Hugging Face checkpoint directory sharded: every rank reads only its slices.

    model = load_pretrained("path/to/llama", comm=tp)      # collective-free

1. config.json -> ModelConfig; tp is checked against the heads (valid sizes listed)
   before any weight is touched.
2. Every safetensors header is parsed and every needed tensor's shape checked against
   the config; unexpected tensors are refused. Still no data read.
3. The model is built on the meta device and sharded by its plan (no memory).
4. Each parameter's ShardSpec names the rows/columns this rank holds; exactly those are
   read from the memory-mapped files (partial reads) into fresh tensors.

No collective runs here, so bad input fails on every rank identically and at once.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from shardwise.comm import Communicator
from shardwise.hf.checkpoint import Checkpoint, CheckpointError
from shardwise.hf.families import Family, family_for, supported_model_types
from shardwise.hf.sources import read_shard, segments
from shardwise.layers import HeadLayout, ShardError, ShardSpec, divide, model_shard_specs
from shardwise.models.config import ModelConfig
from shardwise.sharding import parallelize

__all__ = ["load_pretrained", "read_config", "raw_config", "LoadReport", "DTYPES", "check_tp"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadReport:
    family: str
    config: object
    """A ModelConfig for shardwise's own families; the transformers config for the automatic plan."""
    param_bytes: int
    """Bytes of parameters this rank holds."""
    bytes_read: int
    """Bytes of tensor data this rank read from the checkpoint (in the checkpoint's dtype)."""


def raw_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory, as a dict."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} does not exist")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None


def read_config(path: str | Path) -> tuple[Family, ModelConfig]:
    """The family and ModelConfig of a checkpoint of a family shardwise has model code for."""
    cfg_file = Path(path) / "config.json"
    raw = raw_config(path)
    family = family_for(raw)
    if family is None:
        raise CheckpointError(
            f"{cfg_file}: model_type {raw.get('model_type')!r} has no shardwise model code; "
            f"supported: {', '.join(supported_model_types())}"
        )
    try:
        return family, family.config(raw)
    except KeyError as e:
        raise CheckpointError(f"{cfg_file}: missing field {e} for a {family.name} config") from None


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tp that cannot split this model, listing the valid sizes."""
    HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    divide(cfg.intermediate_size, tp, what="intermediate_size")


def load_pretrained(
    path: str | Path, *, comm: Communicator, dtype: str | torch.dtype | None = None, progress: bool = False
) -> tuple[nn.Module, LoadReport]:
    """Build, shard and fill a model from a Hugging Face directory; returns (model, report).

    Architectures without shardwise model code go to the automatic plan (shardwise.hf.auto).
    """
    if family_for(raw_config(path)) is None:
        from shardwise.hf.auto import load_auto

        return load_auto(path, comm=comm, dtype=dtype, progress=progress)
    family, cfg = read_config(path)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        cfg = replace(cfg, dtype=name)
    try:
        check_tp(cfg, comm.size)
    except ShardError as e:
        raise ShardError(f"{Path(path) / 'config.json'}: {e}") from None
    ckpt = Checkpoint(path)
    prefix = _prefix(ckpt, family)
    table = family.names(cfg, prefix)

    with torch.device("meta"):
        model = family.model(cfg)
    parallelize(model, family.plan(cfg), comm=comm)
    specs = model_shard_specs(model)
    if specs.keys() != table.keys():  # a bug in a family's name table, not in the checkpoint
        raise AssertionError(f"name table mismatch: {sorted(specs.keys() ^ table.keys())}")

    plan = {name: segments(ckpt, name, table[name], spec.global_shape) for name, spec in specs.items()}
    ignore = family.ignore + (("lm_head.weight",) if cfg.tie_embeddings else ())
    refuse_unexpected(ckpt, plan, ignore, what=f"a {family.name} model with num_hidden_layers={cfg.num_layers}")

    target = DTYPES[cfg.dtype]
    loaded: dict[str, torch.Tensor] = {}
    bytes_read = 0
    bar = tqdm(specs.items(), desc=f"loading shards (tp={comm.size})", unit="tensor", disable=not progress, delay=0.5)
    for name, spec in bar:
        loaded[name] = read_shard(ckpt, plan[name], spec, target)
        bytes_read += _bytes_read(spec, ckpt.info(table[name][0].name).dtype)
    ckpt.close()
    _assign(model, loaded)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model.eval(), LoadReport(family.name, cfg, param_bytes, bytes_read)


def _prefix(ckpt: Checkpoint, family: Family) -> str:
    for prefix in family.prefixes:
        if prefix + family.probe in ckpt.tensors:
            return prefix
    tried = ", ".join(repr(p + family.probe) for p in family.prefixes)
    raise CheckpointError(f"checkpoint {ckpt.path} has none of {tried}: not a {family.name} checkpoint")


def refuse_unexpected(ckpt: Checkpoint, plan: dict, ignore: tuple[str, ...], *, what: str) -> None:
    """Raise for a checkpoint tensor that no parameter reads and no ignore pattern covers."""
    used = {seg.name for segs in plan.values() for seg in segs}
    extra = sorted(n for n in ckpt.tensors if n not in used and not any(fnmatch.fnmatch(n, p) for p in ignore))
    if extra:
        first = ckpt.tensors[extra[0]].file.name
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{first}: unexpected tensor {extra[0]!r}{more}, not part of {what}: the config does not match the weights"
        )


def _bytes_read(spec: ShardSpec, dtype: torch.dtype) -> int:
    n = 1
    for d, size in enumerate(spec.local_shape):
        n *= size - spec.pad if d == spec.dim else size
    return n * torch.empty((), dtype=dtype).element_size()


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace every meta Parameter by its loaded tensor, keeping tied Parameters tied."""
    by_id: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():
        by_id[id(p)] = nn.Parameter(tensors[name], requires_grad=p.requires_grad)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[pname] = by_id[id(p)]
