"""What runs on the ranks for calibration and validation (importable, so that MPI ranks
started by mpiexec can run it too).

    probe_rank       matmul FLOP/s, weight-streaming bandwidth, fixed time per layer and per step
                     (decode; and a training micro-step's, with its share of the matmul FLOP/s)
    after_compute_rank  small all-reduces between bursts of compute of several lengths, as in a step
    generation_rank  prefill and decode times of a checkpoint, steady state (after a warm-up)
    training_rank    training step times of a small model, with shardwise.train
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from shardwise.bench.timing import best_time
from shardwise.comm import Communicator, tp_only

CACHE_HIDDEN = 384
"""The cache-resident streaming probe's layer (probe_rank's cache_gbps): 16 x 384^2 fp32 weights, 9 MiB."""
ROWS = (2, 4, 8, 16, 32, 64)
"""Rows of the batched-decode matmul probe (1 row is the bandwidth probe, 128 the FLOP/s one)."""

__all__ = [
    "ROWS",
    "probe_rank",
    "after_compute_rank",
    "AFTER_COMPUTE_MS",
    "AFTER_COMPUTE_BIG",
    "generation_rank",
    "training_rank",
    "best_time",
    "decode_step_rank",
    "decode_shard_rank",
    "calls_us",
    "DECODE_CONFIG",
    "PP_HOP_CONFIGS",
    "pipeline_step_rank",
]


def _layers(dtype: torch.dtype, h: int = 1024, n: int = 6) -> list[torch.Tensor]:
    """Weights shaped like n transformer layers (qkv, o, gated up, down; intermediate 4h):
    64 MiB per layer in fp32, well beyond the caches, as a forward streams them."""
    out = []
    for _ in range(n):
        out += [torch.randn(s, dtype=dtype) for s in ((3 * h, h), (h, h), (8 * h, h), (h, 4 * h))]
    return out


def _through(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for i in range(0, len(weights), 4):
        qkv, o, up, down = weights[i : i + 4]
        F.linear(x, qkv)
        F.linear(x, o)
        F.linear(F.linear(x, up)[:, : down.shape[1]], down)


def _tiny_step_s(layers: int, repeats: int) -> float:
    """One decode step (T=1, with a KV cache) of a tiny model: its time is the fixed overhead."""
    from shardwise.models.config import ModelConfig
    from shardwise.models.decoder import DecoderLM

    cfg = ModelConfig("llama", 256, 64, 128, layers, 4, 2, 16)
    model = DecoderLM(cfg).eval()
    caches = model.new_caches(1, 64)
    ids, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 33, dtype=torch.long)

    @torch.no_grad()
    def step():
        model(ids, attention_mask=mask, caches=caches, start=32, last_only=True)[:, -1].argmax(-1)

    return best_time(step, repeats)


def probe_rank(world: Communicator, opts: dict) -> dict:
    """Rates of one rank, every rank of `world` running each probe at the same time.

    - matmul FLOP/s per dtype: 128 rows (a short prompt) through layer-shaped weights;
    - weight streaming bytes/s: one row (a decode step) through the same weights; and through
      one layer small enough to stay in the last-level cache (cache_gbps);
    - fp32 matmul FLOP/s at each of ROWS rows (a batched decode step): a CPU's small
      matrix products can run far below both its peak FLOP/s and its bandwidth;
    - fixed time per layer and per forward: a tiny model's decode step, 1 vs 5 layers;
    - with opts["training"]: the same for a training forward and backward, and the fraction
      of the matmul FLOP/s such a micro-step reaches (train_probe.training_probe)."""
    torch.manual_seed(world.rank)
    out: dict = {"gemm_tflops": {}}
    rows = opts.get("rows", 128)
    for name in opts.get("dtypes", ("float32", "bfloat16")):
        dtype = getattr(torch, name)
        ws = _layers(dtype)
        x = torch.randn(rows, ws[0].shape[1], dtype=dtype)
        flops = 2 * rows * sum(w.numel() for w in ws)
        out["gemm_tflops"][name] = (
            flops / best_time(lambda x=x, ws=ws: _through(x, ws), opts["repeats"], sync=world) / 1e12
        )
        if name == "float32":
            one = x[:1].contiguous()
            nbytes = sum(w.numel() for w in ws) * 4
            out["mem_gbps"] = (
                nbytes / best_time(lambda one=one, ws=ws: _through(one, ws), 2 * opts["repeats"], sync=world) / 1e9
            )
            out["rows_tflops"] = {}
            for m in ROWS:  # a batched decode step: m rows through the same weights
                xm = torch.randn(m, ws[0].shape[1], dtype=dtype)
                t = best_time(lambda xm=xm, ws=ws: _through(xm, ws), opts["repeats"], sync=world)
                out["rows_tflops"][str(m)] = 2 * m * sum(w.numel() for w in ws) / t / 1e12
        del ws
    # one row through weights that stay in the last-level cache between calls (a small model's
    # decode step streams its weights from there, not from memory): one layer of hidden 384,
    # 9 MiB in fp32 per rank, 18 MiB for 2 ranks at once
    ws = _layers(torch.float32, h=CACHE_HIDDEN, n=1)
    one = torch.randn(1, CACHE_HIDDEN)
    nbytes = sum(w.numel() for w in ws) * 4
    out["cache_gbps"] = (
        nbytes / best_time(lambda one=one, ws=ws: _through(one, ws), 20 * opts["repeats"], sync=world) / 1e9
    )
    out["cache_probe_bytes"] = nbytes
    del ws
    if world.size > 1:
        world.barrier()
    t1, t5 = _tiny_step_s(1, 5 * opts["repeats"]), _tiny_step_s(5, 5 * opts["repeats"])
    out["layer_overhead_us"] = max(t5 - t1, 0.0) / 4 * 1e6
    out["step_overhead_us"] = max(t1 * 1e6 - out["layer_overhead_us"], 0.0)
    if opts.get("training"):
        from shardwise.bench.train_probe import training_probe

        out |= training_probe(opts["repeats"], out["gemm_tflops"]["float32"] * 1e12)
    return out


AFTER_COMPUTE_BIG = (65536, (0.3, 1.0, 3.0))
"""The same probe with all-reduces of 65536 fp32 values (256 KiB: a training step's activations),
after bursts of these ms (opts "values", "bursts_ms"): what a big message costs more after compute."""
AFTER_COMPUTE_MS = (0.1, 0.3, 1.0, 3.0, 10.0)
"""Lengths of the bursts of compute before each collective in after_compute_rank: from a
decode step's attention block (a tenth of a millisecond) to a training layer's backward."""


def after_compute_rank(world: Communicator, opts: dict) -> dict:
    """What a small all-reduce costs inside a step, after a burst of compute, for bursts of
    several lengths: a synthetic step of n bursts (a matmul on cache-resident weights, about
    `ms` long), each followed by an all-reduce of 1024 fp32 values (4 KiB: a decode step's
    activations; opts["values"] others), against the same bursts with a single all-reduce at the end:

        per_call = (p10 of step time with - p10 without) / (n - 1)

    for the slowest rank (it sets the pace). A step-level figure, as the decode step's: it
    keeps the slow tail of the collectives (on gloo a few in every step take milliseconds
    instead of half of one) and a rank that leaves a collective late arriving late at the
    next one, which a per-collective median drops. Returns {"points": [{"burst_us",
    "per_call_us"}, ...]}, burst_us measured (the step without collectives / n).

    NOTE: every step starts after a barrier, so both ranks start it together."""
    n, steps, warmup = opts.get("calls", 19), opts.get("steps", 20), 3
    w = torch.randn(256, 1024)  # 1 MiB: stays in cache, so the burst is compute
    t = torch.ones(opts.get("values", 1024))
    points = []
    for ms in opts.get("bursts_ms", AFTER_COMPUTE_MS):
        x = torch.randn(max(1, round(ms * 1e-3 * opts.get("flops", 86e9) / (2 * w.numel()))), 1024)
        quantiles = {}
        for collectives in (True, False):
            times = []
            for i in range(warmup + steps):
                world.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    F.linear(x, w)
                    if collectives:
                        world.all_reduce(t)
                if not collectives:
                    world.all_reduce(t)  # the step ends together, as with collectives
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            quantiles[collectives] = sorted(times)[len(times) // 10]
        every = world.all_gather(torch.tensor([[quantiles[True], quantiles[False]]], dtype=torch.float64), dim=0)
        with_, without = every.amax(dim=0).tolist()  # the slowest rank's
        points.append({"burst_us": without / n * 1e6, "per_call_us": (with_ - without) / (n - 1) * 1e6})
    return {"points": points}


def generation_rank(world: Communicator, opts: dict) -> dict:
    """Load opts["model"] sharded over the world; time prefill and decode of batch x prompt_len
    prompts, `repeats` times after one warm-up (whose prefill is reported as cold), with the
    weights converted to opts["quantize"] when given and fp32 weights in the order `generate`
    picks for the batch (opts["decode_layout"] False: as loaded). Returns
    every prefill and decode step's time, and the time spent inside collectives in each
    (waiting for the other ranks included), read from the accounting after every step."""
    from shardwise.comm import ParallelDims
    from shardwise.engine import StageForward, generate, stage_layout
    from shardwise.hf import load_pretrained, read_config
    from shardwise.quant.layout import decode_layout

    pp, stages, stage = opts.get("pp", 1), None, None
    if pp == 1:
        tp = tp_only(world)
    else:  # pipeline stages, one after another, as `shardwise generate --pp` runs them
        mesh = ParallelDims(world_size=world.size, tp=world.size // pp, pp=pp).build(world)
        tp, stage = mesh.tp, (stage_layout(read_config(opts["model"])[1], pp), mesh.pp_rank)
    model, report = load_pretrained(opts["model"], comm=tp, stage=stage, quantize=opts.get("quantize"))
    if opts.get("decode_layout", True):  # as `shardwise generate` does
        decode_layout(model, rows=opts["batch"])
    if pp > 1:
        stages = StageForward(model, mesh)
    vocab = report.config.vocab_size
    prompts = [[(31 * i + 7 * b + 3) % vocab for i in range(opts["prompt_len"])] for b in range(opts["batch"])]
    cold = generate(model, prompts, comm=tp, max_new_tokens=2, stages=stages)
    prefill, prefill_comm, decode, decode_comm = [], [], [], []
    for _ in range(opts["repeats"]):
        marks = [tp.stats.seconds()]
        r = generate(
            model,
            prompts,
            comm=tp,
            max_new_tokens=opts["output_len"],
            on_tokens=lambda _, marks=marks: marks.append(tp.stats.seconds()),
            stages=stages,
        )
        prefill.append(r.prefill_ms)
        prefill_comm.append((marks[1] - marks[0]) * 1e3)
        decode += r.decode_ms
        decode_comm += [(b - a) * 1e3 for a, b in zip(marks[1:], marks[2:], strict=False)]
    return {
        "tp": tp.size,
        "pp": pp,
        "backend": world.backend,
        "cold_prefill_ms": cold.prefill_ms,
        "prefill_ms": prefill,
        "prefill_comm_ms": prefill_comm,
        "decode_ms": decode,
        "decode_comm_ms": decode_comm,
        "collectives_per_token": r.comm_per_step,
    }


def training_rank(world: Communicator, opts: dict) -> dict:
    """Train opts["config"] (a TrainConfig as nested dicts) for its run.steps steps with
    shardwise's own training step; every step's seconds (as StepStats reports them) and the
    time inside shardwise's collectives in it (waiting for other ranks included; DDP's
    all-reduces run inside torch and are not counted)."""
    from shardwise.train import TrainConfig, setup, train_step

    cfg = TrainConfig.from_dict(opts["config"])
    tr = setup(world, cfg)
    steps, comm = [], []
    for _ in range(cfg.run.steps):
        before = world.stats.seconds()
        steps.append(train_step(tr).seconds * 1e3)
        comm.append((world.stats.seconds() - before) * 1e3)
    return {"step_ms": steps, "comm_ms": comm, "sync": type(tr.sync).__name__}


DECODE_CONFIG = ("llama", 256, 64, 128, 4, 4, 2, 16)
"""The decode probe's model (ModelConfig's leading fields: a tiny llama of 4 layers, hidden 64):
its step is fixed costs and collectives, as a small model's decode step is."""
PP_HOP_CONFIGS = {
    "pp": DECODE_CONFIG,
    "pp_256": ("llama", 512, 256, 512, 4, 8, 4, 32),
    "pp_512": ("llama", 512, 512, 2048, 4, 8, 4, 64),
}
"""pipeline_step_rank's models across the veth (hostlinks; the built-in model's shape is the
second). On the Zen 3 VM of 2026-12-07 (calibration v21, two runs 23:45 and 00:05 UTC) their
stages took 0.31-0.36, 0.61-0.64 and 4.1-6.1 ms alone, and a message between them 0.39-0.42,
1.32-1.48 and 0.50-1.53 ms: the longer its receiver waited, the slower it resumed (the
largest stage's figure is the difference of two ~12 ms steps, the noisiest)."""


