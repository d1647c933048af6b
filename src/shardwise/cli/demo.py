"""`shardwise demo`: the layer demo. A small DecoderLM (a tiny ModelConfig, no checkpoint)
is sharded over N ranks by its plan, then checked against its unsharded twin (logits,
loss and every gradient) while the communication accounting counts the collectives.

The ranks come from run_job (through cli.common.job): started here, or by torchrun / mpiexec."""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from shardwise.cli.common import add_run_args, fail, job
from shardwise.comm import Communicator, tp_only
from shardwise.layers import ShardError, vocab_parallel_cross_entropy
from shardwise.models import DecoderLM, ModelConfig
from shardwise.models.modules import attention_mask, rope_cos_sin, rope_inv_freq
from shardwise.sharding import parallelize, shard_grads_like
from shardwise.sharding.plans import check_tp, decoder_plan

__all__ = ["add_parser", "run", "DEMO_CONFIG"]

DEMO_CONFIG = ModelConfig.debug(hidden_size=256, intermediate_size=704, vocab_size=1003)
"""8 query / 4 KV heads, 2 layers, gated MLP, RoPE, tied embeddings (see ModelConfig.debug)."""
BATCH, SEQ = 4, 32
TOLERANCE = 1e-4  # fp32, relative to the largest reference magnitude


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="shard a small LM over N ranks and check it against the unsharded model")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks to start; default 2)")
    add_run_args(p)
    p.add_argument("--seed", type=int, default=0)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item() or 1.0
    return (actual.float() - expected.float()).abs().max().item() / scale


def _demo_rank(world: Communicator, opts: dict) -> dict:
    cfg: ModelConfig = opts["cfg"]
    seed: int = opts["seed"]
    tp = tp_only(world)
    device = torch.device("cuda" if tp.backend == "nccl" else "cpu")  # NCCL needs CUDA tensors
    torch.manual_seed(seed)  # the same unsharded model and batch on every rank
    model = DecoderLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device=device)
    target = torch.roll(ids, -1, dims=1)

    logits_ref = model(ids)  # (B, T, V)
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten())
    loss_ref.backward()

    plan = decoder_plan(cfg, gather_logits=False)
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
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, device=device, requires_grad=True)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    rope = rope_cos_sin(rope_inv_freq(cfg, device), positions, x.dtype)  # (B, 1, T, head_dim) each
    mask = attention_mask(None, SEQ, SEQ, causal=True, window=None, device=device)  # (1, 1, T, T)
    with tp.stats.track() as block_fwd:
        y = block(x, rope, mask)
    with tp.stats.track() as block_bwd:
        y.sum().backward()

    logits = tp.all_gather(local_logits.detach(), dim=-1)[..., : cfg.vocab_size]
    worst = max(grad_errs, key=grad_errs.get)
    mine = [
        _rel_err(logits, logits_ref.detach()),
        abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
        grad_errs[worst],
        float(_bytes(sharded)),
    ]
    per_rank = tp.all_gather(torch.tensor([mine], dtype=torch.float64, device=device), dim=0).cpu()  # (tp, 4)
    return {
        "logits": per_rank[:, 0].max().item(),
        "loss": per_rank[:, 1].max().item(),
        "grads": per_rank[:, 2].max().item(),
        "worst_grad": worst,
        "n_params": len(grad_errs),
        "fwd": fwd.snapshot(),
        "bwd": bwd.snapshot(),
        "block_fwd": block_fwd.snapshot(),
        "block_bwd": block_bwd.snapshot(),
        "param_bytes": [int(b) for b in per_rank[:, 3].tolist()],
        "full_bytes": _bytes(model),
        "step_ms": step_ms,
        "backend": tp.backend,
    }


def _counts(snapshot: dict) -> str:
    if not snapshot:
        return "none"
    return ", ".join(f"{op} x{c['calls']} ({c['bytes'] / 1024:.1f} KiB)" for op, c in snapshot.items())


def run(args: argparse.Namespace) -> int:
    cfg = DEMO_CONFIG
    try:
        check_tp(cfg, args.tp)  # refused here, before any rank starts
    except ShardError as e:
        return fail(f"--tp {args.tp}: the demo model's {e}")
    r = job(
        _demo_rank,
        args.tp,
        {"cfg": cfg, "seed": args.seed},
        backend=args.backend,
        timeout_s=args.timeout,
        allow_cross_host_tp=args.allow_cross_host_tp,
    )
    if r is None:  # a non-zero rank under torchrun or mpiexec: rank 0 reports
        return 0
    rows = [
        ("logits (gathered)", r["logits"]),
        ("loss (vocab-parallel cross-entropy)", r["loss"]),
        (f"gradients, all {r['n_params']} parameters (worst: {r['worst_grad']})", r["grads"]),
    ]
    ok = all(err <= TOLERANCE for _, err in rows)
    if args.json:
        print(json.dumps({"tp": args.tp, "tolerance": TOLERANCE, "passed": ok, **r}))
        return 0 if ok else 1
    print(
        f"shardwise layer demo: DecoderLM, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads, gated MLP {cfg.intermediate_size}, "
        f"vocab {cfg.vocab_size}, RoPE, tied embeddings\n"
        f"sharded over tp={args.tp} ranks ({r['backend']}), batch {BATCH} x {SEQ} tokens, fp32\n"
    )
    print(f"{'sharded vs unsharded':<72} {'max rel error':>14}")
    for name, err in rows:
        print(f"  {name:<70} {err:>14.2e}  {'ok' if err <= TOLERANCE else 'FAIL'}")
    print("\ncollectives issued on rank 0 (from the communication accounting):")
    print(f"  one transformer block, forward : {_counts(r['block_fwd'])}")
    print(f"  one transformer block, backward: {_counts(r['block_bwd'])}")
    print(f"  whole model + loss, forward    : {_counts(r['fwd'])}")
    print(f"  whole model + loss, backward   : {_counts(r['bwd'])}")
    per_rank = ", ".join(f"{b / 2**20:.2f}" for b in r["param_bytes"])
    print(f"\nparameter MiB per rank: {per_rank} (unsharded: {r['full_bytes'] / 2**20:.2f})")
    print(f"{'PASS' if ok else 'FAIL'}: tp={args.tp} matches the unsharded model within {TOLERANCE:g}")
    return 0 if ok else 1
