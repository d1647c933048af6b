"""A DecoderLM's decode step as one native program (shardwise.kernels.step), where it can run.

    y = step_layers(model, x, rope, mask, caches, start, ids)   # None: run the layers as usual

Reads each layer of `ids` off the model as a kernels.step.LayerSpec, builds the program once
per (layers, batch) and keeps it on the model (rebuilt when a weight or a cache tensor
changes: `_Entry.fits`). It runs where every layer is a plain pre-norm decoder layer (RMSNorm
without offset, no q/k norm, no sandwich norms, a gated silu or gelu_tanh MLP, no experts)
whose four projections are the sharded layers (column-parallel qkv and [gate | up],
row-parallel o and down; recognised by class name: models do not import layers) holding
native block-format weights, on fp32 CPU activations outside autograd, with a tp group of
one rank or with the shared-memory all-reduce, and no fault injected. Anywhere else it
answers None and the layers run op by op; `model.__dict__["_step_refused"]` says why.
"""

from __future__ import annotations

import math
import operator
import weakref
from itertools import repeat

import torch
from torch import nn

from shardwise.kernels import native, step
from shardwise.kernels.decode import fused_ok

__all__ = ["step_layers", "forget_programs", "refusal"]

_COLUMN = {"QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear"}
_ROW = {"RowParallelLinear"}
_CALL = operator.methodcaller("__call__")  # a weak reference's referent
_MAX_PROGRAMS = 40
"""Programs kept per model: one per (layer range, batch); a server steps at every batch of 1-16."""


def _proj(mod, kinds: set[str], what: str):
    """A projection's (weight, bias, tp group), if it is one of `kinds`, without sequence parallelism or a gather."""
    step.need(type(mod).__name__ in kinds, f"{what} is a {type(mod).__name__}")
    step.need(not getattr(mod, "sequence_parallel", False) and not getattr(mod, "gather_output", False), what)
    w = mod.weight
    if isinstance(w, torch.Tensor):  # an fp32 model's Parameter: its data (outside autograd)
        w = w.detach()
    return w, mod.bias, mod.comm


def _projections(layer) -> tuple[tuple, tuple, tuple, tuple]:
    """The layer's qkv, o, up and down as (weight, bias, tp group), where the program runs its
    kind of layer (Unsupported: why not)."""
    step.need(not layer.parallel_residual, "a parallel residual")
    step.need(layer.attn_post_norm is None and layer.mlp_post_norm is None, "sandwich norms")
    attn, mlp = layer.attn, layer.mlp
    step.need(attn.q_norm is None, "q/k norm")
    step.need(hasattr(mlp, "up") and getattr(mlp, "gated", False), "experts, or an MLP that is not gated")
    for n in (layer.attn_norm, layer.mlp_norm):
        step.need(n.kind == "rms" and not n.offset, f"a {n.kind} norm with offset {n.offset}")
    parts = (_proj(attn.qkv, _COLUMN, "qkv"), _proj(attn.o, _ROW, "o"), _proj(mlp.up, _COLUMN, "up"),
             _proj(mlp.down, _ROW, "down"))  # fmt: skip
    step.need(parts[0][2] is parts[1][2] is parts[2][2] is parts[3][2], "projections on different groups")
    return parts


def refusal(model) -> str | None:
    """Why the program would not run `model`'s decode steps, from its layers alone (their kind,
    their projections, the tp group's wire; not the caches, which it checks at the step), or
    None where it would."""
    if not (step.enabled() and native.available()):
        return "the native step is off (SHARDWISE_NATIVE_STEP=0) or not built"
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)) or not len(layers):
        return "no decoder layers"
    try:
        for layer in layers if isinstance(layers, nn.ModuleList) else layers.values():
            group = _projections(layer)[0][2]
            step.need(group.size == 1 or group.wire == "fp32", f"the tp group's {group.wire} wire")
    except (step.Unsupported, AttributeError) as e:
        return str(e)
    return None


