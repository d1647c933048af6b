"""Running a schedule: one rank executes its action list on its stage of the model.

    runner = PipelineRunner(model, layout, mesh.pp, actions[mesh.pp_rank], hidden_size=cfg.hidden_size)
    loss_sum = runner.run(batches, loss_fn)      # batches: [(ids, targets)] * m, the same on every stage

Each action is done in list order (pipeline/actions.py):

    FORWARD   virtual stage s on micro-batch i: the embedding (s == 0) or the received
              input, s's layers, and on the last stage the head and loss_fn(logits, targets)
    BACKWARD  loss.backward() on the last stage, else output.backward(received gradient);
              the input's gradient is kept for SEND_GRAD
    SEND_*    a blocking send on the pp communicator (timeout and accounting as every
    RECV_*    collective: `send/pp`, `recv/pp`)

The lists come from pipeline/schedules.py, whose transfer placement cannot deadlock with
blocking point-to-point (pipeline/transfers.py); no isend/irecv is used. Stage boundary
tensors are (micro_batch, seq, hidden) in the parameters' dtype; each micro-batch has
the same shape, so the receiver knows what to expect (comm `p2p_check` verifies it).
Under sequence parallelism (seq_shards = tp) each tp rank sends and receives only its
(micro_batch, seq / tp, hidden) shard, to the rank of the same tp coordinate.

A received input is a leaf with requires_grad; a stage's output is freed after its
backward, so a rank holds at most the activations of the micro-batches in flight
(GPipe: m; 1F1B: min(p - s, m) on stage s), which `stats` measures.

Mixture of experts (`router=RouterAux(...)`): the load-balancing loss pools the routing
statistics of every MoE layer, on every stage. Its gradient with respect to a token's
probability of expert e is E * P_e / N^2 (P_e: top-k picks of e over all layers, N: rows
over all layers; picks are not differentiable), so each stage needs only the totals:
each SEND_ACT is followed by a (2E + 1,) float32 message, the picks, probability sums and
rows of stages 0..s accumulated; the last stage sums them over dp (its replicas run in
lockstep) and so knows the totals of micro-batch m, which follow each SEND_GRAD back. A
stage's BACKWARD of m (always after every forward of m) then also backpropagates

    surrogate = coef * dp * E * sum_e (P_e / N) * (probs_e / N) / m_count

with probs_e its own layers' (and its own dp replica's) probability sums and P, N held
constant: summed over stages and dp-averaged, exactly the gradient of coef * aux / m_count
over the global micro-batch, as at pp = 1. `aux_sum` is the loss's value (mean over the
micro-batches) on the last stage, 0 elsewhere.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.pipeline.actions import Action
from shardwise.pipeline.stage import StageLayout

__all__ = ["PipelineRunner", "RouterAux", "StageStats"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StageStats:
    """What one rank's last `run` did (seconds are wall clock on this rank)."""

    compute_s: float = 0.0
    """In FORWARD and BACKWARD actions."""
    transfer_s: float = 0.0
    """In sends and receives, waiting for the peer included: the stage's idle time."""
    wall_s: float = 0.0
    peak_in_flight: int = 0
    """Most micro-batches whose activations were held at once."""
    peak_activation_bytes: int = 0
    """Most bytes of tensors saved for backward at once (parameters not counted); 0 unless
    the runner measures memory."""
    p2p_bytes: int = 0
    """Bytes sent to and received from neighbouring stages."""

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.compute_s / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss at pp > 1 (see the module docstring)."""

    num_experts: int
    top_k: int
    coef: float
    dp: Communicator
    """The ranks holding this stage's other tokens: the statistics are summed over it."""


