"""`shardwise plan`: the tp size and the tp x pp x dp layout, from a calibrated cost model.

    shardwise plan --model llama-3-70b --cluster dgx-a100-80gb --batch 8
    shardwise plan --model path/to/checkpoint --cluster this-host --link mpi
    shardwise plan --model gpt3-175b --cluster dgx-h100 --nodes 8 --train --global-batch 1536
    shardwise plan --model MODEL --cluster this-host --nodes 2 --devices-per-node 2 --inter-gbps 0.0125

Every input is checked before anything is computed; an unknown preset or inconsistent
numbers exit with status 2 and one line naming them. When nothing fits, the layouts and
by how much they miss are printed, with what would fit instead, and the status is 2.
Training plans may recommend a pipeline (pp > 1): the answer names its schedule, micro-batch
count and layer split, and prints the `shardwise train --layout ... --schedule ...
--microbatches ...` line that runs it (JSON: "layout", "schedule", "microbatches",
"command"); an inference plan, the `shardwise serve` line. Inference may store weights
quantized (`--quantize fp16|int8`): asked for, or chosen by the planner when nothing fits or
no layout meets the latency target without it (JSON: "quantize", "quantize_why").

`--cluster this-host` is measured, not a preset: the measuring is shardwise.bench.calibrate
(cached); this command hands its Cluster to the planner. With `--nodes N`, N hosts like this
one (`--devices-per-node` ranks each), joined by links of `--inter-gbps` GB/s: the calibrated
veth link's per-message costs, its transfers at that rate.
"""

from __future__ import annotations

import argparse
import json

