"""What each rank of `shardwise serve` runs: load the shard, then step until the job ends.

At pp > 1 (tp x pp ranks) every rank loads only its stage's layers on its tp slice; rank 0
(stage 0, tp rank 0) still runs HTTP and the scheduler, and the steps travel stage to stage
with up to pp of them in flight (serve/pipelined.py); the last stage's logits come back to
rank 0, which samples as at pp 1.

    rank 0      HTTP (uvicorn, a daemon thread) and the scheduler; the main thread runs
                the engine loop: next_batch -> send_step -> forward -> sample -> deliver,
                and when idle a NOOP step and a barrier every HEARTBEAT_S
    rank 1..N   recv_step -> the same forward; NOOP -> barrier; STOP -> return

Every step is the same sharded forward on every rank (its collectives are inside the
model). If any collective fails (a rank died, raised, or hangs past the timeout), rank 0
fails every queued and running request with an error, lets the HTTP thread send those
errors for DRAIN_S, and raises: the launcher then takes every rank down and the
`shardwise serve` process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwise.comm import Communicator, ParallelDims, tp_only
from shardwise.engine.argmax import split_head, split_logits, vocab_parallel_argmax
from shardwise.engine.paged import BlockTables, PagedCaches, blocks_for, kept_window
from shardwise.engine.pipeline import StageForward
from shardwise.engine.slots import StepBatch
from shardwise.engine.text import load_tokenizer, stop_ids
from shardwise.log import get_logger, setup_logging
from shardwise.memory import fmt_bytes
from shardwise.pipeline.stage import StageLayout
from shardwise.serve.app import ServerState, build_app
from shardwise.serve.budget import KVBudget, size_pool
from shardwise.serve.http import bind, start_http
from shardwise.serve.metrics import Metrics
from shardwise.serve.pipelined import InFlight, PipelineTicks
from shardwise.serve.scheduler import Scheduler
from shardwise.serve.step import HEADER_LEN, Kind, recv_step, send_step
from shardwise.serve.text import ChatTemplate

__all__ = ["ServeOptions", "serve_rank", "start_server", "lead_until_failure", "HEARTBEAT_S"]

HEARTBEAT_S = 0.5
"""Idle period after which rank 0 runs a NOOP step with a barrier (a dead rank shows within it)."""
DRAIN_S = 0.5
"""After a failure, how long rank 0 keeps answering (errors, 503) before it exits."""

log = get_logger("serve")


@dataclass(frozen=True)
class ServeOptions:
    model: str
    model_name: str
    dtype: str | None
    quantize: str | None
    host: str
    port: int
    max_batch_size: int
    max_model_len: int
    max_queue: int
    max_body_bytes: int
    health_timeout: float
    fail_rank: int | None = None
    fail_after: int = 0
    pp: int = 1
    num_layers: int = 0
    """The model's decoder layers (for the stage split at pp > 1)."""
    pp_layers: tuple[int, ...] | None = None
    """Layers per stage (pp > 1), as the command resolved them."""
    expert_parallel: bool = False
    """Mixture-of-experts layers hold whole experts per tp rank (shardwise.layers.moe)."""
    kv_budget: KVBudget | None = None
    """The paged KV pool's budget per rank (serve/budget.py); None: as many blocks as
    max_batch_size sequences of max_model_len tokens take."""
    activation_bytes: float = 0.0
    """One prefill's activations (the planner's estimate), kept out of a fractional budget."""

    prefix_caching: bool = True
    """Share the KV blocks of identical prompt prefixes (engine/paged.BlockTables)."""
    comm_dtype: str = "auto"
    """What the tp group's all-reduces carry on the wire (shardwise.planner.wire.choose_wire)."""
    auto: bool = False
    """A model of the automatic plan (shardwise.hf.auto): served by serve/auto.py, one request at a time."""

    def budget(self) -> KVBudget:
        cap = self.max_batch_size * blocks_for(self.max_model_len)
        return self.kv_budget or KVBudget("max-batch-size x max-model-len", fraction=1.0, cap_blocks=cap)


