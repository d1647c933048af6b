"""Which model a checkpoint holds, and loading it sharded: every rank reads only its slices.

    model, report = load_pretrained("path/to/llama", comm=tp)      # collective-free

resolve_model is the one place that decides between a family shardwise has model code
for (shardwise.hf.families) and the automatic plan (shardwise.hf.auto); the CLI, the
planner and load_pretrained all go through it. For a family:

1. config.json -> ModelConfig; tp is checked against the model (valid sizes listed)
   before any weight is touched.
2. Every safetensors header is parsed and every needed tensor's shape checked against
   the config; unexpected tensors are refused. Still no data read.
3. The model is built on the meta device and sharded by its plan (no memory).
4. Each parameter's ShardSpec names the rows/columns this rank holds; exactly those are
   read from the memory-mapped files (partial reads) into fresh tensors.

A GGUF file (`model.Q4_K_M.gguf`) takes the same path: its metadata gives the config
(shardwise.gguf.model). On CPU each rank keeps the projections, experts, head and table
in the file's own block formats (its rows, or its runs of whole blocks: shardwise.kernels
computes them as stored), so a rank holds its share of the file's bytes; other tensors,
and everything with --quantize or off the CPU, are dequantized from its blocks as read.

No collective runs here, so bad input fails on every rank identically and at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from shardwise.comm import Communicator
from shardwise.gguf import GGUFCheckpoint, GGUFError, GGUFFile, gguf_config, gguf_names, is_gguf
from shardwise.hf.auto import check_auto, load_auto
from shardwise.hf.checkpoint import Checkpoint, CheckpointError, raw_config
from shardwise.hf.families import Family, family_for, supported_model_types
from shardwise.hf.fill import DTYPES, LoadReport, assign, bytes_read, dtype_name, refuse_unexpected
from shardwise.hf.sources import read_shard, read_shard_blocks, read_shard_rows, segments
from shardwise.kernels import NATIVE_FORMATS, BlockWeight
from shardwise.kernels.blocks import FORMATS
from shardwise.layers import ShardError, model_shard_specs
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.meta import on_meta
from shardwise.pipeline.stage import keep_stage
from shardwise.quant.convert import (
    bytes_by_format,
    conversion_targets,
    convert_rows,
    install,
    release_freed,
    weight_bytes,
)
from shardwise.quant.schemes import NONE, check_quantize, conversion
from shardwise.sharding import parallelize
from shardwise.sharding.plans import check_tp

__all__ = ["ResolvedModel", "resolve_model", "read_config", "load_pretrained", "loaded_config", "stored_config"]


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    """The checkpoint directory (or config.json file, or GGUF file) given."""
    family: Family | None
    """The family with shardwise model code; None: the automatic plan."""
    config: ModelConfig | None
    """The family's ModelConfig; None for the automatic plan."""


def resolve_model(
    path: str | Path, *, tp: int | None = None, auto: bool = False, expert_parallel: bool = False
) -> ResolvedModel:
    """Which model `path` (a checkpoint directory, a config.json, or a *.gguf file) holds,
    checked before any weight is read.

    A model_type in FAMILIES reads its config (and, with tp, refuses a tp that cannot
    split it: a ShardError listing the valid sizes). Any other model_type is refused
    unless auto=True; then, with tp, the automatic plan is read off transformers' model
    built on the meta device, so anything it cannot shard is refused here. Raises
    CheckpointError, ShardError or NotImplementedError (a feature of the config that
    shardwise does not support). expert_parallel: the tp check is for whole experts per
    rank (tp <= num_experts), and a model without experts is refused.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model {'file' if is_gguf(path) else 'directory'} {path} does not exist")
    where = path if path.is_file() else path / "config.json"
    raw = _gguf_raw(path) if is_gguf(path) else raw_config(path)
    family = family_for(raw)
    if family is None:
        if not auto or path.is_file():
            raise CheckpointError(
                f"{where}: model_type {raw.get('model_type')!r} has no shardwise model code; "
                f"supported: {', '.join(supported_model_types())}"
            )
        if expert_parallel:
            raise ShardError(f"{where}: --expert-parallel needs a mixture-of-experts family; this model has none")
        if tp is not None:
            try:
                check_auto(path, tp)
            except ImportError as e:
                raise CheckpointError(f"{where}: the automatic plan needs transformers ({e})") from None
            except ShardError as e:
                raise ShardError(f"{where}: {e}") from None
        return ResolvedModel(path, None, None)
    try:
        cfg = family.config(raw, where=str(where))
    except CheckpointError:
        raise
    except ValueError as e:  # ModelConfig's own checks (a size < 1, ...): name the file
        raise CheckpointError(f"{where}: {e}") from None
    if tp is not None or expert_parallel:
        check_tp(cfg, tp or 1, expert_parallel=expert_parallel)
    return ResolvedModel(path, family, cfg)


def _gguf_raw(path: Path) -> dict:
    """A GGUF file's config as config.json would give it; a bad file is a CheckpointError."""
    try:
        return gguf_config(GGUFFile(path))
    except GGUFError as e:
        raise CheckpointError(str(e)) from None


