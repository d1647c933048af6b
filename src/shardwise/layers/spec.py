"""ShardSpec: where a rank's local tensor sits inside the unsharded one.

This metadata (Megatron-core's ShardedTensor idea) makes loading and resharding pure
functions: a loader reads exactly the pieces a spec names from a checkpoint, and a
resharder maps one set of specs onto another.

    local = cat([global.narrow(dim, start, length) for start, length in pieces], dim)
            followed by `pad` zero rows along dim (a padded vocabulary)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ShardSpec", "model_shard_specs"]


@dataclass(frozen=True)
class ShardSpec:
    """How one local parameter is cut from its unsharded (global) tensor."""

    global_shape: tuple[int, ...]
    """Shape of the unsharded, unpadded tensor."""
    dim: int | None = None
    """The split dimension; None means every rank holds the whole tensor."""
    pieces: tuple[tuple[int, int], ...] = ()
    """(start, length) ranges along dim, concatenated in order to form the local tensor."""
    pad: int = 0
    """Zero rows appended along dim after the pieces (vocabulary padding)."""

    @staticmethod
    def replicated(shape) -> ShardSpec:
        return ShardSpec(tuple(shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = sum(n for _, n in self.pieces) + self.pad
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor, cut from the whole unsharded one (for tests and small tensors;
        loaders read the pieces from disk instead)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"tensor of shape {tuple(full.shape)} does not match global_shape {self.global_shape}")
        if self.dim is None:
            return full.clone()
        parts = [full.narrow(self.dim, start, n) for start, n in self.pieces]
        if self.pad:
            shape = list(full.shape)
            shape[self.dim] = self.pad
            parts.append(full.new_zeros(shape))
        return torch.cat(parts, dim=self.dim)


def model_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """A ShardSpec for every parameter of a (possibly parallelized) model.

    Parallel layers describe their own parameters through `shard_specs()`; every other
    parameter is replicated. Tied parameters appear once, under their first name.
    """
    specs: dict[str, ShardSpec] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        own = module.shard_specs() if hasattr(module, "shard_specs") else {}
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            specs[full] = own.get(p_name) or ShardSpec.replicated(p.shape)
    return specs
