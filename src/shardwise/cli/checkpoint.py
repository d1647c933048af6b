"""`shardwise checkpoint`: inspect, reshard and export training checkpoints (no ranks needed).

    shardwise checkpoint info CKPT                 # manifest summary and pipeline split; --verify checks every SHA-256
    shardwise checkpoint reshard SRC DST --tp M    # rewrite for tp=M, streaming chunk by chunk
    shardwise checkpoint reshard SRC DST --tp 2 --pp 2 [--pp-layers 3,1] [--dp D]   # ... for tp x pp x dp
    shardwise checkpoint reshard SRC DST --tp 1 --ep 2   # a mixture of experts: experts in ep row blocks
    shardwise checkpoint export-hf CKPT OUT        # a Hugging Face directory (transformers, `generate`)

CKPT/SRC is a checkpoint directory or a directory whose `latest` pointer names one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from shardwise.cli.common import fail

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect, reshard or export a training checkpoint")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = actions.add_parser("info", help="summarise a checkpoint's manifest")
    info.add_argument("ckpt", type=Path)
    info.add_argument("--verify", action="store_true", help="check every file's size, SHA-256 and keys")
    info.add_argument("--json", action="store_true")
    rs = actions.add_parser("reshard", help="rewrite a checkpoint for another tp x pp x dp layout, tensor by tensor")
    rs.add_argument("src", type=Path)
    rs.add_argument("dst", type=Path)
    rs.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    rs.add_argument("--pp", type=int, default=1, help="target pipeline stages (default 1)")
    rs.add_argument("--dp", type=int, default=1, help="target data-parallel size, recorded in the layout (default 1)")
    rs.add_argument(
        "--ep", type=int, default=1, help="target expert-parallel size (MoE; dp is raised to ep if smaller)"
    )
    rs.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pp rank (default 1)")
    rs.add_argument(
        "--pp-layers", type=_int_list, default=None, help="layers per (virtual) stage, e.g. 3,1 (default balanced)"
    )
    rs.add_argument("--json", action="store_true")
    ex = actions.add_parser("export-hf", help="write a Hugging Face model directory")
    ex.add_argument("ckpt", type=Path)
    ex.add_argument("out", type=Path)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts like 3,1, got {text!r}") from None


def _info(args) -> int:
    from shardwise.checkpoint import CheckpointReader
    from shardwise.checkpoint.manifest import layout_text

    reader = CheckpointReader(args.ckpt)
    if args.verify:
        reader.verify()
    m = reader.manifest
    data_bytes = sum(f["bytes"] for f in m.files.values())
    params = sum(_numel(e.global_shape) for k, e in m.tensors.items() if k.startswith("param/"))
    stages = m.stage_layout()
    summary = {
        "path": str(reader.dir),
        "step": m.step,
        "layout": m.layout,
        "pipeline": stages.to_dict(),
        "stages": stages.describe(),
        "family": m.model.get("family"),
        "parameters": params,
        "tensors": len(m.tensors),
        "files": len(m.files),
        "bytes": data_bytes,
        "verified": bool(args.verify),
        "last_loss": m.extra.get("history", [[None, None]])[-1][1] if m.extra.get("history") else None,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"checkpoint {reader.dir}")
    print(f"step {m.step}, saved at {layout_text(m.layout)}, format {m.format} v{m.format_version}")
    c = m.model
    print(
        f"model: {c['family']}, {c['num_layers']} layers, hidden {c['hidden_size']}, heads {c['num_heads']}/"
        f"{c['num_kv_heads']} kv, vocab {c['vocab_size']}: {params:,} parameters"
    )
    if c.get("num_experts"):
        ep = m.layout.get("ep", 1)
        stored = (
            f"expert tensors in row blocks of whole experts by ep={ep}" if ep > 1 else "expert tensors as tp shards"
        )
        print(f"experts: {c['num_experts']} per MoE layer, top-{c['experts_per_token']}; {stored}")
    per = "stage" if stages.virtual_stages == 1 else f"virtual stage ({stages.virtual_stages} per rank)"
    print(f"pipeline: pp={stages.pp}, layers per {per} {list(stages.layers)}; {stages.describe()}")
    print(f"tensors: {len(m.tensors)} (parameters and AdamW moments) in {len(m.files)} files, {data_bytes:,} bytes")
    if summary["last_loss"] is not None:
        print(f"last training loss: {summary['last_loss']:.4f}")
    if args.verify:
        print("verified: every file present, full size, SHA-256 and keys match the manifest")
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _reshard(args) -> int:
    from shardwise.checkpoint.offline import reshard_checkpoint

    start = time.perf_counter()
    stats = reshard_checkpoint(
        args.src,
        args.dst,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        virtual_stages=args.virtual_stages,
        pp_layers=args.pp_layers,
        progress=not args.json,
    )
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({**asdict(stats), "seconds": round(seconds, 3)}))
        return 0
    before = f"tp={stats.tp_from}" + (f" x pp={stats.pp_from}" if stats.pp_from > 1 else "")
    after = f"tp={stats.tp_to}" + (f" x pp={stats.pp_to}" if stats.pp_to > 1 else "")
    after += f" x dp={stats.dp_to} x ep={stats.ep_to}" if stats.ep_to > 1 else ""
    print(
        f"resharded {stats.src} ({before}) -> {stats.dst} ({after}): {stats.tensors} tensors, "
        f"{stats.bytes_written:,} bytes in {stats.files} files, {seconds:.2f} s"
    )
    if stats.pp_to > 1:
        print(f"pipeline: {stats.stages}")
    print(
        f"largest chunk held in memory: {stats.peak_chunk_bytes:,} bytes "
        f"(all tensors: {stats.total_tensor_bytes:,} bytes)"
    )
    return 0


def _export(args) -> int:
    from shardwise.checkpoint.export import export_hf

    out = export_hf(args.ckpt, args.out)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {args.ckpt} -> {out}: {files}")
    print(f"try: shardwise generate --model {out} --tp 2 --prompt '...'")
    return 0


def run(args: argparse.Namespace) -> int:
    from shardwise.hf import CheckpointError
    from shardwise.layers import ShardError

    try:
        return {"info": _info, "reshard": _reshard, "export-hf": _export}[args.action](args)
    except (CheckpointError, ShardError, OSError) as e:
        return fail(str(e))
