"""What each rank of `shardwise serve` runs for a model of the automatic plan
(shardwise.hf.auto): transformers' own module, sharded over tp, served one request at a time.

The paged, batched engine (serve/worker.py, engine/paged.py) writes keys and values into
shardwise's own attention layers, which a transformers module does not have. So here the
scheduler runs with one slot: requests wait in the queue (up to --max-queue) and each is
prefilled, then decoded token by token, alone, through engine/auto.OneSequence, on one
DynamicCache per rank (its KV heads). Everything else is the server's own: the same HTTP
API and streaming, the same step broadcast (serve/step.py), the same rank-0 loop, idle
heartbeats and failure handling (serve/worker.py).

    rank 0      HTTP and the scheduler (1 slot); next_batch -> send_step -> forward -> sample
    rank 1..N   recv_step -> the same forward
"""

from __future__ import annotations

import os

import torch

from shardwise.comm import Communicator, tp_only
from shardwise.engine.auto import AutoLM, OneSequence
from shardwise.engine.slots import StepBatch
from shardwise.log import get_logger, setup_logging
from shardwise.memory import fmt_bytes
from shardwise.serve.metrics import Metrics
from shardwise.serve.scheduler import Scheduler
from shardwise.serve.worker import ServeOptions, _Fault, _follow, _lead, lead_until_failure, start_server

__all__ = ["AutoEngine", "serve_auto_rank"]

log = get_logger("serve")


class AutoEngine:
    """This rank's shard of a transformers model and the one sequence it runs."""

    def __init__(self, world: Communicator, opts: ServeOptions) -> None:
        from shardwise.hf import load_pretrained
        from shardwise.planner.wire import choose_wire
        from shardwise.quant.layout import decode_layout

        if opts.pp != 1:  # the command refuses it; a guard for other callers
            raise ValueError(f"the automatic plan has no pipeline stages, got pp={opts.pp}")
        self.world, self.tp = world, tp_only(world)
        model, self.report = load_pretrained(opts.model, comm=self.tp, dtype=opts.dtype, quantize=opts.quantize)
        self.lm = AutoLM(model)
        decode_layout(self.lm, rows=1)  # fp32 on CPU: the weight order measured fastest for one row
        self.tp.wire = choose_wire(opts.comm_dtype, self.tp, world, values=self.lm.cfg.hidden_size)
        self.steps = OneSequence(self.lm)
        self.device = next(self.lm.parameters()).device

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """One step of the one sequence -> logits (1, V) on every rank."""
        return self.steps.forward(batch)

    def splits(self) -> bool:
        """False: its steps gather the logits, greedy or not (engine.argmax is the native models')."""
        return False


def serve_auto_rank(world: Communicator, opts: ServeOptions) -> None:
    setup_logging(world.rank, world.size)
    engine = AutoEngine(world, opts)
    tp = engine.tp
    pids = world.all_gather(torch.tensor([os.getpid()], device=engine.device), dim=0).tolist()
    fault = _Fault(world.rank, opts)
    if world.rank != 0:
        _follow(world, engine, fault)
        return
    metrics = Metrics(tp=tp.size, slots=1)
    scheduler = Scheduler(num_slots=1, max_queue=opts.max_queue, metrics=metrics, stale_s=opts.health_timeout)
    info = {"tp": tp.size, "pp": 1, "backend": tp.backend, "pids": pids, "family": engine.report.family}
    state, http_thread, (host, port) = start_server(
        opts, scheduler, metrics, vocab_size=engine.lm.cfg.vocab_size, info=info
    )
    log.info(
        "serving %s at http://%s:%d/v1 | tp=%d (%s), %s | automatic plan (%s): one request at a time, of up to %d "
        "tokens, on transformers' KV cache (no paged KV cache, batching or prefix caching) | weights %s per rank | "
        "max queue %d | chat template: %s",
        opts.model_name, host, port, tp.size, tp.backend, engine.lm.cfg.dtype, engine.report.family,
        opts.max_model_len, fmt_bytes(engine.report.param_bytes), opts.max_queue,
        "the checkpoint's" if state.chat.own else "fallback (role: content lines)",
    )  # fmt: skip
    lead_until_failure(scheduler, lambda: _lead(world, engine, scheduler, metrics, fault, http_thread))
