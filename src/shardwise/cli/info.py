"""`shardwise info`: the sharding plan of a model at a tp size, without starting any rank.

The model is built on the meta device and sharded by its plan with a dry-run
communicator, so every tensor's split and size, and the collectives of one decode
step and of a prefill, come from the real code path at no cost.

With --pp P, each stage is built the same way and cut to its layers
(shardwise.pipeline.stage.keep_stage), and one decode step runs through the inference
pipeline (shardwise.engine.pipeline) on dry-run tp, pp and world groups: each stage's
layers, bytes per rank, and collectives, point-to-point included.
"""

from __future__ import annotations

import argparse
import json

import torch

from shardwise.cli.common import add_expert_parallel_arg, add_model_args, add_pp_arg, resolve_model, resolve_stages
from shardwise.comm import ParallelDims
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.engine.pipeline import StageForward
from shardwise.engine.sampling import SamplingParams
from shardwise.layers import ShardSpec, model_shard_specs
from shardwise.models.meta import on_meta
from shardwise.pipeline.stage import StageLayout, keep_stage
from shardwise.sharding import parallelize
from shardwise.sharding.plans import balance

__all__ = ["add_parser", "run", "describe", "describe_stages"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show how a model is split at a tp size (no ranks are started)")
    add_model_args(p)
    add_pp_arg(p)
    add_expert_parallel_arg(p)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length for the prefill collective count")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _split(spec: ShardSpec) -> str:
    if spec.dim is None:
        return "replicated"
    ranges = [f"[{s}:{s + n}]" for s, n in spec.pieces]
    if len(ranges) > 4:  # every expert's slice (tensor-parallel experts): the first two and the last
        ranges = [f"{len(ranges)} pieces: {ranges[0]}", ranges[1], "...", ranges[-1]]
    ranges = " + ".join(ranges)
    pad = f" + {spec.pad} pad" if spec.pad else ""
    return f"dim {spec.dim}: {ranges}{pad}"


def _plan(family, cfg, expert_parallel: bool):
    return family.plan(cfg, expert_parallel=True) if expert_parallel else family.plan(cfg)


def _experts(model) -> list[dict]:
    """Per MoE layer of a sharded model: the experts this rank computes and how."""
    from shardwise.layers import ParallelMoE

    return [
        {
            "layer": int(path.split(".")[1]),
            "experts": [m.held_experts().start, m.held_experts().stop],
            "num_experts": m.num_experts,
            "expert_width": m.experts.down.shape[1],
        }
        for path, m in model.named_modules()
        if isinstance(m, ParallelMoE)
    ]


def _tensor_bytes(model, width: int, quantize: str | None, *, local: bool = True) -> dict[str, tuple[int, str]]:
    """{parameter name: (bytes, format)} of a sharded meta model: `width` bytes per element, or
    what --quantize makes of it (a tied fp16 matrix converted for both of its uses counts twice; a block-format one serves both)."""
    from shardwise.kernels.rows import block_format
    from shardwise.quant.convert import conversion_targets, quantized_bytes
    from shardwise.quant.schemes import conversion

    quantize = conversion(quantize)
    targets = conversion_targets(model, quantize) if quantize else {}
    out = {}
    for name, spec in model_shard_specs(model).items():
        shape = spec.local_shape if local else spec.global_shape
        if name in targets:
            copies = 1 if block_format(quantize) else len(targets[name])  # a tied block matrix is held once
            out[name] = (copies * quantized_bytes(tuple(shape), quantize), quantize)
        else:
            out[name] = (width * torch.Size(shape).numel(), "")
    return out


def _stored_bytes(model_dir, cfg, tp: int, rank: int, expert_parallel: bool) -> dict[str, tuple[int, str]]:
    """{parameter name: (bytes, formats)} rank `rank` holds of a GGUF file in its own block formats."""
    from shardwise.hf.stored import stored_layout

    layout = stored_layout(model_dir, cfg, tp=tp, rank=rank, expert_parallel=expert_parallel)
    return {name: (sum(held.values()), "+".join(held)) for name, held in layout.items()}


def _by_format(tensors: list[dict]) -> dict[str, int]:
    """{format: bytes on rank 0}, largest first (a mixed tensor's bytes under its first format)."""
    out: dict[str, int] = {}
    for t in tensors:
        out[t["format"]] = out.get(t["format"], 0) + t["bytes_per_rank"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe(
    model_dir,
    cfg,
    tp: int,
    prompt_len: int = 128,
    dtype: str | None = None,
    *,
    expert_parallel: bool = False,
    quantize: str | None = None,
) -> dict:
    """Rank 0's view of the plan: per tensor split and bytes, totals, collectives per step; for a
    mixture of experts, the experts every rank holds. quantize: bytes as --quantize stores them."""
    from shardwise.hf import FAMILIES

    family = FAMILIES[cfg.family]
    dtype = dtype or cfg.dtype
    comm = DryRunCommunicator(tp)
    with on_meta():
        model = family.model(cfg)
    parallelize(model, _plan(family, cfg, expert_parallel), comm=comm)
    specs = model_shard_specs(model)
    width = _BYTES[dtype]
    stored = quantize is None and cfg.stored_bytes_per_weight > 0  # a GGUF file in its own formats
    sized = _stored_bytes(model_dir, cfg, tp, 0, expert_parallel) if stored else _tensor_bytes(model, width, quantize)
    tensors = [
        {
            "name": name,
            "global_shape": list(spec.global_shape),
            "split": _split(spec),
            "local_shape": list(spec.local_shape),
            "format": sized[name][1] or dtype,
            "bytes_per_rank": sized[name][0],
        }
        for name, spec in specs.items()
    ]
    if stored:
        full = sum(b for b, _ in _stored_bytes(model_dir, cfg, 1, 0, expert_parallel).values())
    else:
        full = sum(b for b, _ in _tensor_bytes(model, width, quantize, local=False).values())
    bal = balance(cfg, tp, expert_parallel=expert_parallel) if tp > 1 else None
    per_rank = [sum(t["bytes_per_rank"] for t in tensors)]
    experts = [_experts(model)] if cfg.num_experts else []
    if bal is not None and (not bal.even or cfg.num_experts):  # ranks differ: each one's bytes, from its own plan
        for r in range(1, tp):
            with on_meta():
                other = family.model(cfg)
            parallelize(other, _plan(family, cfg, expert_parallel), comm=DryRunCommunicator(tp, r))
            other_sized = _stored_bytes(model_dir, cfg, tp, r, expert_parallel) if stored else None
            other_sized = other_sized or _tensor_bytes(other, width, quantize)
            per_rank.append(sum(b for b, _ in other_sized.values()))
            if experts:
                experts.append(_experts(other))
    counts = {}
    if hasattr(model, "new_caches"):
        caches = model.new_caches(1, prompt_len + 1)
        ids = torch.zeros(1, prompt_len, dtype=torch.long, device="meta")
        with comm.stats.track() as prefill:
            model(ids, attention_mask=torch.ones(1, prompt_len, device="meta"), caches=caches, last_only=True)
        with comm.stats.track() as decode:
            mask = torch.ones(1, prompt_len + 1, device="meta")
            model(ids[:, :1], attention_mask=mask, caches=caches, start=prompt_len, last_only=True)
        counts = {"decode_step": decode.snapshot(), f"prefill_{prompt_len}": prefill.snapshot()}
    return {
        "model": str(model_dir),
        "family": family.name,
        "tp": tp,
        "dtype": dtype,
        "quantize": quantize,
        "tensors": tensors,
        "bytes_by_format": _by_format(tensors),
        "bytes_per_rank": per_rank[0],
        "bytes_by_rank": per_rank if len(per_rank) == tp else per_rank * tp,
        "bytes_unsharded": full,
        "balance": None
        if bal is None
        else {
            "even": bal.even,
            "query_heads": list(bal.heads),
            "kv_heads": list(bal.kv_heads),
            "attention": bal.attention,
            "mlp": bal.mlp,
            "slowdown": bal.slowdown,
            "text": bal.describe(),
        },
        "collectives": counts,
        "expert_parallel": expert_parallel,
        "experts_by_rank": experts,
    }


def describe_stages(
    cfg,
    tp: int,
    layout: StageLayout,
    prompt_len: int = 128,
    dtype: str | None = None,
    *,
    expert_parallel: bool = False,
    quantize: str | None = None,
) -> list[dict]:
    """Per pipeline stage (its tp rank 0): layers, embedding / head, parameter bytes per rank,
    and the collectives of one decode step at batch 1 through the inference pipeline."""
    from shardwise.hf import FAMILIES

    family = FAMILIES[cfg.family]
    width = _BYTES[dtype or cfg.dtype]
    dims = ParallelDims(world_size=tp * layout.pp, tp=tp, pp=layout.pp)
    out = []
    for s in range(layout.pp):
        mesh = dims.build(DryRunCommunicator(dims.world_size, dims.rank_of(pp=s), name="world"))
        with on_meta():
            model = family.model(cfg)
        parallelize(model, _plan(family, cfg, expert_parallel), comm=mesh.tp)
        keep_stage(model, layout, s)
        stages = StageForward(model, mesh)
        caches = stages.new_caches(1, prompt_len + 1)
        ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
        with mesh.world.stats.track() as decode:
            logits = stages.forward(ids, None, caches, prompt_len)
            stages.choose(logits[:, -1] if logits is not None else None, 1, SamplingParams(), None)
        specs = model_shard_specs(model)
        out.append(
            {
                "stage": s,
                "layers": model.layer_indices(),
                "embedding": model.embed is not None,
                "head": model.lm_head is not None,
                "tensors": len(specs),
                "bytes_per_rank": sum(b for b, _ in _tensor_bytes(model, width, quantize).values()),
                "decode_step": decode.snapshot(),
            }
        )
    return out


def _stage_table(stages: list[dict], tp: int) -> None:
    mib = 2**20
    print(f"\npipeline: {len(stages)} stages x tp={tp} = {len(stages) * tp} ranks (tp rank 0 of each stage shown)")
    print(f"{'stage':<6} {'layers':<10} {'holds':<18} {'MiB/rank':>9}   collectives per decode step (batch 1)")
    for st in stages:
        layers = st["layers"]
        text = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        holds = ", ".join(["embed"] * (st["embedding"] and st["stage"] == 0) + ["norm, head"] * st["head"]) or "-"
        if st["embedding"] and st["stage"] != 0:
            holds += " (+ tied embed)"
        ops = ", ".join(f"{op} x{c['calls']} ({c['bytes']} B)" for op, c in st["decode_step"].items()) or "none"
        print(f"{st['stage']:<6} {text:<10} {holds:<18} {st['bytes_per_rank'] / mib:>9.3f}   {ops}")


def _expert_table(info: dict) -> None:
    """Which rank holds which experts (the same in every MoE layer), and its parameter bytes."""
    by_rank, mib = info["experts_by_rank"], 2**20
    first = by_rank[0][0]
    layers = ", ".join(str(e["layer"]) for e in by_rank[0])
    mode = "expert-parallel: whole experts per rank" if info["expert_parallel"] else "tensor-parallel experts"
    print(f"\nmixture of experts ({mode}): MoE layers {layers}, each of {first['num_experts']} experts")
    for r, held in enumerate(by_rank):
        s, e = held[0]["experts"]
        which = f"experts {s}-{e - 1}" if e - s > 1 else f"expert {s}"
        print(
            f"  rank {r}: {which} ({e - s} of {first['num_experts']}), width {held[0]['expert_width']} each; "
            f"parameters {info['bytes_by_rank'][r] / mib:.3f} MiB"
        )


def run(args: argparse.Namespace) -> int:
    model_dir, cfg = resolve_model(args.model, args.tp, expert_parallel=args.expert_parallel, quantize=args.quantize)
    layout = resolve_stages(cfg, args.tp, args.pp, args.pp_layers) if cfg.causal or args.pp == 1 else None
    if args.pp != 1 and layout is None:
        print(f"shardwise: error: --pp {args.pp}: pipeline stages need a decoder family, not {cfg.family}")
        return 2
    ep = args.expert_parallel
    q = args.quantize
    info = describe(model_dir, cfg, args.tp, args.prompt_len, args.dtype, expert_parallel=ep, quantize=q)
    if layout is not None:
        info["pp"] = args.pp
        info["stages"] = describe_stages(
            cfg, args.tp, layout, args.prompt_len, args.dtype, expert_parallel=ep, quantize=q
        )
    if args.json:
        print(json.dumps(info))
        return 0
    mib = 2**20
    stored = f", --quantize {q}" if q else ""
    print(f"{info['family']} model at {model_dir}, tp={args.tp}, {info['dtype']}{stored} (rank 0 shown)\n")
    print(f"{'tensor':<34} {'global shape':<14} {'split':<40} {'local shape':<14} {'format':<9} {'MiB/rank':>9}")
    for t in info["tensors"]:
        shape = "x".join(map(str, t["global_shape"]))
        local = "x".join(map(str, t["local_shape"]))
        print(
            f"{t['name']:<34} {shape:<14} {t['split']:<40} {local:<14} {t['format']:<9} {t['bytes_per_rank'] / mib:>9.3f}"
        )
    print(
        f"\n{'weights' if q else 'parameters'} per rank: {info['bytes_per_rank'] / mib:.2f} MiB of {info['bytes_unsharded'] / mib:.2f} MiB "
        f"unsharded ({info['bytes_per_rank'] / info['bytes_unsharded']:.0%})"
    )
    formats = ", ".join(f"{f} {b / mib:.2f}" for f, b in info["bytes_by_format"].items())
    print(f"by format on rank 0 (MiB): {formats}")
    if info["balance"] is not None:
        print(f"split over tp={args.tp}: {info['balance']['text']}")
        if not info["balance"]["even"] and not info["experts_by_rank"]:
            sizes = ", ".join(f"rank {r} {b / mib:.2f}" for r, b in enumerate(info["bytes_by_rank"]))
            print(f"parameters by rank (MiB): {sizes}")
    for step, snap in info["collectives"].items():
        text = ", ".join(f"{op} x{c['calls']} ({c['bytes'] / 1024:.1f} KiB)" for op, c in snap.items()) or "none"
        print(f"collectives per {step.replace('_', ' ')} (model forward, batch 1): {text}")
    if info["experts_by_rank"]:
        _expert_table(info)
    if layout is not None:
        _stage_table(info["stages"], args.tp)
    return 0