def read_config(path: str | Path) -> tuple[Family, ModelConfig]:
    """The family and ModelConfig of a checkpoint of a family shardwise has model code for."""
    m = resolve_model(path)
    return m.family, m.config


def load_pretrained(
    path: str | Path,
    *,
    comm: Communicator,
    dtype: str | torch.dtype | None = None,
    progress: bool = False,
    stage: tuple | None = None,
    expert_parallel: bool = False,
    quantize: str | None = None,
) -> tuple[nn.Module, LoadReport]:
    """Build, shard and fill a model from a Hugging Face directory or a GGUF file; returns
    (model, report).

    stage = (StageLayout, pp rank): only that pipeline stage's layers (and embedding or
    head) are built and read (shardwise.pipeline.stage.keep_stage); the whole checkpoint
    is still checked against the model.

    expert_parallel: a mixture-of-experts model's layers hold whole experts per rank
    (shardwise.layers.moe) instead of every expert's slice.

    quantize: "fp16" or "int8" converts the projections, experts, LM head and embedding
    table (shardwise.quant.convert) as each tensor is read, a block of rows at a time
    (read_shard_rows): a rank never holds more than its converted share plus one block of
    float rows (plus, for fp16 on CPU, the fp32 matrix fbgemm packs from). Inference only.

    Architectures without shardwise model code go to the automatic plan (shardwise.hf.auto).
    """
    check_quantize(quantize)
    as_floats, quantize = quantize == NONE, conversion(quantize)
    m = resolve_model(path, auto=True, expert_parallel=expert_parallel)
    if m.family is None:
        if stage is not None:
            raise ShardError(
                f"{path}: pipeline stages need a model family shardwise has code for, not the automatic plan"
            )
        return load_auto(path, comm=comm, dtype=dtype, progress=progress, quantize=quantize)
    family, cfg = m.family, m.config
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype_name(dtype))
    gguf = is_gguf(path)
    try:
        check_tp(cfg, comm.size, expert_parallel=expert_parallel)
    except ShardError as e:
        raise ShardError(f"{Path(path) if gguf else Path(path) / 'config.json'}: {e}") from None
    if gguf:  # GGUF tensor names, q/k un-permuted and blocks dequantized as read
        f = GGUFFile(path)
        if not quantize and not as_floats:  # the MLP cut on the file's own blocks
            cfg = stored_config(f, cfg)
        ckpt = GGUFCheckpoint(f, cfg, dtype=DTYPES[cfg.dtype])
        table = gguf_names(family.names(cfg, family.prefixes[0]), ckpt.file)
    else:
        ckpt = Checkpoint(path)
        table = family.names(cfg, _prefix(ckpt, family))

    with on_meta():
        model = family.model(cfg)
    parallelize(model, family.plan(cfg, expert_parallel=True) if expert_parallel else family.plan(cfg), comm=comm)
    specs = model_shard_specs(model)
    if specs.keys() != table.keys():  # a bug in a family's name table, not in the checkpoint
        raise AssertionError(f"name table mismatch: {sorted(specs.keys() ^ table.keys())}")

    plan = {name: segments(ckpt, name, table[name], spec.global_shape) for name, spec in specs.items()}
    ignore = family.ignore + (("lm_head.weight",) if cfg.tie_embeddings else ())
    if gguf:  # rope_freqs: Llama 3.1 rope scaling, already in the config (gguf_config)
        ignore = ("rope_freqs.weight",)
    refuse_unexpected(ckpt, plan, ignore, what=f"a {family.name} model with num_hidden_layers={cfg.num_layers}")
    if stage is not None:
        if m.family is None or family.model is not DecoderLM:
            raise ShardError(f"pipeline stages need a decoder family; {family.name!r} is not one")
        keep_stage(model, *stage)
        specs = model_shard_specs(model)

    target = DTYPES[cfg.dtype]
    convert = conversion_targets(model, quantize) if quantize else {}
    # a GGUF file on CPU without --quantize: each block-format tensor is kept as stored
    as_stored = conversion_targets(model, "int8") if gguf and not quantize and not as_floats and _cpu(model) else {}
    loaded: dict[str, torch.Tensor] = {}
    n_read = 0
    bar = tqdm(specs.items(), desc=f"loading shards (tp={comm.size})", unit="tensor", disable=not progress, delay=0.5)
    for name, spec in bar:
        parts = read_shard_blocks(ckpt, plan[name], spec) if name in as_stored else None
        if parts is not None:  # the file's own blocks, this rank's rows or runs of whole blocks
            install(as_stored[name], BlockWeight(parts, spec.local_shape[1], dtype=target))
        elif name in convert:  # converted a block of rows at a time: no float copy of the whole
            convert_rows(convert[name], read_shard_rows(ckpt, plan[name], spec, target), spec.local_shape, dtype=target)
            release_freed()
        else:
            loaded[name] = read_shard(ckpt, plan[name], spec, target)
        n_read += bytes_read(spec, ckpt.info(table[name][0].name).dtype)
    if gguf:  # whole blocks of the file's own types, not elements
        n_read = ckpt.bytes_read
    ckpt.close()
    assign(model, loaded)
    return model.eval(), LoadReport(family.name, cfg, weight_bytes(model), n_read, bytes_by_format(model))