def _spec(layer, cache, hid: int) -> tuple[step.LayerSpec, object, list]:
    """(the layer's spec, its tp group, (module, weight) pairs whose identity the program depends on)."""
    attn, mlp = layer.attn, layer.mlp
    (wq, bq, g1), (wo, bo, _), (wu, bu, _), (wd, bd, _) = _projections(layer)
    hd = attn.head_dim
    nq = wo.shape[1] // hd
    groups = getattr(attn.qkv, "kv_groups", None)
    # NOTE: the spec holds detached tensors: should a Parameter's .data be replaced (decode_layout
    # re-strides fp32 weights so), the storage the program points into stays alive
    spec = step.LayerSpec(
        norm1=layer.attn_norm.weight.detach(), eps1=layer.attn_norm.eps, qkv=wq, qkv_bias=bq, nq=nq,
        nkv=(wq.shape[0] // hd - nq) // 2, head_dim=hd,
        groups=None if groups is None else torch.tensor(groups, dtype=torch.long), k=cache.k, v=cache.v,
        scale=attn.scale if attn.scale is not None else 1.0 / math.sqrt(hd), o=wo, obias=bo,
        norm2=layer.mlp_norm.weight.detach(), eps2=layer.mlp_norm.eps, up=wu, up_bias=bu, glu=mlp.act_name,
        inter=wd.shape[1], down=wd, dbias=bd,
    )  # fmt: skip
    mods = (attn.qkv, attn.o, mlp.up, mlp.down, layer.attn_norm, layer.mlp_norm)
    return spec, g1, [(m, m.weight) for m in mods]


class _Entry:
    """A program and what it was built from: the modules' weights (strongly: the program points
    into them) and the caches' tensors (weakly: a finished request's cache may go)."""

    def __init__(self, model, ids: list[int], caches, batch: int, start: int) -> None:
        specs, weights, kv, group, lay0 = [], [], [], None, None
        for i in ids:
            cache = caches[i]
            lay = cache.decode_layout(start, batch) if hasattr(cache, "decode_layout") else None
            step.need(lay is not None and lay.k is cache.k and lay.v is cache.v, "a cache without a decode layout")
            lay0 = lay0 or lay
            key = (lay.pos_stride, lay.head_stride, lay.rrow, lay.K, lay.wbase, lay.widx, lay.ridx)
            step.need(key == (lay0.pos_stride, lay0.head_stride, lay0.rrow, lay0.K, lay0.wbase, lay0.widx, lay0.ridx),
                      "caches laid out differently from layer to layer")  # fmt: skip
            layer = model.layers[i if isinstance(model.layers, nn.ModuleList) else str(i)]
            spec, g, w = _spec(layer, cache, model.cfg.hidden_size)
            step.need(group is None or g is group, "layers on different tp groups")
            group = g
            specs.append(spec)
            weights += w
            kv += (weakref.ref(cache.k), weakref.ref(cache.v))
        ar = None
        if group.size > 1:
            step.need(group.wire == "fp32", f"the tp group's {group.wire} wire (the per-op path encodes it)")
            ar = group.native_all_reduce()
            step.need(ar is not None, f"a tp group ({group.backend}) without the shared-memory all-reduce")
        self.program = step.StepProgram(specs, hidden=model.cfg.hidden_size, batch=batch, allreduce=ar)
        self.ids, self.batch = ids, batch
        # where each module keeps its weight (a Parameter's dict, or the instance's for a BlockWeight):
        # read there, not through nn.Module.__getattr__ (~0.2 us each, every step)
        self._homes = tuple(m._parameters if "weight" in m._parameters else m.__dict__ for m, _ in weights)
        self._weights = tuple(w for _, w in weights)
        self._kv = tuple(kv)  # (k, v) of each layer, in turn

    def fits(self, caches, batch: int) -> bool:
        """Whether the model still holds the same weights and `caches` the same tensors.
        NOTE: every step, so identities compared by map in C (about 15 us for 30 layers)."""
        homes = self._homes
        if batch != self.batch or not all(
            map(operator.is_, map(dict.get, homes, repeat("weight", len(homes))), self._weights)
        ):
            return False
        layers = [caches[i] for i in self.ids]
        now = [t for c in layers for t in (c.k, c.v)]
        return all(map(operator.is_, now, map(_CALL, self._kv)))


def step_layers(model, x: torch.Tensor, rope, mask, caches, start: int, ids: list[int]) -> torch.Tensor | None:
    """A decode step (x: (B, 1, hidden)) through layers `ids` as one native call, or None where
    it cannot run (see the module docstring)."""
    if not (step.enabled() and x.shape[1] == 1 and fused_ok(x) and x.is_contiguous()) or isinstance(mask, dict):
        return None
    if mask is not None and not mask.is_contiguous():
        return None
    if rope is not None and not (rope[0].is_contiguous() and rope[1].is_contiguous()):
        return None
    B = x.shape[0]
    cache0 = caches[ids[0]]
    lay = cache0.decode_layout(start, B) if hasattr(cache0, "decode_layout") else None
    if lay is None or (mask is not None and mask.shape[-1] != lay.K):
        return None
    entries = model.__dict__.setdefault("_step_programs", {})
    key = (tuple(ids), B, native.isa())  # NOTE: the kernels' variant is chosen into the program
    entry = entries.get(key)
    if entry is None or (entry is not False and not entry.fits(caches, B)):
        if len(entries) >= _MAX_PROGRAMS:
            entries.clear()
        try:
            entry = _Entry(model, ids, caches, B, start)
        except step.Unsupported as e:
            model.__dict__["_step_refused"] = str(e)
            entry = False
        entries[key] = entry
    if entry is False:
        return None
    ar = entry.program.allreduce
    if ar is not None and ar.fault_injected():
        return None  # an injected fault is checked per call, by the communicator
    return entry.program.run(x, rope, mask, lay)


def forget_programs(model) -> None:
    """Drop `model`'s programs (the next step builds them again): after its weights changed
    storage in place (quant.layout.decode_layout), which identity checks cannot see."""
    model.__dict__.pop("_step_programs", None)
