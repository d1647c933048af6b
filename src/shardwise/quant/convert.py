"""What `--quantize` converts, and converting it: as each tensor is loaded, or a loaded model.

Converted (the choice, measured in docs/benchmarks/quantization.md):
    projections   every parallel linear: attention qkv and o, MLP up/gate and down, the
                  shared expert, the LM head (decode streams these weights every token)
    experts       each expert's up and down block (a MoE's bulk of bytes)
    embeddings    the input table (read one row per token: converted for memory; rows are
                  dequantized on lookup)
Kept in the model's dtype: norms, biases, position tables, MoE routers (tiny, and routing
decisions are sensitive to them).

Tied embeddings: the LM head needs its kernel's packed layout, the lookup needs rows, so a
tied vocabulary matrix is converted twice (int8: 2 bytes per weight where fp32 tied held 4;
fp16: 4, as fp32 tied).

    targets = conversion_targets(model, "int8")       # {param name: [Target]} on a meta model
    convert_rows(targets[name], chunks, shape)        # as the loader reads each tensor, in row blocks
    convert_param(targets[name], tensor)              # or a whole tensor at once
    quantize_model(model, "int8")                     # or all at once, for a loaded model

The loaders convert from blocks of rows (shardwise.quant.rows): an int8 weight is quantized
into its int8 buffer as each block arrives, so no float copy of a whole tensor is ever held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.layers.embedding import VocabParallelEmbedding, VocabParallelLMHead
from shardwise.layers.fused import MergedColumnParallelLinear, QKVParallelLinear
from shardwise.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardwise.layers.moe import SlicedLinear
from shardwise.models.moe import Experts
from shardwise.quant.rows import Rows
from shardwise.quant.schemes import SCHEMES
from shardwise.quant.weights import QuantizedExperts, QuantizedTable, QuantizedWeight

__all__ = [
    "Target",
    "conversion_targets",
    "convert_param",
    "convert_rows",
    "release_freed",
    "quantize_model",
    "weight_bytes",
    "quantized_bytes",
]

LINEARS = (
    ColumnParallelLinear,
    RowParallelLinear,
    QKVParallelLinear,
    MergedColumnParallelLinear,
    VocabParallelLMHead,
    SlicedLinear,
)


@dataclass(frozen=True)
class Target:
    """One place a parameter is used and what it becomes there."""

    module: nn.Module
    attr: str
    kind: str  # "linear" | "experts" | "table"
    scheme: str

    def rows(self, shape: tuple[int, int], dtype: torch.dtype, device: str | torch.device = "cpu") -> Rows:
        """The empty Rows this target is built from (filled by the caller, then convert())."""
        make = Rows.for_table if self.kind == "table" else Rows.for_weight
        return make(shape, self.scheme, dtype=dtype, device=device)

    def convert(self, t: torch.Tensor | Rows):
        if self.kind == "linear":
            return QuantizedWeight(t, self.scheme)
        if self.kind == "experts":
            return QuantizedExperts(t, self.module.num_local, self.scheme)
        return QuantizedTable(t, self.scheme)


def _kind(module: nn.Module, attr: str) -> str | None:
    if isinstance(module, LINEARS) and attr == "weight":
        return "linear"
    if isinstance(module, Experts) and attr in ("up", "down"):
        return "experts"
    if isinstance(module, VocabParallelEmbedding) and attr == "weight":
        return "table"
    return None


def conversion_targets(model: nn.Module, scheme: str) -> dict[str, list[Target]]:
    """{parameter name (as model_shard_specs names it): every Target it becomes} for the
    parameters `scheme` converts. A tied parameter has one name and two targets."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    by_id: dict[int, list[Target]] = {}
    first_name: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            first_name.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
            kind = _kind(module, attr)
            if kind is not None and not any(t.module is module and t.attr == attr for t in by_id.get(id(p), [])):
                by_id.setdefault(id(p), []).append(Target(module, attr, kind, scheme))
    uses: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    out = {}
    for pid, targets in by_id.items():
        if len(targets) != uses[pid]:  # used somewhere we do not convert: leave it whole
            continue
        out[first_name[pid]] = targets
    return out


def convert_param(targets: list[Target], t: torch.Tensor) -> None:
    """Put `t` (this rank's loaded slice) converted into each of its targets. The caller
    drops `t` afterwards; release_freed() then hands its pages back."""
    for target in targets:
        _install(target, target.convert(t))


def convert_rows(
    targets: list[Target],
    chunks: Iterable[torch.Tensor],
    shape: tuple[int, int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> None:
    """convert_param for a (rows, cols) tensor that arrives as `chunks`, blocks of its rows in
    order (float, in the model's `dtype`): each block goes into every target's Rows (a tied
    matrix: the head's and the table's) and can be freed before the next is read."""
    rows = [target.rows(shape, dtype, device) for target in targets]
    for chunk in chunks:
        for r in rows:
            r.add(chunk)
        del chunk
    for target, r in zip(targets, rows, strict=True):
        _install(target, target.convert(r))


def _install(target: Target, q) -> None:
    target.module._parameters.pop(target.attr, None)
    setattr(target.module, target.attr, q)


_LIBC = None


def release_freed() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim; a no-op elsewhere).

    Converting frees a float tensor per weight. glibc serves such sizes from its heap once
    its mmap threshold has risen past them, and the freed space, fragmented by the packed
    weights allocated in between, stays in the process: measured on a 30-layer model, the
    load's peak grew by about the converted share again. Trimming after each tensor keeps
    the peak at the converted share plus the tensor in hand."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Convert a loaded (parallelized or plain) model's weights in place, one tensor at a time."""
    params = dict(model.named_parameters())
    for name, targets in conversion_targets(model, scheme).items():
        convert_param(targets, params.pop(name).detach())
        release_freed()
    return model


def quantized_bytes(shape: tuple[int, int], scheme: str) -> int:
    """Bytes a (rows, cols) tensor takes once converted (for planning on a meta model)."""
    rows, cols = shape[0], shape[1]
    per = 2 if scheme == "fp16" else 1
    scales = 0 if scheme == "fp16" else 4 * rows
    return per * rows * cols + scales


def weight_bytes(model: nn.Module, scheme: str | None = None) -> int:
    """Bytes of weights this rank holds: parameters plus converted weights, each counted
    once. With `scheme` on an unconverted (e.g. meta) model: the bytes it would hold."""
    seen: set[int] = set()
    total = 0
    pending = conversion_targets(model, scheme) if scheme else {}
    planned = {(id(t.module), t.attr) for ts in pending.values() for t in ts}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            if (id(module), attr) in planned:
                total += quantized_bytes(tuple(p.shape), scheme)
                continue
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        for v in vars(module).values():
            if isinstance(v, QuantizedWeight | QuantizedExperts | QuantizedTable) and id(v) not in seen:
                seen.add(id(v))
                total += v.nbytes
    return total