def decode_step_rank(world: Communicator, opts: dict) -> dict:
    """A decode step as `shardwise generate` runs it, tp over `world` (DECODE_CONFIG, random
    weights, batch 1): the layers (one native call where shardwise.kernels.step runs, op by op
    elsewhere, or with opts["native"] False), the LM head and the greedy choice as generate
    makes it (shardwise.engine.argmax: each rank's best, one all-gather of them). Per step, the median wall time, and per collective op the
    mean wall time of one call inside it over every step (shardwise's accounting: a native
    step's all-reduces are counted too, their spin for the peer included), with its calls a step:

        {"native": bool, "step_us": float, "ops": {op: {"calls": n, "bytes": per call, "us": per call}}}

    NOTE: the mean, not the median: a step's collectives are its sum, and on gloo their times
    are heavy-tailed (most calls ~0.5-1 ms, some 3-5 ms): the median of a step with ~10 calls
    follows the sum of their means, and the median call would leave the tail out.

    opts["config"]: the model (ModelConfig's leading fields; DECODE_CONFIG by default);
    opts["layers"]: its layers (default the config's). opts["wire"]: the tp group's
    all-reduce format (planner.wire; q8: each all-reduce is an all_to_all and an all_gather of
    encoded chunks, shardwise.comm.compress), fp32 by default.

    The slower rank's figures (it sets the pace)."""
    import contextlib
    import statistics

    from shardwise.engine.argmax import split_logits, vocab_parallel_argmax
    from shardwise.engine.generate import decode_step
    from shardwise.hf.families import FAMILIES
    from shardwise.kernels import step as native_step
    from shardwise.models.config import ModelConfig
    from shardwise.models.decoder import DecoderLM
    from shardwise.quant.layout import decode_layout
    from shardwise.sharding import parallelize

    torch.manual_seed(0)  # every rank the same weights, then its shard of them
    fields = list(opts.get("config", DECODE_CONFIG))
    fields[4] = opts.get("layers", fields[4])
    cfg = ModelConfig(*fields)
    model = parallelize(DecoderLM(cfg), FAMILIES["llama"].plan(cfg), comm=world).eval()
    decode_layout(model, rows=1)
    wire, world.wire = world.wire, opts.get("wire", "fp32")
    steps, warmup = opts.get("steps", 60), 10
    caches = model.new_caches(1, 8 + warmup + steps)
    ctx = contextlib.nullcontext if opts.get("native", True) else native_step.off
    walls, per_op = [], {}
    tok = torch.zeros(1, dtype=torch.long)
    with torch.no_grad(), ctx():
        for i in range(warmup + steps):
            before = {k: (c.calls, c.bytes, c.seconds) for k, c in world.stats.counts.items()}
            t0 = time.perf_counter()
            with split_logits(model) as head:  # greedy, as generate: each rank's best, one all-gather
                logits = decode_step(model, tok.view(1, 1), None, caches, i)  # (1, V / tp)
            tok = vocab_parallel_argmax(logits, head) if head is not None else logits.argmax(-1)
            wall = time.perf_counter() - t0
            if i < warmup:
                continue
            walls.append(wall)
            for (op, _), c in world.stats.counts.items():
                calls0, bytes0, s0 = before.get((op, _), (0, 0, 0.0))
                if c.calls > calls0:
                    n = c.calls - calls0
                    per_op.setdefault(op, []).append((n, (c.bytes - bytes0) / n, (c.seconds - s0) / n))
    world.wire = wire
    ran = any(e for e in model.__dict__.get("_step_programs", {}).values())
    mean_call = [sum(n * s for n, _, s in v) / sum(n for n, _, _ in v) for v in per_op.values()]
    mine = [statistics.median(walls)] + mean_call
    every = world.all_gather(torch.tensor([mine], dtype=torch.float64), dim=0).amax(dim=0).tolist()
    ops = {
        op: {"calls": v[0][0], "bytes": v[0][1], "us": every[1 + j] * 1e6} for j, (op, v) in enumerate(per_op.items())
    }
    return {"native": ran, "step_us": every[0] * 1e6, "ops": ops}


