"""What `--quantize` converts, and converting it: as each tensor is loaded, or a loaded model.

Converted (the choice, measured in docs/benchmarks/quantization.md):
    projections   every parallel linear: attention qkv and o, MLP up/gate and down, the
                  shared expert, the LM head (decode streams these weights every token)
    experts       each expert's up and down block (a MoE's bulk of bytes)
    embeddings    the input table (read one row per token: converted for memory; rows are
                  dequantized on lookup)
Kept in the model's dtype: norms, biases, position tables, MoE routers (tiny, and routing
decisions are sensitive to them).

Tied embeddings: a block-format matrix (int8 = Q8_0 and the other block schemes on CPU)
serves both the LM head's kernel and the lookup's rows, so it is converted once and held
once. fp16 needs its kernel's packed layout for the head and rows for the lookup, so a tied
fp16 matrix is converted twice (4 bytes per weight, as fp32 tied).

    targets = conversion_targets(model, "int8")       # {param name: [Target]} on a meta model
    convert_rows(targets[name], chunks, shape)        # as the loader reads each tensor, in row blocks
    convert_param(targets[name], tensor)              # or a whole tensor at once
    quantize_model(model, "int8")                     # or all at once, for a loaded model

The loaders convert from blocks of rows (shardwise.kernels.rows): a weight is quantized
into its block buffer as each block of rows arrives, so no float copy of a whole tensor is ever held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.kernels import BlockWeight, Part
from shardwise.kernels.blocks import FORMATS
from shardwise.kernels.packed import QuantizedExperts, QuantizedTable, QuantizedWeight
from shardwise.kernels.rows import Rows, block_format
from shardwise.layers.embedding import VocabParallelEmbedding, VocabParallelLMHead
from shardwise.layers.fused import MergedColumnParallelLinear, QKVParallelLinear
from shardwise.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardwise.layers.moe import SlicedLinear
from shardwise.models.moe import Experts
from shardwise.quant.schemes import SCHEMES

__all__ = [
    "Target",
    "bytes_by_format",
    "empty_rows",
    "quantize_weight",
    "conversion_targets",
    "convert_param",
    "convert_rows",
    "install",
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
        return empty_rows(shape, self.scheme, self.kind, dtype=dtype, device=device)

    def convert(self, t: torch.Tensor | Rows):
        return quantize_weight(t, self.scheme, self.kind, num_experts=getattr(self.module, "num_local", 1))


def empty_rows(shape, scheme: str, kind: str = "linear", *, dtype=torch.float32, device="cpu") -> Rows:
    """The empty Rows a weight of `kind` ("linear", "experts", "table") in `scheme` is built from."""
    make = Rows.for_table if kind == "table" else Rows.for_weight
    return make(shape, scheme, dtype=dtype, device=device)


def quantize_weight(t: torch.Tensor | Rows, scheme: str, kind: str = "linear", *, num_experts: int = 1):
    """A float matrix (or its filled Rows) converted to `scheme` for use as `kind`: a
    BlockWeight where the scheme is a block format on this device (one object serves a
    linear, experts narrowed per expert, and a table), else a QuantizedWeight,
    QuantizedExperts or QuantizedTable."""
    if isinstance(t, torch.Tensor):
        t = Rows.of(t, empty_rows(tuple(t.shape), scheme, kind, dtype=t.dtype, device=t.device))
    if t.kind == "blocks":
        return BlockWeight([Part(t.fmt, t.done().data)], t.shape[1], dtype=t.dtype)
    if kind == "linear":
        return QuantizedWeight(t, scheme)
    if kind == "experts":
        return QuantizedExperts(t, num_experts, scheme)
    return QuantizedTable(t, scheme)


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
    if len(rows) > 1 and all(r.kind == "blocks" and r.fmt == rows[0].fmt for r in rows):
        rows = rows[:1]  # a tied matrix in one block format: one copy serves head and table
    for chunk in chunks:
        for r in rows:
            r.add(chunk)
        del chunk
    if len(rows) == 1 and len(targets) > 1:
        w = targets[0].convert(rows[0])
        for target in targets:
            _install(target, w)
        return
    for target, r in zip(targets, rows, strict=True):
        _install(target, target.convert(r))


def install(targets: list[Target], w) -> None:
    """Put one converted weight (e.g. a GGUF file's own blocks) into every target it serves."""
    for target in targets:
        _install(target, w)


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


def quantized_bytes(shape: tuple[int, int], scheme: str, device: str | torch.device = "cpu") -> int:
    """Bytes a (rows, cols) tensor takes once converted (for planning on a meta model)."""
    rows, cols = shape[0], shape[1]
    fmt = block_format(scheme, device)
    if fmt is not None:
        f = FORMATS[fmt]
        return rows * -(-cols // f.block) * f.nbytes
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
                if block_format(scheme) is not None:  # a tied block-format matrix is held once
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                total += quantized_bytes(tuple(p.shape), scheme)
                continue
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        for v in vars(module).values():
            if isinstance(v, BlockWeight | QuantizedWeight | QuantizedExperts | QuantizedTable) and id(v) not in seen:
                seen.add(id(v))
                total += v.nbytes
    return total


_FLOAT_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def bytes_by_format(model: nn.Module) -> dict[str, int]:
    """{format: bytes} of what this rank holds, each tensor once, largest first: block-format
    parts by their GGUF type ("Q4_K", ...), float parameters by dtype ("F32"), fbgemm or CUDA
    packed weights as "fp16" / "int8". Sums to weight_bytes(model)."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def add(fmt: str, n: int) -> None:
        out[fmt] = out.get(fmt, 0) + n

    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                add(_FLOAT_NAMES.get(p.dtype, str(p.dtype)), p.numel() * p.element_size())
        for v in vars(module).values():
            if id(v) in seen:
                continue
            if isinstance(v, BlockWeight):
                seen.add(id(v))
                for part in v.parts:
                    add(part.fmt, part.nbytes)
            elif isinstance(v, QuantizedWeight | QuantizedExperts | QuantizedTable):
                seen.add(id(v))
                add(getattr(v, "scheme", type(v).__name__), v.nbytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
