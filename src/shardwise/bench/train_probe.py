"""The calibration's training probe: what a training micro-step costs on one core, in the terms
the planner prices it by (planner.predict._micro_batch).

A micro-step on one rank, fp32, forward and backward, is taken to cost

    seconds = FLOPs x a  +  values x unsplit  +  layers x fixed_layer(tp)  +  fixed_step(tp)

- FLOPs: its products as the planner counts them (3 x the forward's: layers and LM head, the
  rank's share at tp);
- values: its activation values, tokens x hidden x layers: the element-wise work around the
  products (norms, residuals, the region copies, the loss), which a tp group does not split:
  every rank holds every token's whole hidden vector;
- fixed times per layer and per micro-step (autograd's bookkeeping, the loss): a tp=2 shard's
  are not half the whole's (its region copies' autograd functions, the vocab-parallel loss).

Four micro-steps at tp=1 pin the four terms down (fit_training): a tiny model at 1 and 5
layers (mostly the fixed times), a model whose products are small (mostly `unsplit`), and two
layers of hidden 1024 (mostly `a`, reported as train_efficiency: the matmul probe's rate / 1/a,
at most 1); two more at tp=2, as rank 0 of a dry-run group, give a shard's fixed times. Each
micro-step as shardwise.train runs one (build_model, the vocab-parallel loss), the fastest of
its tries over SMALL_ROUNDS rounds, so that a slow spell of the machine falls on all alike.
"""

from __future__ import annotations

import torch

from shardwise.bench.timing import best_time
from shardwise.models.config import ModelConfig

SMALL_ROUNDS = 5
"""Rounds of the small micro-steps: each timed once a round, its fastest kept."""

TINY = {n: ModelConfig("llama", 256, 64, 128, n, 4, 2, 16) for n in (1, 5)}  # batch 1 x 8 tokens
FLAT = ModelConfig("llama", 256, 256, 8, 4, 1, 1, 8)  # one head of 8, intermediate 8: 8 x 32 tokens
WIDE = ModelConfig("llama", 4096, 1024, 2816, 2, 16, 4, 64)  # 2 x 128 tokens


def train_s(cfg: ModelConfig, batch: int, tokens: int, repeats: int, optimizer: bool = False, tp: int = 1):
    """Fastest micro-step of `cfg` as shardwise.train runs one: build_model's shard of rank 0 of a
    tp group whose collectives a DryRunCommunicator answers (nothing moves, nothing waits; tp=1:
    the whole model), forward and backward of the vocab-parallel cross-entropy on every position.
    With `optimizer`, (seconds, the fastest AdamW update of its parameters: torch's fused
    kernel, as shardwise.train uses)."""
    from shardwise.comm.dryrun import DryRunCommunicator
    from shardwise.layers import vocab_parallel_cross_entropy
    from shardwise.train.layout import build_model

    comm = DryRunCommunicator(tp, 0)
    model = build_model(cfg, comm, init_std=0.02)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))

    def step():
        model.zero_grad(set_to_none=True)  # a first micro-batch: nothing to accumulate into
        logits = model(ids)  # (B, T, V / tp)
        vocab_parallel_cross_entropy(logits, ids, comm=comm).mean().backward()

    t = best_time(step, repeats)
    if not optimizer:
        return t
    from shardwise.train.optim import fused_ok

    params = list(model.parameters())
    adamw = torch.optim.AdamW(params, lr=1e-6, fused=fused_ok(params))  # as shardwise.train builds it
    return t, best_time(adamw.step, repeats)


def step_terms(cfg: ModelConfig, batch: int, tokens: int, tp: int = 1) -> tuple[float, float, int]:
    """(FLOPs, activation values, layers) of one micro-step on one rank, as the planner counts them."""
    from shardwise.planner.cost import head_flops_per_token, layers_flops_per_token

    flops = 3 * batch * tokens * (layers_flops_per_token(cfg, tokens, tp) + head_flops_per_token(cfg, tp))
    return flops, batch * tokens * cfg.hidden_size * cfg.num_layers, cfg.num_layers


Row = tuple[ModelConfig, int, int, int, float]
"""A timed micro-step: (cfg, batch, tokens, tp, seconds)."""


