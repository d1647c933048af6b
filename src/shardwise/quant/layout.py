"""fp32 weights on CPU: the memory order their one- and two-row products run fastest in.

    decode_layout(model, rows=1)     # before decoding `rows` sequences at a time; inference only

PyTorch's fp32 `F.linear` runs on MKL. On this project's AMD AVX2 machine MKL streams a
row-major (out, in) weight at 5-7 GB/s when it multiplies one row, where the same product
with the weight stored column-major (the transposed matrix contiguous, so MKL reads it as
x @ W^T without a transpose) runs at 10-14 GB/s for the wide matrices of a decoder (qkv,
gate/up, the LM head: out >= in), and slower for the tall ones (down: in > out). At four
rows and more the column-major order loses by 10-20%. Measured by benchmarks/bench_layout.py
(docs/benchmarks/quantization.md): a decode step of the 30-layer, width-576 model
takes 17% less CPU time for one sequence, 35% less for two.

So for decoding one or two sequences at a time on that path, each CPU fp32 projection weight with
out >= in is re-strided in place to column-major: the Parameter keeps its shape, values
and name (state_dict, checkpoints and every shape check see the same tensor), only its
strides change, one tensor at a time. Quantized weights (their own kernels), experts
(stacked blocks), bf16 (no measured gain) and anything off the CPU are left alone. The
layers call F.linear as before; MKL takes the strides as given.

Where the native decode step runs the layers instead (shardwise.models.step.refusal: None),
their weights stay row-major (the LM head, outside the step, is still re-strided): its fp32 kernel (csrc/f32.c) keeps each output's sum in registers over
a row-major weight, where the column-major one adds into the output rows in memory eight
inputs at a time; on the AMD Zen 3 (AVX2) of docs/benchmarks/links.md it streamed one row
through the built-in model's matrices at 40-65 GB/s row-major against 25 column-major, through
1B-sized ones at 17-35 against 13-20, and `generate`'s step took 0.9-2.0 ms against 1.3-3.5
(benchmarks/bench_fp32_order.py).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.layers.embedding import VocabParallelLMHead
from shardwise.layers.fused import MergedColumnParallelLinear, QKVParallelLinear
from shardwise.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["MAX_COLUMN_MAJOR_ROWS", "decode_layout", "column_major"]

MAX_COLUMN_MAJOR_ROWS = 2
"""Rows per product up to which column-major fp32 weights are faster here (see above)."""

_PROJECTIONS = (
    ColumnParallelLinear,
    RowParallelLinear,
    QKVParallelLinear,
    MergedColumnParallelLinear,
    VocabParallelLMHead,
)


def column_major(w: torch.Tensor) -> bool:
    """Whether a 2-D tensor is stored transposed-contiguous (strides (1, rows))."""
    return w.dim() == 2 and w.shape[0] > 1 and w.t().is_contiguous() and not w.is_contiguous()


def _wants_column_major(w) -> bool:
    return (
        isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.shape[0] >= w.shape[1] > 1
    )


@torch.no_grad()
def decode_layout(model: nn.Module, rows: int) -> int:
    """Re-stride `model`'s CPU fp32 projection weights for products of `rows` rows: column-major
    where that is measured faster (out >= in, rows <= MAX_COLUMN_MAJOR_ROWS, the layers run by
    PyTorch: the native decode step refuses the model), row-major otherwise (undoing an
    earlier call). Call it after setting the tp group's wire (a compressed wire keeps the
    step off). Returns how many weights changed order."""
    from shardwise.models.step import refusal

    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    few = rows <= MAX_COLUMN_MAJOR_ROWS
    columns = few and refusal(model) is not None  # the layers' projections on MKL
    changed = 0
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, _PROJECTIONS):
            continue
        w = module.weight
        if id(w) in seen or not _wants_column_major(w):
            continue
        seen.add(id(w))  # a tied head's weight is the embedding's: re-strided once
        want = columns or (few and isinstance(module, VocabParallelLMHead))  # the head is MKL's always
        if want == column_major(w):
            continue
        # (out, in) -> the same values in the other order; the old storage is freed on return
        w.data = w.data.t().contiguous().t() if want else w.data.contiguous()
        changed += 1
    if changed:
        from shardwise.models.step import forget_programs

        forget_programs(model)  # a native step built before points into the old storage
    return changed
