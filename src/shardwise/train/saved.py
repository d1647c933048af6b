"""Measuring activation memory: the bytes autograd keeps for backward, per decoder layer.

    with SavedBytes(model) as saved:
        logits = model(ids)                 # forward only: nothing is freed before backward
    saved.per_layer                         # {layer index: bytes}
    saved.mean_layer()                      # mean over layers 1.. (see below)

Inside the block a saved-tensor hook sees every tensor autograd saves and attributes it to
the decoder layer running (forward hooks on each DecoderLayer), once per storage (a view
shares its base's bytes). Parameters and their autocast casts are left out: they are
weights, not activations. torch.utils.checkpoint (recompute) installs its own hooks and
keeps its region's inputs instead of saved tensors; those inputs are counted when the
region starts (its Recomputed callable is wrapped while the block runs).

Layer 0 also first sees the tensors every layer shares (the rotary tables, the mask), so
mean_layer() averages layers 1.. when there are several. benchmarks/bench_activations.py
and the tests compare these figures with shardwise.planner.activations.

`training_peak(world, config)` measures a whole training run instead: this rank's peak
resident memory above a warmed-up baseline, which benchmarks/validate_planner.py holds the
planner's predicted peak per rank to.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.decoder import DecoderLayer
from shardwise.train.recompute import Recomputed

__all__ = ["SavedBytes", "training_peak"]

_WEIGHT_PATH = ("ToCopyBackward0", "TBackward0", "ViewBackward0")


def _from_weight(t: torch.Tensor) -> bool:
    """A parameter's autocast cast or a view of one: cast/transpose/view nodes down to AccumulateGrad."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return True
        parents = [n for n, _ in fn.next_functions if n is not None]
        if len(parents) != 1 or type(fn).__name__ not in _WEIGHT_PATH:
            return False
        fn = parents[0]
    return False


class _CountInputs:
    """Stands in for the function a Recomputed checkpoints: counts its tensor inputs, then calls it."""

    def __init__(self, fn, saved: SavedBytes) -> None:
        self.fn, self.saved = fn, saved

    def __call__(self, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                self.saved.count(a)
        return self.fn(*args, **kwargs)


class SavedBytes:
    """Bytes saved for backward per decoder layer while the `with` block runs (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.per_layer: dict[int, int] = {}
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self._layer: int | None = None

    def count(self, t: torch.Tensor) -> None:
        if self._layer is None or _from_weight(t):
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or ptr in self._seen:
            return
        self._seen.add(ptr)
        self.per_layer[self._layer] = self.per_layer.get(self._layer, 0) + storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t

    def mean_layer(self) -> float:
        """Mean bytes per layer over layers 1.. (layer 0 alone if it is the only one)."""
        later = [v for k, v in self.per_layer.items() if k > 0] or list(self.per_layer.values())
        return sum(later) / len(later)

    def __enter__(self) -> SavedBytes:
        self._handles, self._wrapped = [], []
        index = 0
        for module in self.model.modules():
            if not isinstance(module, DecoderLayer):
                continue
            self._handles += [
                module.register_forward_pre_hook(lambda _m, _a, i=index: setattr(self, "_layer", i)),
                module.register_forward_hook(lambda _m, _a, _o: setattr(self, "_layer", None)),
            ]
            for owner, attr in ((module, "forward"), (module.attn, "core")):
                rec = owner.__dict__.get(attr)
                if isinstance(rec, Recomputed):  # what the checkpoint is handed, after any cast
                    self._wrapped.append((rec, rec.fn))
                    rec.fn = _CountInputs(rec.fn, self)
            index += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        for rec, fn in self._wrapped:
            rec.fn = fn


def _return_freed_memory() -> None:
    """Have glibc give large freed blocks back to the system at once (mmap them, trim the
    heap), so that resident memory follows the live tensors rather than what the allocator
    keeps for reuse. No effect elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: blocks of 64 KiB and more are mmapped
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: trim the heap top whenever it is free


def _warm_up(world) -> None:
    """Run each kind of operation training runs once (matmuls, attention, AdamW, a
    collective), so that one-time allocations of the runtime fall before the baseline."""
    import torch.nn.functional as F

    lin = nn.Linear(32, 32)
    x = torch.randn(2, 64, 32, requires_grad=True)
    q = lin(x).view(2, 64, 4, 8).transpose(1, 2)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
    torch.optim.AdamW(lin.parameters()).step()
    world.barrier()


def training_peak(world, config: dict) -> dict:
    """Train `config` (a TrainConfig as nested dicts) for its run.steps steps; this rank's
    peak resident anonymous memory above the baseline of a warmed-up process ("peak_bytes",
    sampled every 0.5 ms: setup, weights and optimizer state included), its pipeline stage
    ("pp_rank") and the parameters it holds ("params")."""
    from shardwise.memory import PeakAnonMemory
    from shardwise.train.config import TrainConfig
    from shardwise.train.loop import setup
    from shardwise.train.step import train_step

    cfg = TrainConfig.from_dict(config)
    _return_freed_memory()
    _warm_up(world)
    with PeakAnonMemory() as mem:
        tr = setup(world, cfg)
        for _ in range(cfg.run.steps):
            train_step(tr)
    params = sum(p.numel() for p in tr.model.parameters())
    return {"peak_bytes": mem.peak_above_baseline, "pp_rank": tr.mesh.pp_rank, "params": params}