def fit_training(rows: list[Row], gemm_flops: float) -> dict:
    """The terms of the module's cost from timed micro-steps: at tp=1 at least four (the FLOPs'
    `a`, `unsplit`, the whole's fixed times; least squares), then each tp > 1 group's own fixed
    times from its rows (at least two layer counts) less their products and values. `a` is at
    least 1 / gemm_flops (the products no faster than the matmul probe: efficiency at most 1);
    a term that comes out negative is 0 and the others refitted without it (each step's misfit
    relative to its time)."""
    one = [r for r in rows if r[3] == 1]
    if len(one) < 4:
        raise ValueError(f"fit_training needs 4 micro-steps at tp=1 to fit 4 terms, got {len(one)}")
    cols = ["a", "unsplit", "layer", "step"]
    # each row divided by its time: least squares on relative misfits, the 3 ms steps as much
    # as the wide 600 ms one
    t = torch.tensor([r[4] for r in one], dtype=torch.float64)
    terms = torch.tensor([[*step_terms(c, b, n), 1.0] for c, b, n, _, _ in one], dtype=torch.float64) / t[:, None]
    t = torch.ones_like(t)
    fixed: dict[str, float] = {}
    while True:  # least squares over the free terms; pin one that breaks its bound, again
        free = [i for i, k in enumerate(cols) if k not in fixed]
        if not free:  # every term at its bound
            got = {}
            break
        rest = t - sum((terms[:, i] * fixed[k] for i, k in enumerate(cols) if k in fixed), torch.zeros_like(t))
        sol = torch.linalg.lstsq(terms[:, free], rest[:, None]).solution[:, 0].tolist()
        got = dict(zip((cols[i] for i in free), sol, strict=True))
        if got.get("a", 1.0) < 1 / gemm_flops:
            fixed["a"] = 1 / gemm_flops
        elif bad := [k for k in ("unsplit", "layer", "step") if k in got and got[k] < 0]:
            fixed[bad[0]] = 0.0
        else:
            break
    fit = fixed | got
    out = {
        "train_efficiency": min(1.0, 1 / (fit["a"] * gemm_flops)),
        "train_unsplit_ns": fit["unsplit"] * 1e9,
        "train_layer_overhead_us": fit["layer"] * 1e6,
        "train_step_overhead_us": fit["step"] * 1e6,
    }
    for tp in sorted({r[3] for r in rows} - {1}):
        pts = []
        for c, b, n, _, s in (r for r in rows if r[3] == tp):
            flops, values, layers = step_terms(c, b, n, tp)
            pts.append((layers, s - flops * fit["a"] - values * fit["unsplit"]))
        if len({n for n, _ in pts}) < 2:
            raise ValueError(f"fit_training needs tp={tp} micro-steps at 2 layer counts, got {sorted(pts)}")
        (n1, s1), (n2, s2) = min(pts), max(pts)
        layer = max((s2 - s1) / (n2 - n1), 0.0)
        out[f"tp{tp}"] = (layer * 1e6, max(s1 - n1 * layer, 0.0) * 1e6)
    return out


def training_probe(repeats: int, gemm_flops: float) -> dict:
    """The probe on one core (fp32): the fitted terms (train_efficiency, train_unsplit_ns, the
    fixed times whole and as a tp=2 shard), train_s (the wide model's micro-step, for the busy
    probe) and the bytes/s of an AdamW update of its weights (counted as one read and one write
    of its state)."""
    from shardwise.planner.footprint import stage_params

    small = [(TINY[n], 1, 8, tp) for n in (1, 5) for tp in (1, 2)] + [(FLAT, 8, 32, 1)]  # (cfg, batch, tokens, tp)
    best = [float("inf")] * len(small)
    for _ in range(SMALL_ROUNDS):
        for i, (c, b, n, tp) in enumerate(small):
            best[i] = min(best[i], train_s(c, b, n, 4 * repeats, tp=tp))
    t, update = train_s(WIDE, 2, 128, repeats, optimizer=True)
    fit = fit_training([(*k, s) for k, s in zip(small, best, strict=True)] + [(WIDE, 2, 128, 1, t)], gemm_flops)
    layer2, step2 = fit.pop("tp2")
    return fit | {
        "train_tp_layer_overhead_us": layer2,
        "train_tp_step_overhead_us": step2,
        "train_s": t,
        # AdamW in fp32 reads and writes weights, gradients and its two moments: 16 bytes a parameter
        "optimizer_gbps": 2 * 16 * stage_params(WIDE, 1) / update / 1e9,
    }
