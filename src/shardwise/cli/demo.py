"""`shardwise demo`: the layer demo. A small LM built from plain modules is sharded over
N local ranks by its plan, then checked against its unsharded twin (logits, loss and
every gradient) while the communication accounting counts the collectives."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch
import torch.nn.functional as F

from shardwise.comm import Communicator, ParallelDims
from shardwise.launch import RankFailedError, launch
from shardwise.layers import vocab_parallel_cross_entropy
from shardwise.layers.partition import HeadLayout
from shardwise.log import get_logger, setup_logging
from shardwise.models import BlockConfig, TinyLM
from shardwise.sharding import parallelize, shard_grads_like
from shardwise.sharding.plans import tiny_lm_plan

__all__ = ["add_parser", "run", "DEMO_CONFIG"]

DEMO_CONFIG = BlockConfig(
    hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=704, vocab_size=1003, num_layers=2
)
BATCH, SEQ = 4, 32
TOLERANCE = 1e-4  # fp32, relative to the largest reference magnitude

log = get_logger("demo")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="shard a small LM over N local ranks and check it against the unsharded model")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (local ranks to start; default 2)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "mpi"], help="communication backend")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds")
    p.add_argument("--seed", type=int, default=0)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item() or 1.0
    return (actual.float() - expected.float()).abs().max().item() / scale


def _demo_rank(world: Communicator, cfg: BlockConfig, seed: int) -> dict:
    tp = ParallelDims(world_size=world.size, tp=world.size).build(world).tp
    torch.manual_seed(seed)  # the same unsharded model and batch on every rank
    model = TinyLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    target = torch.roll(ids, -1, dims=1)

    logits_ref = model(ids)  # (B, T, V)
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten())
    loss_ref.backward()

    plan = tiny_lm_plan(cfg, gather_logits=False)
    expected = shard_grads_like(model, plan, comm=tp)
    sharded = parallelize(copy.deepcopy(model), plan, comm=tp)
    sharded.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with tp.stats.track() as fwd:
        local_logits = sharded(ids)  # (B, T, V_pad/tp)
        loss = vocab_parallel_cross_entropy(local_logits, target, comm=tp).mean()
    with tp.stats.track() as bwd:
        loss.backward()
    step_ms = (time.perf_counter() - t0) * 1e3

    grad_errs = {name: _rel_err(p.grad, expected[name]) for name, p in sharded.named_parameters()}
    block = sharded.layers[0]
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, requires_grad=True)
    with tp.stats.track() as block_fwd:
        y = block(x)
    with tp.stats.track() as block_bwd:
        y.sum().backward()

    logits = tp.all_gather(local_logits.detach(), dim=-1)[..., : cfg.vocab_size]
    worst = max(grad_errs, key=grad_errs.get)
    return {
        "logits": _rel_err(logits, logits_ref.detach()),
        "loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
        "grads": grad_errs[worst],
        "worst_grad": worst,
        "n_params": len(grad_errs),
        "fwd": fwd.snapshot(),
        "bwd": bwd.snapshot(),
        "block_fwd": block_fwd.snapshot(),
        "block_bwd": block_bwd.snapshot(),
        "param_bytes": _bytes(sharded),
        "full_bytes": _bytes(model),
        "step_ms": step_ms,
    }


def _counts(snapshot: dict) -> str:
    if not snapshot:
        return "none"
    return ", ".join(f"{op} x{c['calls']} ({c['bytes'] / 1024:.1f} KiB)" for op, c in snapshot.items())


def run(args: argparse.Namespace) -> int:
    setup_logging()
    cfg = DEMO_CONFIG
    valid = HeadLayout.valid_tp_sizes(cfg.num_heads, cfg.num_kv_heads)
    if args.tp not in valid:  # refused here, before any rank starts
        log.error(
            "--tp %d cannot split the demo model's %d query / %d KV heads; valid tp sizes: %s",
            args.tp,
            cfg.num_heads,
            cfg.num_kv_heads,
            ", ".join(map(str, valid)),
        )
        return 2
    print(
        f"shardwise layer demo: TinyLM {dataclasses.asdict(cfg)}\n"
        f"sharded over tp={args.tp} local ranks ({args.backend}), batch {BATCH} x {SEQ} tokens, fp32\n"
    )
    try:
        results = launch(_demo_rank, args.tp, args=(cfg, args.seed), backend=args.backend, timeout_s=args.timeout)
    except RankFailedError as e:
        log.error("%s", e)
        return 1
    r0 = results[0]
    rows = [
        ("logits (gathered)", max(r["logits"] for r in results)),
        ("loss (vocab-parallel cross-entropy)", max(r["loss"] for r in results)),
        (f"gradients, all {r0['n_params']} parameters (worst: {r0['worst_grad']})", max(r["grads"] for r in results)),
    ]
    print(f"{'sharded vs unsharded':<72} {'max rel error':>14}")
    for name, err in rows:
        print(f"  {name:<70} {err:>14.2e}  {'ok' if err <= TOLERANCE else 'FAIL'}")
    print("\ncollectives issued on rank 0 (from the communication accounting):")
    print(f"  one transformer block, forward : {_counts(r0['block_fwd'])}")
    print(f"  one transformer block, backward: {_counts(r0['block_bwd'])}")
    print(f"  whole model + loss, forward    : {_counts(r0['fwd'])}")
    print(f"  whole model + loss, backward   : {_counts(r0['bwd'])}")
    per_rank = ", ".join(f"{r['param_bytes'] / 2**20:.2f}" for r in results)
    print(f"\nparameter MiB per rank: {per_rank} (unsharded: {r0['full_bytes'] / 2**20:.2f})")
    ok = all(err <= TOLERANCE for _, err in rows)
    print(f"{'PASS' if ok else 'FAIL'}: tp={args.tp} matches the unsharded model within {TOLERANCE:g}")
    return 0 if ok else 1