def _router_stats(blocks: list, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picks (E,), probability sums (E,) with their graph, rows ()) of the blocks' last
    forward, as models.moe.load_balancing_loss counts them."""
    picks = torch.zeros(num_experts, dtype=torch.float32)
    probs = torch.zeros(num_experts, dtype=torch.float32)
    rows = torch.zeros((), dtype=torch.float32)
    for b in blocks:
        p = torch.softmax(b.router_logits, dim=-1, dtype=torch.float32)  # (N, E)
        _, idx = torch.topk(p, top_k, dim=-1)
        picks = picks + torch.bincount(idx.reshape(-1), minlength=num_experts).float()
        probs = probs + p.sum(dim=0)
        rows = rows + p.shape[0]
    return picks, probs, rows


class PipelineRunner:
    """Executes one rank's action list on its stage of a DecoderLM (cut by keep_stage)."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        pp: Communicator,
        actions: list[Action],
        *,
        hidden_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        measure_memory: bool = False,
        seq_shards: int = 1,
        router: RouterAux | None = None,
    ) -> None:
        if pp.size != layout.pp:
            raise ValueError(f"the pp communicator has {pp.size} ranks, the layout {layout.pp} stages")
        self.model, self.layout, self.pp, self.actions = model, layout, pp, actions
        self.hidden_size, self.autocast, self.measure_memory = hidden_size, autocast, measure_memory
        self.seq_shards = seq_shards
        """Sequence parallelism's tp size: a boundary tensor holds T / seq_shards positions."""
        self.ranges = layout.ranges()
        self.last = layout.stages - 1
        self.dtype = next(model.parameters()).dtype
        self._param_ptrs = {p.data_ptr() for p in model.parameters()}
        self.stats = StageStats()
        self.router = router
        if router is not None:
            from shardwise.models.moe import MoE

            layers = getattr(model, "layers", {})
            self._blocks = [
                [m for i in r if str(i) in layers for m in layers[str(i)].modules() if isinstance(m, MoE)]
                for r in self.ranges
            ]  # the MoE blocks of each virtual stage this rank holds
        self.aux_sum = torch.zeros(())

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of every micro-batch (batches[i] = (ids (B, T), targets (B, T)));
        gradients accumulate in the parameters. Returns the sum of loss_fn over the
        micro-batches on the rank holding the last stage, 0 elsewhere (detached)."""
        self.batches, self.loss_fn = batches, loss_fn
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # received (or embedded) stage inputs
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # stage outputs, or the loss on the last
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # received output gradients
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}  # to send back
        self.saved: dict[tuple[int, int], int] = {}  # bytes saved for backward, per (mb, stage)
        self.stats = StageStats()
        self.loss_sum = torch.zeros(())
        self.aux_sum = torch.zeros(())
        self.stats_in: dict[tuple[int, int], torch.Tensor] = {}  # router statistics of the stages before
        self.stats_out: dict[tuple[int, int], torch.Tensor] = {}  # ... and of this one: to send on
        self.probs: dict[tuple[int, int], torch.Tensor] = {}  # this stage's probability sums (with graph)
        self.totals: dict[tuple[int, int], torch.Tensor] = {}  # the micro-batch's totals, over all stages
        start = time.perf_counter()
        for action in self.actions:
            t0 = time.perf_counter()
            getattr(self, f"_{action.kind.value.lower()}")(action)
            spent = time.perf_counter() - t0
            if action.is_transfer:
                self.stats.transfer_s += spent
            else:
                self.stats.compute_s += spent
        self.stats.wall_s = time.perf_counter() - start
        dicts = (self.inputs, self.outputs, self.grads, self.input_grads, self.stats_in, self.stats_out, self.probs)
        leftover = [k for d in (*dicts, self.totals) for k in d]
        if leftover:  # a schedule bug, which the simulator should have caught
            raise RuntimeError(f"pipeline rank {self.pp.rank}: (micro-batch, stage) {leftover[:4]} left unconsumed")
        return self.loss_sum

    def _shape(self, mb: int) -> tuple[int, int, int]:
        B, T = self.batches[mb][0].shape
        return (B, T // self.seq_shards, self.hidden_size)  # sequence parallel: this tp rank's positions

    # ---- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        key, s = (a.microbatch, a.stage), a.stage
        ids, targets = self.batches[a.microbatch]
        hidden = self.inputs.get(key) if s > 0 else None
        if s > 0 and hidden is None:
            raise RuntimeError(f"pipeline rank {self.pp.rank}: {a} before its input arrived")
        hooks = self._counting(key) if self.measure_memory else contextlib.nullcontext()
        with hooks, self.autocast():
            x, rope, mask = self.model.prelude(ids, hidden=hidden)
            x = self.model.run_layers(x, rope, mask, layers=self.ranges[s])  # (B, T, hidden)
            if s == self.last:
                out = self.loss_fn(self.model.head(x), targets)  # scalar, already scaled
                self.loss_sum = self.loss_sum + out.detach().float()
            else:
                out = x.to(self.dtype)
        if self.router is not None:
            out = self._router_forward(key, out)
        self.outputs[key] = out
        in_flight = len(self.outputs)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, in_flight)
        if self.measure_memory:
            live = sum(self.saved.values())
            self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, live)

    def _backward(self, a: Action) -> None:
        key = (a.microbatch, a.stage)
        out = self.outputs.pop(key)
        if a.stage == self.last:
            out.backward()  # the surrogate already added (_router_forward)
        elif self.router is not None and self.probs[key].requires_grad:
            totals = self.totals[key] if a.stage > 0 else self.totals.pop(key)
            torch.autograd.backward([out, self._surrogate(self.probs.pop(key), totals)], [self.grads.pop(key), None])
        else:
            self.probs.pop(key, None)
            if a.stage == 0:
                self.totals.pop(key, None)
            torch.autograd.backward(out, self.grads.pop(key))
        self.saved.pop(key, None)
        if a.stage > 0:
            inp = self.inputs.pop(key)
            self.input_grads[key] = inp.grad

    # ---- the load-balancing loss (see the module docstring) ----------------------------------
    def _router_forward(self, key: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
        """Count this stage's routing; the last stage adds the surrogate to its loss."""
        r = self.router
        picks, probs, rows = _router_stats(self._blocks[key[1]], r.num_experts, r.top_k)
        mine = torch.cat([picks, probs.detach(), rows.reshape(1)])  # (2E + 1,)
        before = self.stats_in.pop(key, None)
        acc = mine if before is None else before + mine
        self.probs[key] = probs
        if key[1] != self.last:
            self.stats_out[key] = acc
            return out
        totals = r.dp.all_reduce(acc) if r.dp.size > 1 else acc  # the global micro-batch's
        E = r.num_experts
        P, prob_sums, N = totals[:E], totals[E:-1], totals[-1]
        self.aux_sum = self.aux_sum + E * torch.sum((P / N) * (prob_sums / N)) / len(self.batches)
        self.totals[key] = totals
        local = self.probs.pop(key)
        return out + self._surrogate(local, totals) if local.requires_grad else out

    def _surrogate(self, probs: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        r, E = self.router, self.router.num_experts
        P, N = totals[:E], totals[-1]
        scale = r.coef * r.dp.size * E / len(self.batches)
        return scale * torch.sum((P / N) * (probs / N))

    def _stats_size(self) -> int:
        return 2 * self.router.num_experts + 1

    def _counting(self, key: tuple[int, int]) -> contextlib.AbstractContextManager:
        """Count the bytes autograd saves for this forward's backward (not parameters)."""
        self.saved[key] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in self._param_ptrs:
                self.saved[key] += t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    # ---- transfers ---------------------------------------------------------------------------
    def _send_act(self, a: Action) -> None:
        t = self.outputs[(a.microbatch, a.stage)].detach()
        self.pp.send(t, a.peer)
        self.stats.p2p_bytes += t.numel() * t.element_size()
        if self.router is not None:
            self.pp.send(self.stats_out.pop((a.microbatch, a.stage)), a.peer)

    def _recv_act(self, a: Action) -> None:
        t = self.pp.recv(self._shape(a.microbatch), self.dtype, a.peer)
        self.inputs[(a.microbatch, a.stage)] = t.requires_grad_()
        self.stats.p2p_bytes += t.numel() * t.element_size()
        if self.router is not None:
            stats = self.pp.recv((self._stats_size(),), torch.float32, a.peer)
            self.stats_in[(a.microbatch, a.stage)] = stats

    def _send_grad(self, a: Action) -> None:
        g = self.input_grads.pop((a.microbatch, a.stage))
        self.pp.send(g, a.peer)
        self.stats.p2p_bytes += g.numel() * g.element_size()
        if self.router is not None:
            self.pp.send(self.totals.pop((a.microbatch, a.stage)), a.peer)

    def _recv_grad(self, a: Action) -> None:
        g = self.pp.recv(self._shape(a.microbatch), self.dtype, a.peer)
        self.grads[(a.microbatch, a.stage)] = g
        self.stats.p2p_bytes += g.numel() * g.element_size()
        if self.router is not None:
            totals = self.pp.recv((self._stats_size(),), torch.float32, a.peer)
            self.totals[(a.microbatch, a.stage)] = totals