from shardwise.cli.common import fail

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="choose the tp size and the tp x pp x dp layout for a model, a workload and a cluster"
    )
    p.add_argument("--model", help="a Hugging Face directory, a config.json, or a preset (--list-presets)")
    p.add_argument("--list-presets", action="store_true", help="list model and cluster presets, then exit")
    c = p.add_argument_group("cluster (a preset, then any number replaced)")
    c.add_argument("--cluster", default="this-host", help="dgx-a100-80gb, dgx-h100, pcie-8x-rtx4090, this-host")
    c.add_argument(
        "--nodes", type=int, default=1, help="nodes (hosts); this-host: hosts like this one, joined by veth links"
    )
    c.add_argument(
        "--link", default="gloo", help="this-host: which calibrated backend's link joins the devices (gloo, mpi)"
    )
    c.add_argument("--recalibrate", action="store_true", help="this-host: measure again instead of the cache")
    c.add_argument("--devices", type=int, help="number of devices available")
    c.add_argument("--devices-per-node", type=int)
    c.add_argument("--memory-gib", type=float, help="memory per device")
    c.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s of a device in the compute dtype")
    c.add_argument("--mem-bw-gbps", type=float, help="device memory bandwidth, GB/s")
    c.add_argument("--intra-gbps", type=float, help="intra-node all-reduce bus bandwidth, GB/s")
    c.add_argument("--intra-latency-us", type=float)
    c.add_argument(
        "--inter-gbps",
        type=float,
        help="inter-node all-reduce bus bandwidth, GB/s; this-host: the links' rate (100 Mbit/s = 0.0125)",
    )
    c.add_argument("--inter-latency-us", type=float)
    c.add_argument("--allow-cross-node-tp", action="store_true", help="also consider tp groups spanning nodes")
    i = p.add_argument_group("inference workload (the default)")
    i.add_argument("--batch", type=int, default=1, help="sequences per replica")
    i.add_argument("--prompt-len", type=int, default=512)
    i.add_argument("--output-len", type=int, default=128)
    i.add_argument("--target-latency-ms", type=float, help="end-to-end latency target for one request")
    i.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "fp32", "bf16"],
        help="default: the model's; with --train: bf16 = bf16-mixed precision, fp32 = fp32 (instead of --precision)",
    )
    i.add_argument(
        "--quantize",
        choices=["fp16", "int8"],
        help="plan with the projections and embeddings stored in this format (default: the dtype's, or a "
        "measured format when nothing fits or no layout meets --target-latency-ms without it)",
    )
    t = p.add_argument_group("training workload")
    t.add_argument("--train", action="store_true", help="plan training instead of inference")
    t.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    t.add_argument("--micro-batch", type=int, default=1)
    t.add_argument("--seq-len", type=int, default=2048)
    t.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    t.add_argument("--precision", choices=["bf16-mixed", "fp16-mixed", "fp32"], default="bf16-mixed")
    t.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        choices=["none", "selective", "full"],
        help="activation recomputation: full (the default when given alone), selective, or none",
    )
    t.add_argument(
        "--sequence-parallel", action="store_true", help="sequence parallelism: activations between matmuls / tp"
    )
    t.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="shardwise's distributed optimizer: Adam's moments (and a bf16 run's fp32 master) split over dp",
    )
    t.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b", "interleaved"],
        help="pipeline schedule (default: the fastest that fits)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--no-flash-attention", action="store_true", help="count the s x s attention scores in memory")
    o.add_argument("--headroom", type=float, default=0.1, help="fraction of usable memory to keep free (default 0.1)")
    o.add_argument("--top", type=int, default=12, help="layouts shown in the text output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.add_argument("--plot", metavar="FILE.png", help="draw predicted latency against tp for each interconnect")


def _list_presets() -> int:
    from shardwise.planner.presets import CLUSTER_PRESETS, MODEL_PRESETS, model_preset

    print("models:")
    for name in MODEL_PRESETS:
        cfg = model_preset(name)
        print(
            f"  {name:<14} {cfg.family:<8} {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}, {cfg.dtype}"
        )
    print("clusters:")
    for name, p in CLUSTER_PRESETS.items():
        print(f"  {name:<16} {p['devices_per_node']} x {p['device']['name']} per node; {p['intra']['name']}")
    print(f"  {'this-host':<16} this machine, measured (one device = one CPU core, one rank)")
    return 0


def _cluster(args):
    """A preset, or this host as measured (shardwise.bench.calibrate)."""
    from shardwise.planner.presets import THIS_HOST, cluster_preset, preset_key
    from shardwise.planner.specs import PlannerError

    if preset_key(args.cluster) != THIS_HOST:
        return cluster_preset(args.cluster, nodes=args.nodes)
    if args.nodes < 1:
        raise PlannerError(f"--nodes must be >= 1, got {args.nodes}")
    from shardwise.bench.calibrate import this_host
    from shardwise.comm.shm import shm_mode

    # nodes > 1: hosts like this one, joined by the calibrated veth link (--inter-gbps: its rate)
    shm = shm_mode() != "off"
    return this_host(link=args.link, recalibrate=args.recalibrate, nodes=args.nodes, shm=shm)


def _build(args):
    from shardwise.planner.presets import customize, resolve_model
    from shardwise.planner.specs import InferenceWorkload, PlannerError, TrainingWorkload

    if not args.model:
        raise PlannerError("--model is required: a checkpoint directory, a config.json or a preset (--list-presets)")
    label, cfg = resolve_model(args.model)
    if not args.train and not args.quantize:  # a GGUF file computes in its own formats: its bytes
        from shardwise.hf import loaded_config

        cfg = loaded_config(args.model, cfg)
    flash = not args.no_flash_attention
    if args.train and args.quantize:
        raise PlannerError(f"--quantize {args.quantize} is for inference; training does not take --quantize")
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype)
    if args.train:
        precision = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}.get(dtype, args.precision)
        wl = TrainingWorkload(
            global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len,
            optimizer=args.optimizer, precision=precision, recompute=args.recompute, flash_attention=flash,
            sequence_parallel=args.sequence_parallel, schedule=args.schedule,
            distributed_optimizer=args.distributed_optimizer,
        )  # fmt: skip
    else:
        if args.distributed_optimizer:
            raise PlannerError("--distributed-optimizer is for training (--train)")
        wl = InferenceWorkload(
            batch=args.batch, prompt_len=args.prompt_len, output_len=args.output_len,
            target_latency_ms=args.target_latency_ms, dtype=dtype, flash_attention=flash,
            quantize=args.quantize,
        )  # fmt: skip
    from shardwise.planner.search import check_context

    check_context(cfg, wl)  # NOTE: before _cluster, which may calibrate this host for minutes
    cluster = _cluster(args)
    cluster = customize(
        cluster, devices=args.devices, devices_per_node=args.devices_per_node, memory_gib=args.memory_gib,
        peak_tflops=args.peak_tflops, mem_bw_gbps=args.mem_bw_gbps, intra_gbps=args.intra_gbps,
        intra_latency_us=args.intra_latency_us, inter_gbps=args.inter_gbps, inter_latency_us=args.inter_latency_us,
    )  # fmt: skip
    return label, cfg, wl, cluster


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        return _list_presets()
    from shardwise.layers import ShardError
    from shardwise.planner.recommend import recommend
    from shardwise.planner.report import plot, render_text, to_json
    from shardwise.planner.specs import PlannerError

    try:
        if args.top < 1:
            raise PlannerError(f"--top must be >= 1, got {args.top}")
        label, cfg, wl, cluster = _build(args)
        rec = recommend(label, cfg, wl, cluster, headroom=args.headroom, allow_cross_node_tp=args.allow_cross_node_tp)
    except (PlannerError, ShardError, NotImplementedError) as e:
        return fail(str(e))
    if args.json:
        print(json.dumps(to_json(rec)))
    else:
        print(render_text(rec, top=args.top))
    if args.plot:
        try:
            plot(rec, args.plot)
        except ImportError:
            return fail("--plot needs matplotlib: pip install 'shardwise[plot]'")
        if not args.json:
            print(f"\nplot: {args.plot}")
    if rec.recommended is None:
        return fail(rec.nothing_fits if args.json else "nothing fits (see above: by how much, and what would fit)")
    return 0
