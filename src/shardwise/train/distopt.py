"""The distributed optimizer: fp32 master weights and AdamW moments split over dp (ZeRO-2).

Per (tp, pp, ep) position, the parameters this rank holds are laid end to end in one flat
index space (the weight-decayed ones first, then the rest), cut into buckets of whole
parameters (parallel.bucket_mb), and every bucket is dealt over the dp ranks in contiguous
pieces, the first L % dp ranks one element more (as Megatron-core's buckets, without its
padding to a multiple of dp, so a checkpoint never depends on dp):

    bucket      [ qkv.w | o.w | gate_up.w | down.w ]               L elements
    dp rank r   [ b0 + r * L / dp, ... )                           L / dp each (+1 for r < L % dp)

A rank's slice is its pieces of every bucket, in bucket order. Each rank keeps, for its
slice only, AdamW's two moments, and the fp32 master: with fp32 weights the weights
themselves (the parameters live in one flat buffer, each a view of it, and AdamW steps this
rank's pieces of it in place: Megatron-core's 8 + 8/dp bytes per parameter); with bf16
weights a separate fp32 copy of the slice. A step:

1. backward (every micro-batch, any schedule) accumulates whole gradients in p.grad;
2. `finish`: bucket by bucket, the gradients are flattened (cast to `reduce_dtype`) and
   reduce-scattered over dp into a fresh fp32 slice, divided by dp; p.grad is then freed
   (ZeRO-2: Megatron keeps the whole gradient buffer on every rank; here only the slice
   exists between the reduction and the step, and nothing between the step and the next
   backward);
3. `clip_`: the global norm from the slices, each element once (tp-replicated rows by their
   owner, a tied embedding's copy not at all, experts over edp then ep), one sum per group;
4. `step`: AdamW on the master slices (torch's own, elementwise, so every element moves
   exactly as under the plain optimizer), the reduced slice is dropped, then the updated
   slices are all-gathered bucket by bucket back into the model's weights (fp32: straight
   into the flat buffer; bf16 weights get bf16, half the bytes).

Mixture-of-experts: the experts' parameters form a second space, split over the
expert-data-parallel group (edp: the ranks holding the same experts) and divided by dp,
as ExpertParallelSync does.

With shard=False the same machinery keeps the whole space on every rank and all-reduces:
the fp32 master copy for bf16 weights without the distributed optimizer.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.layers import ShardSpec, split_sizes
from shardwise.train.config import OptimSection
from shardwise.train.layout import owned_mask
from shardwise.train.optim import fused_ok, sum_of_squares
from shardwise.train.sync import GradSync

__all__ = ["DistributedOptimizer", "MOMENTS", "DTYPES", "autocast", "bytes_per_param", "check_dtype", "held_bytes"]

MOMENTS = ("exp_avg", "exp_avg_sq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHUNK = 1 << 18
"""Elements per AdamW parameter (a view of the master slice): 1 MiB of fp32."""
"""The config's dtype names (run.dtype, optim.grad_reduce_dtype)."""


def check_dtype(dtype: str, device: str | torch.device = "cpu") -> None:
    """ValueError (one line) when `device` cannot compute in run.dtype `dtype`; called before
    any rank starts. CPUs compute bf16 (slowly without native support); CUDA needs bf16 support."""
    device = torch.device(device)
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"run.dtype='bf16': {name} ({device}) cannot compute in bfloat16; use run.dtype='fp32'")


