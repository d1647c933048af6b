"""A linear whose backward writes the weight's gradient straight into `weight.grad`
(Megatron-LM's gradient-accumulation fusion), and keeps that buffer from step to step.

Autograd's own linear backward computes dW = dY^T X into a new tensor, which AccumulateGrad
then keeps (the first micro-batch) or adds into `.grad` (every later one: a second pass over
the gradient). On the CPU a new tensor of 32 MiB or more is fresh memory from the kernel
(glibc maps it afresh each time), paid page by page on first touch: on the 1B training
shape at tp=2 (benchmarks/bench_adamw.py --profile) 1.1 s of a 3.3-3.9 s backward, and far
more on a VM whose host backs guest memory lazily (docs/benchmarks/links.md). Here:

- the first micro-batch of a step writes dW into the buffer the weight's gradient had last
  step (`release` keeps it when the optimizer is done with it), else into a new one;
- every later micro-batch adds into `.grad` within the product itself (addmm_): no new
  tensor, no second pass.

Opted into per parameter (`fuse`), by the trainer, and only where nothing watches
AccumulateGrad: DistributedDataParallel's reducer does (its hooks fire there), so a DDP-synced
model keeps autograd's path. Skipped under autocast (its casts live in autograd's graph) and
when the weight needs no gradient. The arithmetic is the same products; only where the sum of
micro-batches is formed differs (tests/unit/test_wgrad.py: against autograd's path, to fp32
rounding).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

__all__ = ["embedding", "fuse", "fused", "linear", "release"]

_FUSED = "_sw_fuse_wgrad"
_SPARE = "_sw_spare_grad"
_SEEN = "_sw_wgrad_seen"  # the fused path made this step's .grad: release keeps it


def fuse(params: Iterable[torch.nn.Parameter], on: bool = True) -> int:
    """Opt these parameters in (or out): ops.linear then takes the fused path for them.
    Returns how many were changed."""
    n = 0
    for p in params:
        if on != bool(getattr(p, _FUSED, False)):
            setattr(p, _FUSED, on)
            n += 1
        if not on:
            p.__dict__.pop(_SPARE, None)
            p.__dict__.pop(_SEEN, None)
    return n


def fused(weight: torch.Tensor) -> bool:
    """Whether a linear through `weight` takes the fused path now: opted in, a leaf that needs
    its gradient, grad mode on, no autocast."""
    return (
        torch.is_grad_enabled()  # first: inference stops here
        and getattr(weight, _FUSED, False)
        and weight.requires_grad
        and weight.is_leaf
        and not torch.is_autocast_enabled(weight.device.type)
    )


def release(params: Iterable[torch.nn.Parameter]) -> None:
    """After the optimizer step, before zero_grad(set_to_none=True): a gradient the fused path
    made becomes None (as zero_grad leaves it: what the optimizer and the next step see is
    unchanged), its buffer kept for the next step's first micro-batch to write."""
    for p in params:
        if p.__dict__.pop(_SEEN, False) and p.grad is not None:
            p.__dict__[_SPARE] = p.grad.detach()
            p.grad = None  # the rest: the optimizer's zero_grad


def _grad_buffer(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The buffer kept for `weight`'s gradient from the last step, if it still fits."""
    spare = weight.__dict__.pop(_SPARE, None)
    return spare if spare is not None and spare.shape == weight.shape and spare.dtype == dtype else None


def _accumulate(weight: torch.Tensor, gy: torch.Tensor, x: torch.Tensor) -> None:
    """weight.grad += gy^T x; gy (N, out), x (N, in)."""
    weight.__dict__[_SEEN] = True
    g = weight.grad
    if g is not None:
        g.addmm_(gy.t(), x)  # (out, in) += (out, N) (N, in), in the product
        return
    weight.grad = torch.mm(gy.t(), x, out=_grad_buffer(weight, gy.dtype))  # the kept buffer, or a new one


class _Linear(torch.autograd.Function):
    """y = x W^T + b; backward: dX and db returned, dW written into W.grad (no gradient returned for W)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        # the Parameter itself, not a saved tensor: what a saved-tensor hook (activation
        # checkpointing) hands back is the values, another tensor object, whose .grad is not the weight's
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)  # (..., out)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        gx = gy @ weight if ctx.needs_input_grad[0] else None  # (..., in)
        gy2 = gy.reshape(-1, gy.shape[-1])  # (N, out)
        if ctx.needs_input_grad[1]:
            _accumulate(weight, gy2, x.reshape(-1, x.shape[-1]))
        gb = gy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, None, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) -> (..., out), W.grad accumulated by the backward itself (see the module)."""
    return _Linear.apply(x, weight, bias)


class _Embedding(torch.autograd.Function):
    """Rows `ids` of W; backward: dY's rows added into W.grad (index_add_), no gradient returned
    for W. Autograd's own makes a zeroed table-sized tensor each micro-batch (131 MB on the 1B
    shape's rank) and then adds it into .grad; a tied head (this module's linear) has already
    made .grad by then, so the rows go straight in."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the Parameter itself (see _Linear)
        return F.embedding(ids, weight)  # (..., D)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        (ids,), weight = ctx.saved_tensors, ctx.weight
        weight.__dict__[_SEEN] = True
        g = weight.grad
        if g is None:
            g = _grad_buffer(weight, gy.dtype)
            g = g.zero_() if g is not None else torch.zeros(weight.shape, dtype=gy.dtype, device=gy.device)
            weight.grad = g
        g.index_add_(0, ids.reshape(-1), gy.reshape(-1, gy.shape[-1]))
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of `weight` -> (*ids.shape, D), W.grad accumulated by the backward itself."""
    return _Embedding.apply(ids, weight)
