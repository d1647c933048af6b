"""Predicted time of one layout: inference (prefill, decode) and training (one step).

Compute on a device is a roofline: max(FLOPs / achieved FLOP/s, bytes streamed / achieved
memory bandwidth), plus a fixed overhead per layer and per forward (training: the FLOP/s a
forward and backward reach, Device.train_efficiency, their own fixed times and the element-wise
work around the products, which a tp group does not split, when measured). Collectives follow the
alpha-beta model of their link (specs.Link), plus what the link measured a collective to
cost more after the burst of compute that precedes it (specs.Link.extra_after_s; the burst
is the compute of a pass divided among its collectives). Nothing overlaps: communication
adds to compute, as it does in shardwise's eager forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layers.partition import padded_size
from shardwise.models.config import ModelConfig
from shardwise.pipeline.stage import inference_layout
from shardwise.planner.cost import (
    EXPERT_LAUNCHES,
    Collective,
    all_to_all_s,
    attention_core_flops_per_token,
    ep_all_to_alls,
    experts_computed,
    head_flops_per_token,
    layers_flops_per_token,
    p2p_bytes_per_message,
    routed_flops_per_token,
    tp_backward_collectives,
    tp_forward_collectives,
    training_flops_per_token,
)
from shardwise.planner.footprint import (
    expert_params,
    kv_bytes_per_token,
    moe_layer_count,
    projections,
    stage_params,
    state_bytes,
    streamed_params,
    touched_experts,
)
from shardwise.planner.schedule import PipelineSchedule
from shardwise.planner.specs import Cluster, Device, TrainingWorkload

__all__ = [
    "Layout",
    "Timing",
    "mean_burst_s",
    "merge",
    "InferencePrediction",
    "TrainingPrediction",
    "predict_inference",
    "predict_training",
    "tp_wire",
    "native_step_runs",
]


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: str = ""
    """A mixture of experts' routed experts dealt out whole over this group: "tp" (inference,
    `--expert-parallel`), "dp" (training, tokens dispatched by all_to_all); "": every expert
    split over tp (tensor-parallel experts)."""

    @property
    def replica(self) -> int:
        """Devices of one model replica: tp x pp."""
        return self.tp * self.pp

    @property
    def expert_parallel(self) -> bool:
        return self.ep == "tp"

    @property
    def ep_dp(self) -> int:
        """The data-parallel ranks the experts are dealt over (1: none)."""
        return self.dp if self.ep == "dp" else 1

    def __str__(self) -> str:
        t, d = ("(ep)" if self.ep == "tp" else ""), ("(ep)" if self.ep == "dp" else "")
        return f"tp={self.tp}{t} pp={self.pp} dp={self.dp}{d}"

    def arg(self) -> str:
        """ "tp=2,pp=2,dp=1": what `shardwise train --layout` takes (ParallelSection.layout())."""
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"


@dataclass(frozen=True)
class Timing:
    compute_s: float
    comm_s: float
    bubble_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble_s


@dataclass(frozen=True)
class InferencePrediction:
    prefill: Timing
    decode: Timing
    """One decode step (one token per sequence), at the mean context of the output."""
    request_s: float
    """Prefill (gives the first token) + (output_len - 1) decode steps."""
    tokens_per_s: float
    """Decode throughput of all dp replicas together."""
    collectives: list[Collective]
    """Collectives of one decode step on the critical path (every stage's, one rank each)."""
    idle_fraction: float
    """Mean share of the time a pipeline stage waits, in a server keeping up to pp steps in
    flight (0 at pp = 1)."""
    serving_tokens_per_s: float = 0.0
    """A server's throughput with `batch` requests running at once, each its prefill then
    output_len tokens (the first from the prefill), the server's own work per step, per
    sequence and per request included (Device.serve_*_us): x dp."""
    stage_s: tuple[float, ...] = ()
    """Each stage's decode step (compute, collectives and its send), at the batch one step
    holds: the whole batch at pp = 1, one group of it at pp > 1."""

    @property
    def wire(self) -> str:
        """The tp all-reduces' wire format in the decode step (tp_wire): fp32, bf16 or q8."""
        return next((c.wire for c in self.collectives if c.op == "all_reduce" and c.group == "tp"), "fp32")


@dataclass(frozen=True)
class TrainingPrediction:
    step: Timing
    micro_batches: int
    tokens_per_s: float
    mfu: float
    """Model FLOPs (without recomputation) per second over the devices' dense peak."""
    collectives: list[Collective]
    """Collectives of one step on one rank of the busiest stage (its sends and receives to the
    neighbouring stages as send/pp)."""
    schedule: PipelineSchedule | None = None
    """The pipeline it assumes (schedule, m, layer split); None at pp = 1."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    """One micro-batch's forward and backward on the busiest rank (compute and tp collectives)."""

    @property
    def bubble_fraction(self) -> float:
        """The schedule's idle fraction of the pipeline part with free transfers (simulate's
        `bubble`): (p - 1) / (m + p - 1) for GPipe and 1F1B; 0 at pp = 1."""
        return 0.0 if self.schedule is None else self.schedule.bubble(self.forward_s, self.backward_s)


def mean_burst_s(compute_s: float, calls: int) -> float:
    """The compute before each of `calls` collectives that split `compute_s` of compute: the
    mean, compute_s / calls (all of it when there are none)."""
    return compute_s / max(calls, 1)


def native_step_runs(cfg: ModelConfig, cluster: Cluster, tp: int, *, tokens: int, batch: int, width: int,
                     quantize: str | None) -> bool:  # fmt: skip
    """Whether a forward's layers run as one native call (shardwise.models.step's conditions,
    as far as the planner sees them): a decode step (one token) of a plain pre-norm decoder
    (RMSNorm without offset, no q/k norm, no sandwich or post norms, a gated silu or gelu_tanh
    MLP, no experts, no parallel residual) on fp32 or a file's own block formats (no
    `--quantize`), with the device's native fixed costs measured, and at tp > 1 the group's
    all-reduces on a link whose native all-reduce was measured (the shared memory inside a
    host; across hosts, the tcp collectives the step hands each all-reduce to), fp32 on the
    wire (_forward's caller's part)."""
    plain = (cfg.norm == "rms" and not cfg.norm_offset and not cfg.qk_norm and not cfg.sandwich_norm
             and not cfg.post_norm and cfg.gated_mlp and cfg.act in ("silu", "gelu_tanh") and not cfg.num_experts
             and not cfg.parallel_residual)  # fmt: skip
    dev = cluster.device
    if tokens != 1 or not plain or quantize is not None or dev.native_layer_overhead_us is None:
        return False
    if tp == 1:
        return True
    act = batch * cfg.hidden_size * width
    return cluster.link_for(tp).carrier("all_reduce", act).native_all_reduce is not None


def _timed(c: Collective, cluster: Cluster, group_size: int, span: int, burst_s: float = 0.0, *,
           wire: str = "fp32", width: int = 4, decode: str = "", idle_s: float = 0.0) -> Collective:  # fmt: skip
    """`c` with its link and seconds: each call's alpha-beta time, plus what the link adds
    after `burst_s` of compute. The link is the one the group's span crosses, or the one under
    it for what it does not carry (specs.Link.carrier: a shared-memory all-reduce's gloo).
    `wire`: a tp all-reduce's format on the wire (planner.wire; fp32: one all-reduce of its
    values of `width` bytes). decode: in a decode step, "per_op" or "native" (the layers as one
    native call: its all-reduces in C): the link's decode figures where measured
    (specs.Link.decode_s), in place of the idle time and the after-compute extra. idle_s: a
    pipeline's decode message's receiver waited this long for it (specs.Link.hop_s)."""
    each = c.bytes / c.calls
    if c.op == "all_reduce" and wire != "fp32":  # an all_to_all and an all_gather of the encoded chunks
        from shardwise.planner.wire import all_reduce_s, encoded_decode_s

        link = cluster.link_for(span).carrier("all_gather", each)
        s = encoded_decode_s(link, each / width, group_size, wire, burst_s) if decode == "per_op" else None
        if s is None:
            s = all_reduce_s(link, each / width, group_size, wire) + 2 * link.extra_after_s(burst_s)
        return Collective(c.op, c.group, c.calls, c.bytes, f"{link.name}, {wire} wire", s * c.calls, wire)
    link = cluster.link_for(span).carrier(c.op, each)
    # NOTE: a pipeline's decode messages (a stage's send, the token's broadcast from the last
    # stage back to the first at pp=2) are a ping-pong between stages that take turns: the
    # link's pipeline figure where measured, not an all-reduce's extra after compute
    pipelined = c.op == "send" or (c.op == "broadcast" and c.group == "world" and group_size == 2)
    hop = link.hop_s(each, idle_s) if decode and pipelined else None
    if hop is not None:
        return Collective(c.op, c.group, c.calls, c.bytes, link.name, hop * c.calls)
    measured = link.decode_s(c.op, each, group_size, native=decode == "native", burst_s=burst_s) if decode else None
    if measured is not None:
        return Collective(c.op, c.group, c.calls, c.bytes, link.name, measured * c.calls)
    if c.op == "all_gather":
        s = link.all_gather_s(each, group_size)
    elif c.op == "reduce_scatter":  # each rank's input; ring: it moves what an all-gather of its share does
        s = link.all_gather_s(each / max(group_size, 1), group_size)
    elif c.op == "send":
        s = link.send_s(each)
    elif c.op == "all_to_all":
        s = all_to_all_s(link, each, group_size)
    else:  # all_reduce, broadcast (a tiny payload: its latency)
        s = link.all_reduce_s(each, group_size)
    s += link.extra_after_s(burst_s, each if c.op == "all_reduce" else 4096) if group_size > 1 else 0.0
    return Collective(c.op, c.group, c.calls, c.bytes, link.name, s * c.calls)


def tp_wire(comm_dtype: str, cluster: Cluster, tp: int, values: float, burst_s: float = 0.0, *,
            width: int = 4) -> str:  # fmt: skip
    """The wire format of a tp group's all-reduces of `values` values of `width` bytes
    (`--comm-dtype`): as given, or for "auto" what the runtime picks (planner.wire.choose_wire):
    fp32 (the values as they are) for a group inside one node, else the format predicted
    fastest on the link it crosses, each message paying the link's extra after `burst_s`."""
    if comm_dtype != "auto":
        return comm_dtype
    if tp <= 1 or tp <= cluster.devices_per_node:
        return "fp32"
    from shardwise.planner.wire import WIRE_BYTES, all_reduce_s

    link = cluster.link_for(tp)
    extra = link.extra_after_s(burst_s)
    times = {"fp32": link.carrier("all_reduce", values * width).all_reduce_s(values * width, tp) + extra}
    for w in ("bf16", "q8"):  # an all_to_all and an all_gather: two messages
        if WIRE_BYTES[w] < width:
            times[w] = all_reduce_s(link.carrier("all_gather", values), values, tp, w) + 2 * extra
    return min(times, key=times.get)


def merge(colls: list[Collective]) -> list[Collective]:
    """Sum collectives of the same op, group and link."""
    out: dict[tuple, Collective] = {}
    for c in colls:
        k = (c.op, c.group, c.link)
        o = out.get(k)
        if o is not None:
            c = Collective(c.op, c.group, o.calls + c.calls, o.bytes + c.bytes, c.link, o.seconds + c.seconds, c.wire)
        out[k] = c
    return list(out.values())


def _quantized_projections(cfg: ModelConfig, dev: Device, tp: int, quantize: str, *, layers: int, batch: int, tokens: int,
                           last: bool, busy: bool, expert_parallel: bool = False) -> tuple[float, float, float]:  # fmt: skip
    """The projections and the head of one stage's forward on `quantize`'s linear kernel: (their
    FLOPs, the parameters they stream, seconds at the kernel's measured rate). Every token runs
    through the dense projections (batch x tokens rows), the head sees the last position of
    each sequence (batch rows), and each touched expert its share of the routed pairs (at
    least one row: a touched expert streams all its weights)."""
    rows = batch * tokens
    touched = touched_experts(cfg, tp, rows, expert_parallel=expert_parallel) if cfg.num_experts else None
    proj = projections(cfg, tp, layers, experts=touched, expert_parallel=expert_parallel)
    dense = 2.0 * rows * proj.dense
    n_moe = moe_layer_count(cfg, layers)
    routed = rows * n_moe * routed_flops_per_token(cfg, tp, expert_parallel=expert_parallel) if n_moe else 0.0
    head = batch * head_flops_per_token(cfg, tp) if last else 0.0
    s = dense / dev.quantized_flops_at(quantize, rows, busy)
    s += head / dev.quantized_flops_at(quantize, batch, busy)
    if proj.routed:
        per_expert = max(routed / (2 * proj.routed), 1.0)  # rows through each touched expert
        s += 2 * proj.routed * per_expert / dev.quantized_flops_at(quantize, per_expert, busy)
    streamed = proj.params + (head / (2 * batch) if last else 0.0)
    return dense + routed + head, streamed, s


def _matrix_params(
    cfg: ModelConfig, tp: int, layers: int, rows: int, last: bool, *, expert_parallel: bool = False
) -> float:
    """Weights of the projections (the touched experts') and the head one forward streams on a rank."""
    touched = touched_experts(cfg, tp, rows, expert_parallel=expert_parallel) if cfg.num_experts else None
    proj = projections(cfg, tp, layers, experts=touched, expert_parallel=expert_parallel)
    return proj.params + (head_flops_per_token(cfg, tp) / 2 if last else 0.0)


def _stored_shares(cfg: ModelConfig, dev: Device) -> tuple[tuple[str, float], ...] | None:
    """A GGUF file's block formats and their shares of its matrices' weights, where the device
    measured every one's kernel (its float matrices stay on the roofline); else None."""
    shares = tuple((f, x) for f, x in cfg.stored_formats if f != "F32" and x > 0)
    if not shares or any(f not in dev.quantized_rows_tflops for f, _ in shares):
        return None
    return shares


def _stage_forward(cfg: ModelConfig, cluster: Cluster, tp: int, pp: int, stage: int, *, layers: int, batch: int,
                   tokens: int, context: float, width: int, dtype: str, busy: bool, expert_parallel: bool = False,
                   quantize: str | None = None, native: bool = False) -> tuple[float, list]:  # fmt: skip
    """One stage's forward of `tokens` new tokens for `batch` sequences: (compute seconds,
    [(collective, group size, span of ranks)]), its sends to the next stage included. With
    `quantize`, the projections and the head take the quantized kernel's measured time, added
    to the roofline of the rest (attention, norms, router, KV cache). native: the layers in one
    native call (native_step_runs), at the device's native fixed cost per layer."""
    dev = cluster.device
    first, last = stage == 0, stage == pp - 1
    ep = dict(expert_parallel=expert_parallel)
    flops = batch * tokens * layers_flops_per_token(cfg, context, tp, layers, **ep)
    flops += batch * head_flops_per_token(cfg, tp) if last else 0.0  # the last position only
    kv = batch * context * kv_bytes_per_token(cfg, tp, width, layers)
    nbytes = streamed_params(cfg, tp, pp, stage, layers=layers, rows=batch * tokens, **ep) * width + kv
    quantized_s = 0.0
    stored = _stored_shares(cfg, dev) if quantize is None and cfg.stored_bytes_per_weight else None
    if stored:  # a GGUF file in its own formats, each on its format's measured kernel
        for fmt, share in stored:
            done, streamed, s = _quantized_projections(cfg, dev, tp, fmt, layers=layers, batch=batch, tokens=tokens,
                                                       last=last, busy=busy, **ep)  # fmt: skip
            flops, nbytes = flops - share * done, nbytes - share * streamed * width
            quantized_s += share * s
    elif quantize is None and cfg.stored_bytes_per_weight:  # no kernel measured: its bytes stream
        nbytes -= _matrix_params(cfg, tp, layers, batch * tokens, last, **ep) * (width - cfg.stored_bytes_per_weight)
    if quantize is not None:  # the projections and the head on the quantized kernel, the rest as before
        done, streamed, quantized_s = _quantized_projections(cfg, dev, tp, quantize, layers=layers, batch=batch,
                                                             tokens=tokens, last=last, busy=busy, **ep)  # fmt: skip
        flops, nbytes = flops - done, nbytes - streamed * width
    rate = dev.flops_at(batch * tokens, dtype, busy)  # rows through every matmul
    fixed = layers + EXPERT_LAUNCHES * experts_computed(cfg, tp, layers, batch * tokens, **ep)
    per_layer = dev.native_overheads_us(tp)[0] if native else dev.layer_overhead_us
    # NOTE: the weights of every rank of the replica on this node (at most devices_per_node) stay
    # in its last-level cache between steps when they fit (stream_bytes_per_s)
    node_bytes = nbytes * min(cluster.devices_per_node, tp * pp)
    t = max(flops / rate, nbytes / dev.stream_bytes_per_s(node_bytes, busy)) + quantized_s + fixed * per_layer * 1e-6
    raw = []
    kw = dict(batch=batch, tokens=tokens, width=width, layers=layers, first=first, last=last)
    for c in tp_forward_collectives(cfg, tp, argmax=pp == 1, **kw):  # pp == 1: greedy, the logits split
        raw.append((c, tp, tp))
    if not last:  # the hidden states of every sequence to the next stage
        act = batch * tokens * cfg.hidden_size * width
        raw.append((Collective("send", "pp", 1, act), pp, tp * pp))
    return t, raw


def _forward(cfg: ModelConfig, cluster: Cluster, tp: int, pp: int, *, batch: int, tokens: int, context: float,
             width: int, dtype: str, busy: bool | None = None, expert_parallel: bool = False,
             quantize: str | None = None, comm_dtype: str = "fp32",
             native: bool | None = None) -> tuple[Timing, list[Collective], list[float]]:  # fmt: skip
    """One forward of `tokens` new tokens per sequence through every stage, one stage after the
    other (the runtime's inference split, pipeline.stage.inference_layout): its timing, its
    collectives, and each stage's own time (compute and collectives). busy: every device
    computes at once (default: the tp ranks of a stage, when tp > 1). comm_dtype: the tp
    all-reduces' wire format (tp_wire); an encoded one keeps the step op by op (the native step
    all-reduces fp32). native: whether the layers run as one native call (None: native_step_runs)."""
    busy = tp > 1 if busy is None else busy
    split = inference_layout(cfg, pp).layers
    if native is None:
        native = comm_dtype in ("fp32", "auto") and native_step_runs(
            cfg, cluster, tp, tokens=tokens, batch=batch, width=width, quantize=quantize
        )
    dev = cluster.device
    step_s = (dev.native_overheads_us(tp)[1] if native else dev.step_overhead_us) * 1e-6
    compute, raw, per_stage = 0.0, [], []
    for stage, layers in enumerate(split):
        t, r = _stage_forward(cfg, cluster, tp, pp, stage, layers=layers, batch=batch, tokens=tokens,
                              context=context, width=width, dtype=dtype, busy=busy,
                              expert_parallel=expert_parallel, quantize=quantize, native=native)  # fmt: skip
        # NOTE: every stage's rank runs a forward call of its own (prelude, the native call, its
        # message), one after the other: the step's fixed time is each stage's (at pp=2 the stages
        # alone measured 617 us a step for the probe's model, against 451 for it whole; 2026-12-07)
        t += step_s
        compute += t
        raw += r
        per_stage.append((t, r))
    if pp > 1:  # the sampled tokens (int64) reach every rank of the job (pp == 1: each rank chose them alike)
        raw.append((Collective("broadcast", "world", 1, 8 * batch), tp * pp, tp * pp))
    burst = mean_burst_s(compute, sum(c.calls for c, _, _ in raw))
    wire = tp_wire(comm_dtype, cluster, tp, batch * tokens * cfg.hidden_size, burst, width=width)
    if native and tp > 1 and wire != "fp32":  # auto chose an encoded wire: the step runs op by op
        return _forward(cfg, cluster, tp, pp, batch=batch, tokens=tokens, context=context, width=width, dtype=dtype,
                        busy=busy, expert_parallel=expert_parallel, quantize=quantize, comm_dtype=wire, native=False)  # fmt: skip
    decode = ("native" if native else "per_op") if tokens == 1 else ""
    # NOTE: a pipeline's message waits out the other stages' compute on its receiver (the next
    # stage; the token's broadcast: the first), which resumes the slower the longer it waited
    stage_t = [t for t, _ in per_stage]
    idle = [sum(stage_t) - stage_t[min(i + 1, len(stage_t) - 1)] for i, (_, r) in enumerate(per_stage) for _ in r]
    idle += [sum(stage_t) - stage_t[0]] * (len(raw) - len(idle))
    timed = [_timed(c, cluster, size, span, burst, wire=wire if c.group == "tp" else "fp32", width=width,
                    decode=decode, idle_s=w) for (c, size, span), w in zip(raw, idle, strict=True)]  # fmt: skip
    stage_s, i = [], 0
    for t, r in per_stage:
        stage_s.append(t + sum(c.seconds for c in timed[i : i + len(r)]))
        i += len(r)
    stage_s[-1] += sum(c.seconds for c in timed[i:])  # the sampled tokens' broadcast, after the last stage
    colls = merge(timed)
    return Timing(compute, sum(c.seconds for c in colls)), colls, stage_s


def predict_inference(cfg: ModelConfig, cluster: Cluster, layout: Layout, *, batch: int, prompt_len: int,
                      output_len: int, width: int, dtype: str, quantize: str | None = None,
                      comm_dtype: str = "fp32") -> InferencePrediction:  # fmt: skip
    """Prefill, then decode steps at the mean context. At pp > 1 a server keeps up to pp steps
    in flight: the batch's sequences form g = min(pp, batch) groups of ceil(batch / g), and a
    sequence's next token comes after its group's pass through every stage, or after g of the
    slowest stage's steps, whichever is longer (every device then computes at once).
    quantize: the weights' format (`--quantize`; None: `width` bytes, like the activations).
    comm_dtype: the tp all-reduces' wire format (`--comm-dtype`; tp_wire), fp32 by default.
    Greedy decoding: at pp == 1 the logits stay split and one all-gather of each rank's best
    chooses the token (shardwise.engine.argmax; a sampled request gathers them)."""
    tp, pp = layout.tp, layout.pp
    kw = dict(width=width, dtype=dtype, expert_parallel=layout.expert_parallel, quantize=quantize,
              comm_dtype=comm_dtype)  # fmt: skip
    prefill, _, _ = _forward(cfg, cluster, tp, pp, batch=batch, tokens=prompt_len, context=prompt_len, **kw)
    context = prompt_len + output_len / 2
    decode, colls, stages = _forward(cfg, cluster, tp, pp, batch=batch, tokens=1, context=context, **kw)
    dev = cluster.device
    idle, groups, rows = 0.0, 1, batch
    if pp > 1:
        groups = min(pp, batch)
        rows = -(-batch // groups)
        # NOTE: with one group (batch 1) one stage computes at a time; with more, all at once
        _, _, stages = _forward(cfg, cluster, tp, pp, batch=rows, tokens=1, context=context, busy=tp > 1 or groups > 1,
                                **kw)  # fmt: skip
        per_token = max(sum(stages), groups * max(stages))
        decode = Timing(decode.compute_s * per_token / decode.total_s, decode.comm_s * per_token / decode.total_s)
        idle = 1 - sum(stages) * groups / (pp * per_token)  # each stage computes groups x its step per token
    request = prefill.total_s + (output_len - 1) * decode.total_s
    # a server: rank 0's own work per step (on the first stage) and per request
    own = (dev.serve_step_us + rows * dev.serve_row_us) * 1e-6
    served = [stages[0] + own, *stages[1:]]
    per_token = max(sum(served), groups * max(served)) if pp > 1 else decode.total_s + own
    serve_request = prefill.total_s + dev.serve_request_us * 1e-6 + (output_len - 1) * per_token
    serving = layout.dp * batch * output_len / serve_request
    return InferencePrediction(
        prefill, decode, request, layout.dp * batch / decode.total_s, colls, idle, serving, tuple(stages)
    )


def _micro_batch(cfg: ModelConfig, cluster: Cluster, layout: Layout, wl: TrainingWorkload, *, layers: int,
                 first: bool, last: bool, stage: int, transfers: float) -> tuple[Timing, Timing, list[Collective]]:  # fmt: skip
    """One micro-batch's (forward, backward) on one rank of a stage with `layers` layers: compute
    and tensor-parallel collectives, the burst before each collective counting the stage's
    `transfers` sends and receives per micro-batch too; and those collectives, timed."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    prec, dev = wl.prec, cluster.device
    width, tokens = prec.weight_bytes, wl.micro_batch * wl.seq_len
    passes = 4 if wl.recompute == "full" else 3  # forward, backward = 2 forwards (+ 1 recomputed forward)
    busy = tp * pp * dp > 1  # every device of the layout works at once
    moe = dict(ep_dp=layout.ep_dp)
    layer_flops = tokens * layers_flops_per_token(cfg, wl.seq_len, tp, layers, **moe)
    head_flops = tokens * head_flops_per_token(cfg, tp) if last else 0.0
    # selective recompute: each attention core's forward once more, in backward
    redo = tokens * layers * attention_core_flops_per_token(cfg, wl.seq_len, tp) if wl.recompute == "selective" else 0.0
    streamed = streamed_params(cfg, tp, pp, stage, layers=layers, **moe) * width
    launches = EXPERT_LAUNCHES * experts_computed(cfg, tp, layers, None, **moe)  # every expert held
    flops_s = dev.train_flops(prec.compute, busy)
    if dev.train_layer_overhead_us is not None:  # measured for a forward and backward: 1/3 and 2/3 of it
        layer_us, step_us = dev.train_layer_overhead_us, dev.train_step_overhead_us or 0.0
        if tp > 1 and dev.train_tp_layer_overhead_us is not None:  # a shard's own: its region copies
            layer_us, step_us = dev.train_tp_layer_overhead_us, dev.train_tp_step_overhead_us or 0.0
        overhead = ((layers + launches) * layer_us + step_us) * 1e-6 / 3
    else:
        overhead = ((layers + launches) * dev.layer_overhead_us + dev.step_overhead_us) * 1e-6
    # the element-wise work around the products (norms, residuals, region copies): every rank
    # of a tp group does all of it (sequence parallelism: its 1/tp of the tokens), at the
    # compute's pace while every device works; measured for a forward and backward: 1/3 a pass
    values = tokens * cfg.hidden_size * layers / (tp if wl.sequence_parallel else 1)
    pace = dev.train_flops(prec.compute) / flops_s
    overhead += (dev.train_unsplit_ns or 0.0) * 1e-9 * values * pace / 3

    def compute(forwards: int, heads: int, reads: int, extra: float = 0.0) -> float:
        flops = forwards * layer_flops + heads * head_flops + extra
        return max(flops / flops_s, reads * streamed / dev.bytes_per_s(busy)) + forwards * overhead

    # gradient accumulation: every micro-batch after the first adds its gradients into .grad.
    # shardwise.train adds them within the weight-gradient products (kernels.wgrad): one more
    # read of .grad; under DDP (dp > 1 on one stage, dense: torch's reducer watches autograd's
    # own accumulation) a pass of its own that reads both and writes the sum
    m = wl.global_batch // (wl.micro_batch * dp)
    grads = stage_params(cfg, tp, pp, stage, layers=layers, **moe) * prec.grad_bytes
    ddp = dp > 1 and pp == 1 and not cfg.num_experts and not wl.distributed_optimizer
    accumulate = (3 if ddp else 1) * grads / dev.bytes_per_s(busy) * (m - 1) / m
    fwd_c, bwd_c = compute(1, 1, 1), compute(passes - 1, 2, 2, redo) + accumulate
    kw = dict(batch=wl.micro_batch, tokens=wl.seq_len, width=width, layers=layers, last=last)
    fwd = tp_forward_collectives(cfg, tp, first=first, logit_rows=0, **kw)
    bwd = tp_backward_collectives(
        cfg, tp, recompute=wl.recompute == "full", sequence_parallel=wl.sequence_parallel, **kw
    )
    a2a_f, a2a_b = ep_all_to_alls(cfg, layout.ep_dp, tokens=tokens, width=width, layers=layers)
    burst = mean_burst_s(fwd_c + bwd_c, sum(c.calls for c in fwd + bwd + a2a_f + a2a_b) + round(transfers))
    fwd_t = [_timed(c, cluster, tp, tp, burst) for c in fwd] + [_timed(c, cluster, dp, tp * dp, burst) for c in a2a_f]
    bwd_t = [_timed(c, cluster, tp, tp, burst) for c in bwd] + [_timed(c, cluster, dp, tp * dp, burst) for c in a2a_b]
    f = Timing(fwd_c, sum(c.seconds for c in fwd_t))
    b = Timing(bwd_c, sum(c.seconds for c in bwd_t))
    return f, b, fwd_t + bwd_t


def predict_training(
    cfg: ModelConfig, cluster: Cluster, layout: Layout, wl: TrainingWorkload, schedule: PipelineSchedule | None = None
) -> TrainingPrediction:
    """One optimizer step: m micro-batches through the pipeline (`schedule`; at pp > 1 the
    default is 1F1B with the runtime's balanced layer split), then the data-parallel gradient
    all-reduce (not overlapped), the tied embedding's all-reduce between the first and last
    stage, the gradient norm and clipping, and the optimizer update (both memory-bound).

    The pipeline part is the schedule's makespan (shardwise.pipeline.simulate, every action
    timed as the busiest rank's forward or backward, each send/receive as one stage-to-stage
    transfer of micro_batch x seq x hidden values on the link between stages); what it adds
    beyond the busiest rank's own compute, collectives and transfers is the bubble."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    prec, dev = wl.prec, cluster.device
    m = wl.global_batch // (wl.micro_batch * dp)
    if pp > 1 and schedule is None:
        schedule = PipelineSchedule.build("1f1b", cfg.num_layers, pp, m)
    prof = schedule.profile() if schedule is not None else None
    act_bytes = p2p_bytes_per_message(wl.micro_batch, wl.seq_len, cfg.hidden_size, prec.weight_bytes)
    worst = None
    for stage in range(pp):
        layers = schedule.rank_layers(stage) if schedule is not None else cfg.num_layers
        last = schedule.holds_head(stage) if schedule is not None else True
        transfers = prof.transfers[stage] / m if prof is not None else 0.0  # per micro-batch
        f, b, colls = _micro_batch(cfg, cluster, layout, wl, layers=layers, first=stage == 0, last=last,
                                   stage=stage, transfers=transfers)  # fmt: skip
        if worst is None or f.total_s + b.total_s > worst[0].total_s + worst[1].total_s:
            worst = (f, b, colls, stage, layers)
    f, b, colls, stage, layers = worst
    per_step = [Collective(c.op, c.group, c.calls * m, c.bytes * m, c.link, c.seconds * m) for c in colls]
    tau = f.total_s + b.total_s
    pipeline_s = m * tau
    if schedule is not None:
        # the link between stages: neighbours are tp x dp ranks apart (ranks: tp fastest, then dp, then pp)
        link = cluster.link_for(tp * dp * pp)
        burst = mean_burst_s(
            f.compute_s + b.compute_s, sum(c.calls for c in colls) // m + round(prof.transfers[stage] / m)
        )
        send_s = link.send_s(act_bytes) + link.extra_after_s(burst)
        calls = round(prof.transfers[stage])
        per_step.append(Collective("send", "pp", calls, calls * act_bytes, link.name, calls * send_s))
        pipeline_s = schedule.makespan(f.total_s, b.total_s, send_s)
        if cfg.tie_embeddings:  # the two copies' gradients summed (first and last stage)
            tied = Collective("all_reduce", "embed", 1, padded_size(cfg.vocab_size, tp) // tp * cfg.hidden_size
                              * prec.grad_bytes)  # fmt: skip
            per_step.append(_timed(tied, cluster, 2, tp * dp * pp, f.compute_s + b.compute_s))
    n_params = stage_params(cfg, tp, pp, stage, layers=layers, ep_dp=layout.ep_dp)
    # experts dealt over dp have one copy each: their gradients are not all-reduced over dp
    replicated = n_params - (expert_params(cfg, tp, layers, ep_dp=dp) if layout.ep == "dp" else 0)
    if dp > 1 and wl.distributed_optimizer:  # fp32 grads reduce-scattered, the weights all-gathered after
        grads = Collective("reduce_scatter", "dp", 1, replicated * 4)
        per_step.append(_timed(grads, cluster, dp, tp * dp, f.compute_s + b.compute_s))
        per_step.append(
            _timed(Collective("all_gather", "dp", 1, replicated * prec.weight_bytes // dp), cluster, dp, tp * dp)
        )
    elif dp > 1:  # after the last micro-batch's backward: all of it is the burst before
        grads = Collective("all_reduce", "dp", 1, replicated * prec.grad_bytes)
        per_step.append(_timed(grads, cluster, dp, tp * dp, f.compute_s + b.compute_s))
    per_step = merge(per_step)
    # the update reads and writes the weights, gradients and optimizer state once (its 1/dp share
    # of the state under the distributed optimizer): footprint.state_bytes, as the runtime holds them
    state = sum(state_bytes(cfg, tp, pp, stage, layers=layers, width=prec.weight_bytes, optimizer=wl.optimizer,
                            dp=dp, ep_dp=layout.ep_dp, distributed_optimizer=wl.distributed_optimizer))  # fmt: skip
    optimizer_s = 2 * state / dev.optimizer_bytes_per_s(tp * pp * dp > 1)  # read and write every byte once
    # the gradient norm shardwise.train takes every step (each gradient read once) and the clipping
    # by it (read and written): three passes over this rank's gradients (the distributed
    # optimizer's: its 1/dp slice, in fp32)
    held = replicated / dp * 4 if dp > 1 and wl.distributed_optimizer else n_params * prec.grad_bytes
    norm_s = 3 * held / dev.bytes_per_s(tp * pp * dp > 1)
    comm_s = sum(c.seconds for c in per_step)
    compute_s = m * (f.compute_s + b.compute_s) + optimizer_s + norm_s
    own = m * (f.comm_s + b.comm_s) + sum(c.seconds for c in per_step if c.group == "pp")
    step = Timing(compute_s, comm_s, max(0.0, pipeline_s - m * (f.compute_s + b.compute_s) - own))
    tokens_step = wl.global_batch * wl.seq_len
    model_flops = tokens_step * training_flops_per_token(cfg, wl.seq_len, recompute=False)
    peak = dev.peak_tflops.get(prec.compute, dev.peak_tflops.get("float32", 0.0)) * 1e12
    mfu = model_flops / (step.total_s * tp * pp * dp * peak) if peak else 0.0
    return TrainingPrediction(
        step, m, tokens_step / step.total_s, mfu, per_step, schedule, forward_s=f.total_s, backward_s=b.total_s
    )
