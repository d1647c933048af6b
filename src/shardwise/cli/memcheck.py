"""The memory pre-check of the commands that load a model (generate, verify, embed, serve,
train): before any rank starts, the bytes each rank will hold (shardwise.planner.fit, from the
config alone) against what this host allows (shardwise.memory.host_memory: the cgroup's room
or MemAvailable, whichever is smaller; SHARDWISE_MEMORY_LIMIT overrides it) or, on CUDA, each
device's free memory. Where it cannot fit: one line naming the need, the allowance and what
would fit, exit status 2. `--force` (`--skip-memory-check`) skips it.

The estimate it made is left in SHARDWISE_MEMORY_NEED (bytes, the busiest rank) for the
launcher, which names it if a rank is then killed by the out-of-memory killer.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from shardwise.cli.common import CliError, fail
from shardwise.log import get_logger
from shardwise.memory import LIMIT_ENV, NEED_ENV, fmt_bytes, host_memory
from shardwise.planner.fit import RUNTIME_BYTES, Allowance, Need, Option, fits, inference_need, refusal

__all__ = ["add_force_arg", "allowance", "check_inference", "check_training"]

log = get_logger("memory")


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        "--skip-memory-check",
        dest="force",
        action="store_true",
        help="start the ranks even if the memory they need (estimated from the config) is more than the host allows",
    )


def allowance(world: int, backend: str = "auto") -> tuple[Allowance, int] | None:
    """(what the ranks may use, how many of them run on this host); None when unknown. On CUDA
    (backend auto or nccl) the least free memory of the devices, each rank its own device."""
    from shardwise.launch import external_rank

    ext = external_rank()
    local = ext.local_world_size if ext is not None and ext.local_world_size else world
    if backend in ("auto", "nccl"):
        import torch

        if torch.cuda.is_available():  # NOTE: untested here (no GPU on the project's CI host)
            free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
            return Allowance(float(free), "torch.cuda.mem_get_info", local, per_device=True), local
    mem = host_memory()
    return (Allowance.host(mem, local), local) if mem is not None else None


def _check(need: Need, options, world: int, backend: str, force: bool) -> None:
    """Refuse (CliError 2) when `need` does not fit, naming the first options that do."""
    os.environ[NEED_ENV] = str(int(need.busiest))
    if force:
        return
    try:
        found = allowance(world, backend)
    except ValueError as e:  # SHARDWISE_MEMORY_LIMIT that is not a size
        raise CliError(fail(f"{LIMIT_ENV}: {e}")) from None
    if found is None:
        return
    allow, local = found
    line = refusal(need, allow, options, local_ranks=local)
    if line is not None:
        raise CliError(fail(line))
    log.info(
        "memory: about %s per rank (%s) + %d MiB runtime; the host allows %s",
        fmt_bytes(need.busiest),
        ", ".join(f"{k} {fmt_bytes(v)}" for k, v in need.parts.items()),
        RUNTIME_BYTES // 2**20,
        allow.describe(),
    )


def _largest(low: int, high: int, ok) -> int | None:
    """The largest n in [low, high] with ok(n) (ok monotone: true up to some n), else None."""
    if high < low or not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def check_inference(
    cfg, *, tp: int, pp_layers: list[int] | None, dtype: str | None, quantize: str | None, expert_parallel: bool,
    batch: int, prompt_len: int, kv_tokens: int, backend: str, force: bool, serving: bool = False,
    full_copy_on_rank0: bool = False, kv_budget_bytes: bool = False,
) -> None:  # fmt: skip
    """The pre-check of generate / verify / embed / serve (serving: the paged pool of kv_tokens
    positions, as serve sized it, and one prefill of prompt_len at a time; kv_budget_bytes: the
    pool's size was given in bytes, so a smaller --kv-cache-memory is suggested)."""
    from shardwise.sharding.plans.tp import model_tp_sizes

    base = dict(tp=tp, pp_layers=pp_layers, dtype=dtype, quantize=quantize, expert_parallel=expert_parallel,
                batch=batch, prompt_len=prompt_len, kv_tokens=kv_tokens, full_copy_on_rank0=full_copy_on_rank0,
                prefill_batch=1 if serving else None)  # fmt: skip
    need = inference_need(cfg, **base)
    world = tp * len(pp_layers or [1])

    def with_(**kw) -> Need:
        return inference_need(cfg, **{**base, **kw})

    def options():
        width = dtype or cfg.dtype
        formats = {None: ["fp16", "int8"], "fp16": ["int8"]}.get(quantize, [])
        formats = [q for q in formats if not (q == "fp16" and width != "float32")]
        for q in formats:
            yield Option(f"--quantize {q}", with_(quantize=q))
        for t in model_tp_sizes(cfg, expert_parallel=expert_parallel):
            if t != tp:  # larger: less per device; smaller: fewer ranks' runtime on one host
                yield Option(f"--tp {t}", with_(tp=t))
        if serving and kv_budget_bytes:  # a pool of a given size: the largest that fits (a fraction adapts by itself)
            found = allowance(world, backend)
            if found is None:
                return
            allow, local = found
            for q in [quantize, *formats]:
                shown = f" --quantize {q}" if q and q != quantize else ""
                n = _largest(prompt_len, kv_tokens - 1, lambda n, q=q: fits(with_(quantize=q, kv_tokens=n), allow, local_ranks=local))  # fmt: skip
                if n is not None:
                    opt = with_(quantize=q, kv_tokens=n)
                    size = int(opt.parts.get("kv cache", 0)) // 2**20
                    if size:
                        yield Option(f"--kv-cache-memory {size}MiB{shown}", opt)

    _check(need, options(), world, backend, force)


def check_training(cfg, model_cfg, *, force: bool) -> None:
    """The pre-check of train: its config's layout, dtype, optimizer and recomputation; what
    would fit: the distributed optimizer, bf16, full recomputation, other layouts of as many ranks.
    Training runs on CPU tensors: the host's memory, whatever the backend."""
    from shardwise.planner.fit import training_need
    from shardwise.sharding.plans.tp import model_tp_sizes

    par = cfg.parallel

    def need_of(c) -> Need | None:
        p = c.parallel
        try:
            m = c.data.grad_accum(p.dp)
        except Exception:  # noqa: BLE001 - a layout the batch does not divide: not an option
            return None
        return training_need(
            model_cfg, tp=p.tp, pp=p.pp, dp=p.dp, ep=p.ep, micro_batches=m, micro_batch=c.data.micro_batch_size,
            seq=c.data.seq_len, dtype=c.run.dtype, distributed=c.optim.distributed, recompute=c.run.recompute,
            sequence_parallel=p.sequence_parallel,
        )  # fmt: skip

    need = need_of(cfg)
    if need is None:
        return

    def variant(flags: str, **sections) -> Option | None:
        try:
            c = replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in sections.items()})
        except Exception:  # noqa: BLE001 - a combination the config refuses: not an option
            return None
        n = need_of(c)
        return Option(flags, n) if n is not None else None

    def options():
        if not cfg.optim.distributed and par.dp > 1:
            yield variant("--distributed-optimizer", optim={"distributed": True})
        if cfg.run.dtype == "fp32":
            yield variant("--dtype bf16", run={"dtype": "bf16"})
        if cfg.run.recompute != "full":
            yield variant("--recompute full", run={"recompute": "full"})
        if par.ep > 1:  # experts dealt over dp: other layouts change the expert split too
            return
        world = par.world_size  # as many ranks first, then fewer (on one host, each costs its runtime)
        layouts = [(t, d) for t in model_tp_sizes(model_cfg) for d in range(1, world + 1) if t * d * par.pp <= world]
        for tp, dp in sorted(layouts, key=lambda x: (-x[0] * x[1], x[0])):
            if (tp, dp) == (par.tp, par.dp):
                continue
            yield variant(f"--layout tp={tp},pp={par.pp},dp={dp}", parallel={"tp": tp, "dp": dp})
            if dp > 1 and not cfg.optim.distributed:
                flags = f"--layout tp={tp},pp={par.pp},dp={dp} --distributed-optimizer"
                yield variant(flags, parallel={"tp": tp, "dp": dp}, optim={"distributed": True})

    _check(need, (o for o in options() if o is not None), par.world_size, "cpu", force)