def loaded_config(path: str | Path, cfg: ModelConfig, quantize: str | None = None) -> ModelConfig:
    """`cfg` as load_pretrained builds the model on the CPU: a GGUF file loaded without
    --quantize computes its matrices in their own block formats (stored_config); anything
    else is as read."""
    if not is_gguf(path) or quantize is not None:
        return cfg
    f = GGUFFile(path)
    try:
        return stored_config(f, cfg)
    finally:
        f.close()


def stored_config(f: GGUFFile, cfg: ModelConfig) -> ModelConfig:
    """cfg with the file's block (the MLP's row-parallel cut falls on whole blocks) and the
    bytes per weight its matrices hold in their own formats (float matrices count as fp32)."""
    if not any(t.type in NATIVE_FORMATS for t in f.tensors.values()):
        return cfg
    held = elements = 0
    by_format: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) < 2:
            continue
        n = math.prod(t.shape)
        elements += n
        held += t.nbytes if t.type in NATIVE_FORMATS else 4 * n
        fmt = t.type if t.type in NATIVE_FORMATS else "F32"
        by_format[fmt] = by_format.get(fmt, 0) + n
    mix = tuple((k, v / max(elements, 1)) for k, v in sorted(by_format.items()))
    return replace(cfg, weight_block=weight_block(f), stored_bytes_per_weight=held / max(elements, 1),
                   stored_formats=mix)  # fmt: skip


def weight_block(f: GGUFFile) -> int:
    """The largest block of the formats computed as stored among a GGUF file's MLP down
    projections (what a row-parallel cut of them must fall on); 1 when none is."""
    blocks = [FORMATS[t.type].block for n, t in f.tensors.items() if "ffn_down" in n and t.type in NATIVE_FORMATS]
    return max(blocks, default=1)


def _cpu(model: nn.Module) -> bool:
    """Whether the model is built for the CPU (block formats compute there; elsewhere a GGUF
    file's blocks are dequantized as read)."""
    return all(p.device.type in ("cpu", "meta") for p in model.parameters())


def _prefix(ckpt: Checkpoint, family: Family) -> str:
    for prefix in family.prefixes:
        if prefix + family.probe in ckpt.tensors:
            return prefix
    tried = ", ".join(repr(p + family.probe) for p in family.prefixes)
    raise CheckpointError(f"checkpoint {ckpt.path} has none of {tried}: not a {family.name} checkpoint")