def autocast(model: nn.Module, run) -> contextlib.AbstractContextManager:
    """bf16 autocast on the model's own device when run.bf16 (a RunSection) asks for it."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=run.bf16)


def _overlap(a: int, b: int, c: int, d: int) -> tuple[int, int]:
    """[a, b) ∩ [c, d) as (start, end), empty as (x, x)."""
    lo, hi = max(a, c), min(b, d)
    return (lo, max(lo, hi))


class _Space:
    """One flat index space (dense, or experts) cut into buckets, each bucket split over `comm`.

    The master copy: with `inplace` (fp32 weights, sharded) the parameters are moved into one
    flat fp32 buffer (each parameter a view of it) and this rank's piece of every bucket IS
    its master, stepped in place; otherwise a separate (slice,) fp32 tensor. The reduced
    gradient slice exists only from `reduce` to the end of `step`."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        decay: set[str],
        comm: Communicator,
        *,
        divide_by: int,
        bucket_numel: int,
        shard: bool,
        inplace: bool = False,
    ) -> None:
        ordered = [x for x in named if x[0] in decay] + [x for x in named if x[0] not in decay]
        self.names = [n for n, _ in ordered]
        self.params = [p for _, p in ordered]
        self.comm, self.divide_by, self.shard = comm, divide_by, shard
        self.inplace = inplace and shard and all(p.dtype == torch.float32 for p in self.params)
        self.offsets, total = {}, 0  # name -> (start, end) in the flat space
        for n, p in ordered:
            self.offsets[n] = (total, total + p.numel())
            total += p.numel()
        self.numel = total
        # Buckets of whole parameters, about bucket_numel elements each, never mixing decayed and
        # not decayed ones: (first, end) indices into params.
        spans, first, size = [], 0, 0
        for i, (n, p) in enumerate(ordered):
            if i > first and (size + p.numel() > bucket_numel or (n in decay) != (ordered[first][0] in decay)):
                spans.append((first, i))
                first, size = i, 0
            size += p.numel()
        if ordered:
            spans.append((first, len(ordered)))
        # Each bucket [b0, b1) is dealt over the ranks: rank r holds [b0 + sum(sizes[:r]), + sizes[r]).
        self.buckets: list[tuple[int, int, int, int, list[tuple[int, int]], int]] = []  # + ranks' ranges, my offset
        self.bucket_of, at = {}, 0
        for first, end in spans:
            b0, b1 = self.offsets[self.names[first]][0], self.offsets[self.names[end - 1]][1]
            sizes = split_sizes(b1 - b0, comm.size) if shard else [b1 - b0] * comm.size
            starts = [b0 + sum(sizes[:r]) for r in range(comm.size)] if shard else [b0] * comm.size
            ranges = [(a, a + n) for a, n in zip(starts, sizes, strict=True)]
            self.buckets.append((first, end, b0, b1, ranges, at))
            for n in self.names[first:end]:
                self.bucket_of[n] = len(self.buckets) - 1
            at += sizes[comm.rank]
        self.slice_numel = at
        device = self.params[0].device if self.params else torch.device("cpu")  # the model's device, not "cpu"
        self.flat: torch.Tensor | None = None  # (numel,) every parameter of the space, when inplace
        self.master: torch.Tensor | None = None  # (slice,) the separate fp32 master copy, unless inplace
        self.grad: torch.Tensor | None = None  # (slice,) the dp-reduced gradient, from reduce to step
        with torch.no_grad():
            if self.inplace:
                self.flat = torch.empty(total, dtype=torch.float32, device=device)
                for name, p in ordered:
                    a, b = self.offsets[name]
                    self.flat[a:b].copy_(p.detach().reshape(-1))
                    p.data = self.flat[a:b].view_as(p)  # the weight is a view: stepping the slice steps it
            else:
                self.master = torch.empty(at, dtype=torch.float32, device=device)
                for name, p in ordered:
                    offset, piece = self.piece(name, p.detach().reshape(-1))
                    self.master[offset : offset + piece.numel()] = piece.float()
        # AdamW's parameters: views of this rank's piece of each bucket, at most CHUNK elements each
        # (each of AdamW's passes then stays in cache): (start in the slice, master view,
        # 0 = decayed / 1 = not).
        self.chunks: list[tuple[int, torch.Tensor, int]] = []
        for b, (first, _, _, _, _, at_b) in enumerate(self.buckets):
            lo, hi = self._mine(b)
            view = self.flat[lo:hi] if self.inplace else self.master[at_b : at_b + hi - lo]
            group = 0 if self.names[first] in decay else 1
            self.chunks += [(at_b + a, view[a : a + CHUNK], group) for a in range(0, hi - lo, CHUNK)]

    def _mine(self, b: int) -> tuple[int, int]:
        return self.buckets[b][4][self.comm.rank]

    def sizes(self, name: str) -> list[int]:
        """Every rank's share of parameter `name`."""
        start, end = self.offsets[name]
        return [e - s for s, e in (_overlap(lo, hi, start, end) for lo, hi in self.buckets[self.bucket_of[name]][4])]

    def reduce(self, reduce_dtype: torch.dtype) -> None:
        """Sum every gradient over comm into this rank's slice, divided by divide_by; free p.grad."""
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad = torch.empty(self.slice_numel, dtype=torch.float32, device=device)
        for b, (first, end, _, _, ranges, at) in enumerate(self.buckets):
            chunk = self.params[first:end]
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(reduce_dtype) for p in chunk]
            )  # (bucket numel,)
            for p in chunk:
                p.grad = None
            if self.shard:
                part = self.comm.reduce_scatter(flat, dim=0, sizes=[hi - lo for lo, hi in ranges])
            else:
                part = self.comm.all_reduce(flat)
            lo, hi = self._mine(b)
            self.grad[at : at + hi - lo] = part.div_(self.divide_by)
        for a, master, _ in self.chunks:
            master.grad = self.grad[a : a + master.numel()]

    def release(self) -> None:
        """Drop the reduced gradient slice (after the step)."""
        for _, master, _ in self.chunks:
            master.grad = None
        self.grad = None

    def gather(self) -> None:
        """The updated slices, all-gathered over comm into the model's weights."""
        with torch.no_grad():
            for b, (first, end, b0, b1, ranges, at) in enumerate(self.buckets):
                lo, hi = self._mine(b)
                if self.inplace:  # the model's weights are views of flat: gather straight into it
                    full = self.comm.all_gather(self.flat[lo:hi], dim=0, sizes=[e - s for s, e in ranges])
                    self.flat[b0:b1].copy_(full)
                    continue
                mine = self.master[at : at + hi - lo].to(self.params[first].dtype)  # bf16 weights: half the bytes
                full = self.comm.all_gather(mine, dim=0, sizes=[e - s for s, e in ranges]) if self.shard else mine
                for name, p in zip(self.names[first:end], self.params[first:end], strict=True):
                    ps, pe = self.offsets[name]
                    p.copy_(full[ps - b0 : pe - b0].view_as(p))

    def piece(self, name: str, flat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(offset in this rank's slice, the part of `name`'s flat tensor it holds)."""
        start, end = self.offsets[name]
        b = self.bucket_of[name]
        lo, hi = self._mine(b)
        a, e = _overlap(lo, hi, start, end)
        return self.buckets[b][5] + a - lo, flat[a - start : e - start]

    def master_piece(self, name: str) -> tuple[int, torch.Tensor]:
        """(offset in the slice, this rank's part of `name`'s fp32 master): a view."""
        if self.inplace:
            a, b = self.offsets[name]
            return self.piece(name, self.flat[a:b])
        offset, piece = self.piece(name, torch.empty(self.offsets[name][1] - self.offsets[name][0], device="meta"))
        return offset, self.master[offset : offset + piece.numel()]

    def full(self, name: str, mine: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """`name`'s whole (tp-local) tensor from every rank's part `mine` of it (collective)."""
        if not self.shard:
            return mine.clone().view(shape)
        return self.comm.all_gather(mine.contiguous(), dim=0, sizes=self.sizes(name)).view(shape)


class DistributedOptimizer(GradSync):
    """AdamW over fp32 master slices; also this step's dp reduction (a GradSync) and its
    gradient norm (GradNorm's clip_/norm). Trainer.optimizer, .sync and .grad_norm all point here."""

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimSection,
        specs: dict[str, list[ShardSpec]],
        *,
        tp: Communicator,
        dp: Communicator,
        pp: Communicator | None = None,
        skip: set[str] | frozenset[str] = frozenset(),
        ep: Communicator | None = None,
        edp: Communicator | None = None,
        experts: set[str] | frozenset[str] = frozenset(),
        bucket_mb: float = 25.0,
        shard: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
        weights_are_master: bool = False,
    ) -> None:
        """weights_are_master: the model keeps fp32 weights (run.dtype = "fp32"): with shard,
        each rank's slice of the parameters is stepped in place instead of a separate copy."""
        self.module, self.tp, self.pp, self.ep = model, tp, pp, ep
        self.reduce_dtype, self.shard, self.skip = reduce_dtype, shard, set(skip)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = {n for n, p in named if p.dim() >= 2}  # as build_optimizer: matrices and embeddings
        bucket_numel = max(int(bucket_mb * 2**20) // 4, 1)
        kw = {"bucket_numel": bucket_numel, "shard": shard, "divide_by": dp.size, "inplace": weights_are_master}
        self.spaces = [_Space([x for x in named if x[0] not in experts], decay, dp, **kw)]
        if experts:
            self.spaces.append(_Space([x for x in named if x[0] in experts], decay, edp, **kw))
        self.space_of = {n: s for s in self.spaces for n in s.names}
        self.shapes = {n: p.shape for n, p in named}
        self.adamw = torch.optim.AdamW(
            [
                {
                    "params": [c[1] for s in self.spaces for c in s.chunks if c[2] == 0],
                    "weight_decay": cfg.weight_decay,
                },
                {"params": [c[1] for s in self.spaces for c in s.chunks if c[2] == 1], "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused_ok([c[1] for s in self.spaces for c in s.chunks]),  # as build_optimizer's
        )
        # Which elements of each slice the norm counts (1) or not (0): rows owned on this tp
        # rank, not a tied copy. (slice,) bool per space.
        params = dict(named)
        self.counted = []
        for s in self.spaces:
            device = s.params[0].device if s.params else torch.device("cpu")
            mask = torch.zeros(s.slice_numel, dtype=torch.bool, device=device)
            for name in s.names:
                if name in self.skip:
                    continue
                offset, piece = s.piece(name, self._owned(params[name], specs[name]).reshape(-1))
                mask[offset : offset + piece.numel()] = piece
            self.counted.append(mask)

    def _owned(self, p: nn.Parameter, per_rank: list[ShardSpec]) -> torch.Tensor:
        """Bool over p's elements: those this tp rank counts in the norm."""
        rows = owned_mask(per_rank, self.tp.rank)
        if rows is None:
            return torch.ones(p.shape, dtype=torch.bool, device=p.device)
        if p.dim() == 0 or per_rank[self.tp.rank].dim is None:
            return torch.full(p.shape, bool(rows.any()), device=p.device)
        shape = [1] * p.dim()
        shape[per_rank[self.tp.rank].dim] = -1
        return rows.to(p.device).view(shape).expand(p.shape)

    # ---- GradSync ------------------------------------------------------------------------
    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        for s in self.spaces:
            s.reduce(self.reduce_dtype)

    # ---- GradNorm ------------------------------------------------------------------------
    def norm(self) -> torch.Tensor:
        """The unsharded gradient's L2 norm from the slices (collective), a 0-d fp32 tensor."""
        sums = [sum_of_squares(s.grad, m).view(1) for s, m in zip(self.spaces, self.counted, strict=True)]
        dense = self.spaces[0].comm.all_reduce(sums[0]) if self.shard else sums[0]
        total = dense
        if len(sums) > 1:
            expert = self.spaces[1].comm.all_reduce(sums[1]) if self.shard else sums[1]
            if self.ep is not None:
                expert = self.ep.all_reduce(expert)  # each ep rank's own experts
            total = dense + expert
        total = self.tp.all_reduce(total)
        if self.pp is not None:
            total = self.pp.all_reduce(total)
        return total.sqrt().float()[0]

    def clip_(self, max_norm: float | None) -> float:
        norm = self.norm()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for s in self.spaces:
                s.grad.mul_(coef)
        return float(norm)

    # ---- the optimizer -------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups

    def step(self) -> None:
        self.adamw.step()
        for s in self.spaces:
            s.release()  # the reduced gradient slice lives from finish() to here
            s.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.module.parameters():
            p.grad = None

    def group_names(self) -> list[list[str]]:
        """The parameter names of each AdamW group (decayed, not decayed), as the plain optimizer's."""
        out: list[list[str]] = [[], []]
        for s in self.spaces:
            for n in s.names:
                out[0 if s.params[s.names.index(n)].dim() >= 2 else 1].append(n)
        return out

    # ---- checkpoints ---------------------------------------------------------------------
    def _my_part(self, s: _Space, name: str, kind: str) -> torch.Tensor:
        """This rank's part of `name`'s fp32 master ("param") or moment (zeros before a step)."""
        offset, piece = s.master_piece(name)
        if kind == "param":
            return piece
        out = torch.zeros_like(piece)
        for base, master, _ in s.chunks:
            a, b = _overlap(offset, offset + piece.numel(), base, base + master.numel())
            t = self.adamw.state.get(master, {}).get(kind)
            if b > a and t is not None:
                out[a - offset : b - offset] = t[a - base : b - base]
        return out

    def state_tensor(self, name: str, kind: str) -> torch.Tensor:
        """`name`'s whole tp-local fp32 master ("param") or moment, gathered from the dp slices
        (collective over the space's group: every rank calls it in the same order)."""
        s = self.space_of[name]
        return s.full(name, self._my_part(s, name, kind), self.shapes[name])

    def local_piece(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `name`'s tp-local tensor this rank's slice holds (a copy)."""
        return self.space_of[name].piece(name, tensor.reshape(-1))[1].float().clone()

    def load_piece(self, name: str, kind: str, piece: torch.Tensor, step: int) -> None:
        """Fill this rank's part of `name`'s master ("param") or moment from local_piece's output."""
        s = self.space_of[name]
        offset, mine = s.master_piece(name)
        if kind == "param":
            mine.copy_(piece)  # fp32 weights stepped in place: the weight itself (already loaded)
            return
        for base, master, _ in s.chunks:
            a, b = _overlap(offset, offset + piece.numel(), base, base + master.numel())
            if b == a:
                continue
            state = self.adamw.state[master]
            if not state:
                state["step"] = torch.tensor(float(step))
                for k in MOMENTS:
                    state[k] = torch.zeros_like(master)
            state[kind][a - base : b - base] = piece[a - offset : b - offset]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state this rank holds: the separate fp32 master (none when the fp32
        weights are stepped in place) and the moments (the reduced gradient slice: held_bytes)."""
        slice_n = sum(s.slice_numel for s in self.spaces)
        master = sum(s.master.numel() for s in self.spaces if s.master is not None)
        return {"master": 4 * master, "moments": 8 * slice_n}


def bytes_per_param(dtype: str, distributed: bool, dp: int, *, moments: int = 8) -> dict[str, float]:
    """Training state per parameter on one rank at its peak: the one formula the training
    log, the planner and the memory pre-check use. Parts: weights; gradients (whole p.grad in
    the weights' dtype during backward, or after the dp reduction the fp32 reduced slice,
    whichever is larger: the whole gradients are freed bucket by bucket as the slice fills);
    the optimizer's state (AdamW's two fp32 moments, `moments` bytes; and the fp32 master
    copy where the weights are bf16), split over dp by the distributed optimizer.

    - plain fp32: 4 + 4 + 8 = 16
    - fp32, distributed: the fp32 weights are their own master (each rank steps its slice
      in place): 4 + 4 + 8 / dp = 8 + 8 / dp (Megatron-core's figure)
    - bf16 weights, fp32 master: 2 + max(2, 4 / s) + 12 / s with s = dp when distributed
      (4 + 12 / dp from dp = 2 on), else s = 1: 2 + 4 + 12 = 18
    """
    w = 2 if dtype == "bf16" else 4
    if dtype != "bf16" and not distributed:
        return {"weights": w, "grads": w, "optimizer": moments, "total": 2 * w + moments}
    share = dp if distributed else 1
    opt = ((4 if dtype == "bf16" else 0) + moments) / share
    grads = max(w, 4 / share)  # whole p.grad during backward, or the fp32 reduced slice after it
    return {"weights": w, "grads": grads, "optimizer": opt, "total": w + grads + opt}


def held_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes of the training state this rank holds now, from its tensors: weights, gradients
    (p.grad, whole between backward and the dp reduction; and the distributed optimizer's
    fp32 reduced slice, from the reduction to the step), the optimizer's state (AdamW's
    moments; a separate fp32 master copy where there is one)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    if isinstance(optimizer, DistributedOptimizer):
        grads += sum(s.grad.numel() * 4 for s in optimizer.spaces if s.grad is not None)
        opt = sum(s.master.numel() * 4 for s in optimizer.spaces if s.master is not None)
        state = optimizer.adamw.state
    else:
        opt, state = 0, optimizer.state
    opt += sum(t.numel() * t.element_size() for st in state.values() for k, t in st.items() if k != "step")
    return {"weights": weights, "grads": grads, "optimizer": opt}