class _Fault:
    """--debug-fail-rank R --debug-fail-after N: rank R raises at its (N+1)-th step (tests only)."""

    def __init__(self, rank: int, opts: ServeOptions) -> None:
        self.armed, self.after, self.rank, self.steps = opts.fail_rank == rank, opts.fail_after, rank, 0

    def step(self) -> None:
        self.steps += 1
        if self.armed and self.steps > self.after:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.steps} (--debug-fail-rank)")


class _Engine:
    """This rank's model (at pp > 1: its stage's layers, run by serve.pipelined) and slot caches."""

    def __init__(self, world: Communicator, opts: ServeOptions) -> None:
        from shardwise.hf import load_pretrained
        from shardwise.quant.layout import decode_layout

        self.world, self.stages, stage = world, None, None
        if opts.pp == 1:
            self.tp = tp_only(world)
        else:
            mesh = ParallelDims(world_size=world.size, tp=world.size // opts.pp, pp=opts.pp).build(world)
            self.tp, stage = (
                mesh.tp,
                (StageLayout.build(opts.num_layers, opts.pp, pp_layers=opts.pp_layers), mesh.pp_rank),
            )
        self.model, self.report = load_pretrained(
            opts.model,
            comm=self.tp,
            dtype=opts.dtype,
            progress=False,
            stage=stage,
            expert_parallel=opts.expert_parallel,
            quantize=opts.quantize,
        )
        from shardwise.planner.wire import choose_wire

        values = opts.max_batch_size * self.model.cfg.hidden_size  # a full decode step's all-reduce
        self.tp.wire = choose_wire(opts.comm_dtype, self.tp, world, values=values)
        decode_layout(self.model, rows=opts.max_batch_size)  # fp32 on CPU: the order measured fastest
        if stage is not None:
            self.stages = StageForward(self.model, mesh)
            self.stage_text = stage[0].describe().replace(", loss", "")
        self.sizes, blocks = size_pool(  # now that the weights are loaded (serve/budget.py)
            world,
            self.model,
            self.report.param_bytes,
            opts.budget(),
            opts.activation_bytes,
            opts.max_model_len,
            self.tp.size,
        )
        self.caches = PagedCaches(self.model, blocks)
        self.device = self.caches.layers[0].k.device

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """One step of the whole model (pp 1) -> logits (B, V) on every rank; a greedy batch
        -> its tokens (B,) on every rank, the logits left split (shardwise.engine.argmax)."""
        if batch.greedy:
            with split_logits(self.model) as head:
                local = self.caches.forward(self.model, batch)  # (B, V / tp)
            return vocab_parallel_argmax(local, head)
        return self.caches.forward(self.model, batch)

    def splits(self) -> bool:
        """Whether a greedy step can leave the logits split (a vocab-parallel head, pp 1)."""
        return self.stages is None and split_head(self.model) is not None


def window_text(cfg, block_size: int) -> str:
    """What the paged cache keeps of a sliding-window model, for the start-up log."""
    w = cfg.sliding_window
    if kept_window(cfg) is not None:
        return (
            f"every layer attends to the last {w} positions: a sequence keeps the blocks of its last {w} "
            f"positions (at most {blocks_for(w - 1, block_size) + 1} of {block_size}), older ones are freed"
        )
    local = len(cfg.sliding_layers or ())
    return (
        f"{local} of {cfg.num_layers} layers attend to the last {w} positions; the others read every position, "
        "so a sequence keeps all its blocks"
    )


def serve_rank(world: Communicator, opts: ServeOptions) -> None:
    setup_logging(world.rank, world.size)
    engine = _Engine(world, opts)
    tp, model, caches, device, report = engine.tp, engine.model, engine.caches, engine.device, engine.report
    pids = world.all_gather(torch.tensor([os.getpid()], device=device), dim=0).tolist()
    fault = _Fault(world.rank, opts)
    ticks = PipelineTicks(engine, fault) if opts.pp > 1 else None
    if world.rank != 0:
        if ticks is not None:
            ticks.follow()
        else:
            _follow(world, engine, fault)
        return
    metrics = Metrics(tp=tp.size, slots=opts.max_batch_size, pp=opts.pp)
    scheduler = Scheduler(
        num_slots=opts.max_batch_size,
        max_queue=opts.max_queue,
        metrics=metrics,
        stale_s=opts.health_timeout,
        blocks=BlockTables(
            caches.num_blocks, caches.block_size, prefix_caching=opts.prefix_caching, window=kept_window(model.cfg)
        ),
    )
    metrics.blocks_total = metrics.blocks_free = caches.num_blocks
    info = {"tp": tp.size, "pp": opts.pp, "backend": tp.backend, "pids": pids}
    state, http_thread, (host, port) = start_server(
        opts, scheduler, metrics, vocab_size=model.cfg.vocab_size, info=info
    )
    layout = f"tp={tp.size}" if opts.pp == 1 else f"tp={tp.size} x pp={opts.pp} ({engine.stage_text})"
    log.info(
        "serving %s at http://%s:%d/v1 | %s (%s), %s | up to %d sequences of up to %d tokens | paged KV cache: "
        "%d blocks of %d tokens (%d tokens), %.1f MiB per rank, prefix caching %s | max queue %d | chat template: %s",
        opts.model_name, host, port, layout, tp.backend, report.config.dtype, opts.max_batch_size,
        opts.max_model_len, caches.num_blocks, caches.block_size, caches.num_blocks * caches.block_size,
        caches.nbytes / 2**20, "on" if opts.prefix_caching else "off", opts.max_queue,
        "the checkpoint's" if state.chat.own else "fallback (role: content lines)",
    )  # fmt: skip
    log.info(
        "memory per rank: %s | KV budget: %s: %d blocks = %d tokens, %d sequences of %d tokens at once",
        "; ".join(
            f"rank {r}: weights {fmt_bytes(w)}{_formats(report) if r == tp.rank else ''}, "
            f"KV pool {fmt_bytes(caches.num_blocks * per)}"
            for r, (w, _, _, per) in enumerate(engine.sizes.tolist())
        ),
        opts.budget().summary(), caches.num_blocks, caches.num_blocks * caches.block_size,
        caches.num_blocks // blocks_for(opts.max_model_len, caches.block_size), opts.max_model_len,
    )  # fmt: skip
    if model.cfg.sliding_window is not None:
        log.info("sliding window: %s", window_text(model.cfg, caches.block_size))
    if ticks is not None:
        lead_until_failure(scheduler, lambda: _lead_pipelined(ticks, scheduler, metrics, http_thread))
    else:
        lead_until_failure(scheduler, lambda: _lead(world, engine, scheduler, metrics, fault, http_thread))


def start_server(
    opts: ServeOptions, scheduler: Scheduler, metrics: Metrics, *, vocab_size: int, info: dict
) -> tuple[ServerState, object, tuple[str, int]]:
    """Rank 0: the API's state, and its HTTP server listening in a daemon thread ->
    (state, the thread, (host, port) it listens on)."""
    state = ServerState(
        scheduler=scheduler,
        metrics=metrics,
        tokenizer=load_tokenizer(opts.model),
        chat=ChatTemplate.load(opts.model),
        model_name=opts.model_name,
        vocab_size=vocab_size,
        max_model_len=opts.max_model_len,
        eos_ids=frozenset(stop_ids(opts.model)),
        max_body_bytes=opts.max_body_bytes,
        info=info,
    )
    try:
        sock = bind(opts.host, opts.port)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {opts.host}:{opts.port}: {e}") from None
    http_thread, _ = start_http(build_app(state), sock)
    return state, http_thread, sock.getsockname()[:2]


def lead_until_failure(scheduler: Scheduler, lead: Callable[[], None]) -> None:
    """Rank 0: run the engine loop `lead`; when it raises, fail every request, keep answering
    for DRAIN_S, and raise (the launcher then takes every rank down)."""
    try:
        lead()
    except BaseException as e:
        scheduler.fail(f"{type(e).__name__}: {e}")
        if not isinstance(e, KeyboardInterrupt):  # Ctrl-C stops the whole job: no error to report
            log.error("engine stopped: %s: %s", type(e).__name__, e)
        time.sleep(DRAIN_S)  # NOTE: the HTTP thread sends the error events and answers 503 meanwhile
        raise


def _lead(world, engine: _Engine, scheduler: Scheduler, metrics: Metrics, fault, http_thread) -> None:
    """Rank 0's engine loop; returns never, raises when a step or the HTTP server fails."""
    tp, device, split = engine.tp, engine.device, engine.splits()
    while True:
        if not http_thread.is_alive():
            raise RuntimeError("the HTTP server stopped")
        batch = scheduler.next_batch(device)
        if batch is None:
            if not scheduler.wait_for_work(HEARTBEAT_S):
                send_step(world, Kind.NOOP, device=device)
                world.barrier()
                scheduler.beat()
                metrics.heartbeat(tp.stats.snapshot())
            continue
        t0 = time.perf_counter()
        if split and all(seq.sampling.greedy for seq in scheduler.rows()):
            batch = dataclasses.replace(batch, greedy=True)
        send_step(world, Kind.STEP, batch)
        fault.step()
        logits = engine.forward(batch)  # (B, V); a greedy batch: its tokens (B,)
        new_tokens = scheduler.finish_step(logits)
        metrics.step(time.perf_counter() - t0, batch.slots.numel(), new_tokens, tp.stats.snapshot())


def _lead_pipelined(ticks: PipelineTicks, scheduler: Scheduler, metrics: Metrics, http_thread) -> None:
    """Rank 0's engine loop at pp > 1: one tick per step, up to pp steps in flight."""
    inflight = InFlight(ticks.P - 1)
    while True:
        if not http_thread.is_alive():
            raise RuntimeError("the HTTP server stopped")
        batch = scheduler.next_batch(ticks.device, inflight.busy(), groups=ticks.P)
        if batch is None and inflight.empty():
            if not scheduler.wait_for_work(HEARTBEAT_S):
                header, _ = ticks.lead_tick(None)  # a bubble through every stage: the heartbeat
                metrics.stages([int(x) / 1e6 for x in header[HEADER_LEN:]])
                scheduler.beat()
                metrics.heartbeat(ticks.tp.stats.snapshot())
            continue
        t0 = time.perf_counter()
        header, logits = ticks.lead_tick(batch)
        rows = inflight.push(scheduler.rows() if batch is not None else None)
        metrics.stages([int(x) / 1e6 for x in header[HEADER_LEN:]])
        if rows is None:
            scheduler.beat()
            continue
        new_tokens = scheduler.finish_step(logits, rows)
        metrics.step(time.perf_counter() - t0, len(rows), new_tokens, ticks.tp.stats.snapshot())


def _follow(world, engine: _Engine, fault: _Fault) -> None:
    """Ranks 1..N: run whatever rank 0's steps say, until STOP."""
    while True:
        kind, batch = recv_step(world, engine.device)
        if kind == Kind.STOP:
            return
        if kind == Kind.NOOP:
            world.barrier()
            continue
        fault.step()
        engine.forward(batch)


def _formats(report) -> str:
    """' (Q4_K 301.2 MiB, Q6_K 98.0 MiB, F32 0.3 MiB)' where a rank holds more than one format."""
    formats = getattr(report, "bytes_by_format", None) or {}
    return f" ({', '.join(f'{f} {fmt_bytes(b)}' for f, b in formats.items())})" if len(formats) > 1 else ""