def calls_us(ops: dict) -> float:
    """The time a decode probe's step spent inside its collectives' calls (decode_step_rank's
    "ops": each op's calls x its mean call), us."""
    return sum(v["calls"] * v["us"] for v in ops.values())


def decode_shard_rank(world: Communicator, opts: dict) -> dict:
    """decode_step_rank on a tp group inside one host, as `generate` runs it there (its world
    wrapped in the shared-memory all-reduce, shardwise.comm.shm), every rank at once; with
    "fixed_us": the step less its collectives' calls (their spin for the slower rank
    included), what a rank of the group spends besides its collectives."""
    from shardwise.comm.shm import intra_host

    out = decode_step_rank(intra_host(world, mode="on") if world.size > 1 else world, opts)
    return {**out, "fixed_us": max(out["step_us"] - calls_us(out["ops"]), 0.0)}


def pipeline_step_rank(world: Communicator, opts: dict) -> dict:
    """A decode step as `shardwise generate --tp 1 --pp 2` runs it over `world` (2 ranks, one
    stage each; opts["config"]'s model, DECODE_CONFIG by default, random weights, batch 1): stage 0's layers, its hidden state
    sent to stage 1, stage 1's layers, head and argmax, and the token broadcast over the world
    (shardwise.engine.pipeline). Then each stage's same step alone, one rank at a time (the
    other waits at a barrier), as the two run in the pipeline: one after the other.

        {"step_us": median step, "alone_us": the stages' median steps alone, summed,
         "messages": 2, "bytes": the hidden state's bytes, "hop_us": (step - alone) / messages,
         "idle_us": alone / 2, "native": bool, "ops": {op: {"calls", "bytes", "us"}}}

    hop_us is one message of the pipeline's decode step, each stage's resuming after its wait
    included: the stage-to-stage send and the token broadcast are one message each way between
    two ranks that take turns, a ping-pong with compute between (not the all-reduce probes' case,
    where both ranks compute, then meet). The slower rank's figures. idle_us: how long each
    message's receiver waited for it, the other stage's compute (their mean): on a VM a rank
    that waited longer resumes slower (each hop costs more behind a bigger stage; PP_HOP_CONFIGS)."""
    import statistics

    from shardwise.comm import ParallelDims
    from shardwise.engine.pipeline import StageForward, stage_layout
    from shardwise.engine.sampling import SamplingParams
    from shardwise.hf.families import FAMILIES
    from shardwise.models.config import ModelConfig
    from shardwise.models.decoder import DecoderLM
    from shardwise.pipeline.stage import keep_stage
    from shardwise.quant.layout import decode_layout
    from shardwise.sharding import parallelize

    torch.manual_seed(0)
    cfg = ModelConfig(*opts.get("config", DECODE_CONFIG))
    mesh = ParallelDims(world_size=world.size, tp=1, pp=world.size).build(world)
    # as load_pretrained builds a stage: the whole model parallelized (tp=1), then cut
    model = parallelize(DecoderLM(cfg), FAMILIES["llama"].plan(cfg), comm=mesh.tp)
    model = keep_stage(model, stage_layout(cfg, world.size), mesh.pp_rank).eval()
    decode_layout(model, rows=1)
    stages, greedy = StageForward(model, mesh), SamplingParams()
    steps, warmup = opts.get("steps", 60), 10
    tok = torch.zeros(1, dtype=torch.long)
    walls, per_op = [], {}
    with torch.no_grad():
        caches = stages.new_caches(1, 8 + warmup + steps)
        for i in range(warmup + steps):
            before = {k: (c.calls, c.seconds) for k, c in world.stats.counts.items()}
            t0 = time.perf_counter()
            logits = stages.forward(tok.view(1, 1), None, caches, i)  # (1, 1, V) on the last stage
            tok = stages.choose(None if logits is None else logits[:, -1], 1, greedy, None)
            if i >= warmup:
                walls.append(time.perf_counter() - t0)
                for (op, _), c in world.stats.counts.items():
                    calls0, s0 = before.get((op, _), (0, 0.0))
                    if c.calls > calls0:
                        per_op.setdefault(op, []).append((c.calls - calls0, c.seconds - s0))
        # each stage alone: its layers (and head, argmax) with no message, one rank at a time
        hidden = torch.randn(1, 1, cfg.hidden_size)
        alone = 0.0
        for turn in range(world.size):
            world.barrier()
            if turn != world.rank:
                continue
            caches, times = stages.new_caches(1, 8 + warmup + steps), []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                x, rope, attn = model.prelude(tok.view(1, 1), None, None, True, i,
                                              hidden=None if mesh.is_first_stage else hidden)  # fmt: skip
                x = model.run_layers(x, rope, attn, caches, i)
                if mesh.is_last_stage:
                    model.head(x, True)[:, -1].argmax(-1)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            alone = statistics.median(times)
        world.barrier()
    ran = any(e for e in model.__dict__.get("_step_programs", {}).values())
    mine = torch.tensor([[statistics.median(walls), alone]], dtype=torch.float64)
    every = world.all_gather(mine, dim=0)  # (ranks, 2)
    step, alone_sum = every[:, 0].max().item(), every[:, 1].sum().item()
    ops = {op: {"calls": v[0][0], "us": sum(s for _, s in v) / sum(n for n, _ in v) * 1e6} for op, v in per_op.items()}
    return {"step_us": step * 1e6, "alone_us": alone_sum * 1e6, "messages": 2, "bytes": cfg.hidden_size * 4,
            "hop_us": max(0.0, step - alone_sum) / 2 * 1e6, "idle_us": alone_sum / world.size * 1e6, "native": ran,
            "ops": ops}  # fmt: skip
