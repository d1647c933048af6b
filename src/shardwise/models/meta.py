"""Building a model on the meta device: shapes and dtypes only, no memory, no values.

    with on_meta():
        model = DecoderLM(cfg)      # then fill in this rank's shards (shardwise.hf)

NOTE: the initialisers that module constructors call (nn.init.normal_, kaiming_uniform_,
...) are skipped inside. On meta tensors they compute nothing, yet the first one runs a
Python meta kernel whose wrapper imports torch._dynamo: about a second of CPU in every
rank process that loads a model, for nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["on_meta", "materialize"]

_INITIALISERS = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))]


def _skip(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are on the meta device, with their initialisers skipped."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, _skip)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """`model.to_empty(device)` (uninitialised memory for every meta tensor), keeping tied
    parameters tied: to_empty gives each module its own tensor, which would silently untie
    an embedding and the LM head sharing one Parameter."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *rest in (uses for uses in shared.values() if len(uses) > 1):
        for module, name in rest:
            setattr(module, name, getattr(first, first_name))
    return model
