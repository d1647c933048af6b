"""Activation recomputation: trade a second forward of part of each layer for the memory
its saved activations would take (Korthikanti et al., 2022).

    apply_recompute(model, "selective")   # recompute each attention core in backward
    apply_recompute(model, "full")        # recompute each decoder layer in backward

"full" keeps only each layer's input (and recomputes the whole layer, collectives
included, in backward). "selective" recomputes only the attention core
(Attention.core: scores, mask, softmax, weighted sum), the part whose saved tensors grow
with the sequence (the paper's 5 a s^2 b term) and cost little to recompute; it keeps
the core's inputs q, k, v. Both use torch.utils.checkpoint with use_reentrant=False, so
autocast and the RNG state of the first forward are replayed and results are unchanged.

The model stays a plain module: the recomputed callable replaces the module's `forward`
(full) or `core` (selective) on the instance, so parameter names, state dicts and plans
are untouched. Without autograd (evaluation) the original runs directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.models.decoder import DecoderLayer
from shardwise.models.modules import Attention

__all__ = ["RECOMPUTE_MODES", "Recompute", "Recomputed", "apply_recompute"]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


class Recomputed:
    """`fn` under torch.utils.checkpoint (non-reentrant) when autograd records, else `fn` itself.

    cast_inputs: under autocast, cast the floating-point tensor arguments to the autocast
    dtype before the checkpoint, as the attention kernel would cast them itself (the same
    values and gradients). The checkpoint then holds the 16-bit copies the kernel would
    have saved, not the fp32 rotated q and k (RoPE runs in the residual stream's fp32)."""

    def __init__(self, fn: Callable, what: str, *, cast_inputs: bool = False) -> None:
        self.fn, self.what, self.cast_inputs = fn, what, cast_inputs

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        if self.cast_inputs and args and torch.is_autocast_enabled(args[0].device.type):
            dtype = torch.get_autocast_dtype(args[0].device.type)
            args = tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return checkpoint(self.fn, *args, use_reentrant=False, **kwargs)

    def __repr__(self) -> str:
        return f"Recomputed({self.what})"


def apply_recompute(model: nn.Module, mode: str) -> list[str]:
    """Recompute `mode` ("none", "selective", "full") in `model` (in place); the module paths
    now recomputed. Applying a mode twice, or a second mode, is refused (one line)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is unknown; choose one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return []
    kind, attr = (DecoderLayer, "forward") if mode == "full" else (Attention, "core")
    done = []
    for path, module in model.named_modules():
        if not isinstance(module, (DecoderLayer, Attention)):
            continue
        if isinstance(module.__dict__.get("forward"), Recomputed) or isinstance(
            module.__dict__.get("core"), Recomputed
        ):
            raise ValueError(f"{path} is already recomputed; build the model again to change the recompute mode")
        if isinstance(module, kind):
            fn = Recomputed(getattr(module, attr), f"{path}.{attr}", cast_inputs=mode == "selective")
            setattr(module, attr, fn)
            done.append(path)
    if not done:
        raise ValueError(f"recompute={mode!r}: the model has no {kind.__name__} to recompute")
    return done
