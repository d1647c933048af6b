"""What both loaders share (family code in shardwise.hf.load, the automatic plan in
shardwise.hf.auto): the report, the dtype names, the check for unexpected checkpoint
tensors, and filling a meta model with this rank's loaded tensors."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.hf.checkpoint import Checkpoint, CheckpointError
from shardwise.layers import ShardSpec

__all__ = ["LoadReport", "DTYPES", "dtype_name", "refuse_unexpected", "bytes_read", "assign"]

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
    bytes_by_format: dict = field(default_factory=dict)
    """{format: bytes} of param_bytes ("Q4_K", "Q6_K", "F32", ...; quant.convert.bytes_by_format)."""


def dtype_name(dtype: str | torch.dtype) -> str:
    """ "float32", "bfloat16" or "float16" for a name or torch dtype; ValueError otherwise."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def refuse_unexpected(ckpt: Checkpoint, plan: dict, ignore: tuple[str, ...], *, what: str) -> None:
    """Raise for a checkpoint tensor that no parameter reads and no ignore pattern covers.

    plan: {our name: [Segment]} as from shardwise.hf.sources.segments."""
    used = {seg.name for segs in plan.values() for seg in segs}
    extra = sorted(n for n in ckpt.tensors if n not in used and not any(fnmatch.fnmatch(n, p) for p in ignore))
    if extra:
        first = ckpt.tensors[extra[0]].file.name
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{first}: unexpected tensor {extra[0]!r}{more}, not part of {what}: the config does not match the weights"
        )


def bytes_read(spec: ShardSpec, dtype: torch.dtype) -> int:
    """Bytes of checkpoint data (stored as `dtype`) that reading `spec`'s pieces touches."""
    n = 1
    for d, size in enumerate(spec.local_shape):
        n *= size - spec.pad if d == spec.dim else size
    return n * torch.empty((), dtype=dtype).element_size()


def assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace every meta Parameter by its loaded tensor, keeping tied Parameters tied."""
    by_id: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():
        by_id[id(p)] = nn.Parameter(tensors[name], requires_grad=p.requires_grad)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[pname] = by_id[id(p)]
