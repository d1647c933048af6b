"""`shardwise verify`: the sharded model, layer by layer, against the unsharded one and transformers.

N ranks run the model sharded on a fixed batch of 2 prompts of unequal length (left-padded
for decoders, right-padded for BERT). Rank 0 then loads the whole model again, unsharded
(LocalCommunicator), and transformers' own model from the same directory when transformers
is installed, and compares each layer's output hidden state and the final logits (decoders)
or last hidden state (BERT) on the real, non-pad tokens.

verify therefore needs the whole model in rank 0's memory: its shard plus one full copy at
a time (the unsharded model, then transformers'). Exit status: 0 when every relative error
is within --tolerance, 1 when one is not, 2 for bad input.

With --pp P (decoders) the N * P ranks run the model across P stages (shardwise.engine.pipeline);
each stage's tp rank 0 sends its layers' outputs (and the last stage its logits) to rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math

import torch
from torch import nn

from shardwise.cli.common import (
    add_expert_parallel_arg,
    add_model_args,
    add_pp_arg,
    add_run_args,
    fail,
    job,
    resolve_model,
    resolve_stages,
)
from shardwise.cli.memcheck import add_force_arg, check_inference
from shardwise.comm import Communicator, LocalCommunicator, ParallelDims, tp_only
from shardwise.engine.pipeline import StageForward
from shardwise.pipeline.stage import StageLayout

__all__ = ["add_parser", "run"]

SEED = 0
LENGTHS = (8, 5)  # real tokens of the 2 prompts; the second is padded to the first
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2, "fp16": 2e-2, "int8": 2e-1}
"""Default max relative error by dtype, or by --quantize scheme (int8: activations are
quantized per call, per tensor, so a rank's slice and the whole row round differently)."""
BLOCK_TOLERANCE = 5e-2
"""Against transformers, where weights are computed in GGUF block formats as stored (a GGUF
file without --quantize, or --quantize q8_0/q4_k/...): each layer input is quantized to 8-bit
blocks, which transformers' dequantized fp32 does not do (about 1e-2 measured on Q8_0 files).
The sharded model and its unsharded twin quantize the same blocks: they keep the dtype's bound."""
Err = dict | None  # {"max_abs", "max_rel"} (None values: non-finite), or None: not compared


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="compare the sharded model layer by layer with the unsharded one and transformers "
        "(rank 0 needs memory for the whole model)",
    )
    add_model_args(p)
    add_pp_arg(p)
    add_expert_parallel_arg(p)
    p.add_argument(
        "--tolerance", type=float, default=None, help="max relative error (default 1e-4 fp32, 2e-2 bf16/fp16)"
    )
    add_run_args(p)
    add_force_arg(p)


def _inputs(vocab: int, encoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, attention_mask, each (2, T): deterministic ids in [1, vocab); pad id 0."""
    T = LENGTHS[0]
    ids = torch.randint(1, vocab, (2, T), generator=torch.Generator().manual_seed(SEED))  # (B, T)
    mask = torch.ones(2, T, dtype=torch.long)  # (B, T)
    pad = slice(LENGTHS[1], T) if encoder else slice(0, T - LENGTHS[1])  # BERT pads right, decoders left
    mask[1, pad] = 0
    ids[1, pad] = 0
    return ids, mask


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _layers(model: nn.Module, family: str) -> nn.ModuleList:
    if not family.startswith("auto:"):
        return model.layers  # DecoderLM and BertEncoder
    n = _text_config(model.config).num_hidden_layers  # the transformers decoder layers, as auto.py finds them
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n)


def _forward(model: nn.Module, family: str, ids, mask) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each layer's output (B, T, H), the final logits (B, T, V) or hidden state (B, T, H)), float32."""
    outs: list[torch.Tensor] = []

    def hook(_module, _args, out) -> None:
        outs.append((out[0] if isinstance(out, tuple) else out).detach().float())

    handles = [layer.register_forward_hook(hook) for layer in _layers(model, family)]
    try:
        with torch.no_grad():
            if family.startswith("auto:"):
                pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
                final = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            else:
                final = model(ids, attention_mask=mask)  # DecoderLM: logits; BertEncoder: hidden
    finally:
        for h in handles:
            h.remove()
    return outs, final.float()


def _transformers(path: str, dtype: torch.dtype, encoder: bool, ids, mask):
    """(layer outputs to compare, final output, note): transformers' model on the same input."""
    try:
        import transformers
    except ImportError:
        return None, None, "transformers is not installed"
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = transformers.AutoModel if encoder else transformers.AutoModelForCausalLM
    try:
        from pathlib import Path

        from shardwise.gguf import is_gguf

        where = {"pretrained_model_name_or_path": path}
        if is_gguf(path):  # transformers dequantizes the whole file in this process
            where = {"pretrained_model_name_or_path": str(Path(path).parent), "gguf_file": Path(path).name}
        model = cls.from_pretrained(**where, dtype=dtype).eval()
        kw = {"token_type_ids": torch.zeros_like(ids)} if encoder else {"position_ids": (mask.cumsum(-1) - 1).clamp(0)}
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kw)
    except Exception as e:  # noqa: BLE001 - any failure only skips this comparison
        return None, None, f"transformers could not run it ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    hidden = [h.float() for h in out.hidden_states[1:]]  # hidden[i]: layer i's output (B, T, H)
    if not encoder:  # the last entry has the decoder's final norm applied: not layer L-1's output
        hidden = hidden[:-1]
    final = out.last_hidden_state if encoder else out.logits
    return hidden, final.float(), type(model).__name__


def _err(actual: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> dict:
    """Max abs and max rel (abs / max |ref|) error over the real tokens; None where non-finite."""
    a, r = actual[real], ref[real]  # (N, H) or (N, V): real tokens only
    abs_err = (a - r).abs().max().item()
    scale = r.abs().max().item()
    rel = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else math.inf)
    return {k: v if math.isfinite(v) else None for k, v in (("max_abs", abs_err), ("max_rel", rel))}


def _staged(world: Communicator, opts: dict):
    """The sharded forward across pipeline stages: on rank 0 (model, report, every layer's
    output, final logits), elsewhere (model, report, None, None)."""
    from shardwise.hf import load_pretrained

    pp = opts["pp"]
    mesh = ParallelDims(world_size=world.size, tp=world.size // pp, pp=pp).build(world)
    layout = StageLayout.build(opts["num_layers"], pp, pp_layers=opts["pp_layers"])
    model, report = load_pretrained(
        opts["model"],
        comm=mesh.tp,
        dtype=opts["dtype"],
        stage=(layout, mesh.pp_rank),
        expert_parallel=opts["expert_parallel"],
        quantize=opts["quantize"],
    )
    ids, mask = _inputs(report.config.vocab_size, False)
    outs: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, _a, out: outs.append(out.detach().float())) for m in model.layers.values()
    ]
    try:
        with torch.no_grad():
            final = StageForward(model, mesh).forward(ids, mask, None, last_only=False)  # (B, T, V) on the last stage
    finally:
        for h in handles:
            h.remove()
    if mesh.tp.rank != 0:
        return model, report, None, None
    pp_comm, B, T = mesh.pp, *ids.shape
    if not mesh.is_first_stage:  # this stage's layer outputs (and the logits) to stage 0
        pp_comm.send(torch.stack(outs), 0)  # (layers, B, T, H)
        if mesh.is_last_stage:
            pp_comm.send(final.float(), 0)  # (B, T, V)
        return model, report, None, None
    H = report.config.hidden_size
    for s in range(1, pp):
        outs.extend(pp_comm.recv((layout.layers[s], B, T, H), torch.float32, s).unbind(0))
    final = pp_comm.recv((B, T, report.config.vocab_size), torch.float32, pp - 1)
    return model, report, outs, final


def _verify_rank(world: Communicator, opts: dict) -> dict | None:
    from shardwise.hf import load_pretrained
    from shardwise.models.bert import BertEncoder

    if opts["pp"] > 1:
        tp = None
        model, report, sharded, sharded_final = _staged(world, opts)
        encoder, family = False, report.family
        dtype = _dtype_of(model, opts, report)
        ids, mask = _inputs(report.config.vocab_size, False)
        if sharded is None:
            return None
    else:
        tp = tp_only(world)
        model, report = load_pretrained(
            opts["model"],
            comm=tp,
            dtype=opts["dtype"],
            expert_parallel=opts["expert_parallel"],
            quantize=opts["quantize"],
        )
        encoder, family = isinstance(model, BertEncoder), report.family
        dtype = _dtype_of(model, opts, report)
        ids, mask = _inputs(_text_config(report.config).vocab_size, encoder)
        sharded, sharded_final = _forward(model, family, ids, mask)
        if tp.rank != 0:
            return None
    blocks = _block_formats(model)
    del model
    full, _ = load_pretrained(opts["model"], comm=LocalCommunicator(), dtype=opts["dtype"], quantize=opts["quantize"])
    unsharded, unsharded_final = _forward(full, family, ids, mask)
    del full
    gc.collect()
    hf, hf_final, note = _transformers(opts["model"], dtype, encoder, ids, mask)
    if hf is not None and len(hf) not in (len(sharded), len(sharded) - 1):
        hf, hf_final, note = None, None, f"transformers returned {len(hf)} hidden states for {len(sharded)} layers"
    real = mask.bool()  # (B, T)
    layers = [
        {
            "layer": i,
            "vs_unsharded": _err(h, unsharded[i], real),
            "vs_transformers": _err(h, hf[i], real) if hf is not None and i < len(hf) else None,
        }
        for i, h in enumerate(sharded)
    ]
    return {
        "model": opts["model"],
        "family": family,
        "tp": tp.size if tp is not None else world.size // opts["pp"],
        "pp": opts["pp"],
        "backend": world.backend,
        "dtype": str(dtype).replace("torch.", ""),
        "quantize": opts["quantize"],
        "block_formats": blocks,
        "lengths": list(LENGTHS),
        "layers": layers,
        "final": {
            "output": "hidden" if encoder else "logits",
            "vs_unsharded": _err(sharded_final, unsharded_final, real),
            "vs_transformers": _err(sharded_final, hf_final, real) if hf is not None else None,
        },
        "transformers_compared": hf is not None,
        "transformers_note": note,
    }


def _dtype_of(model: nn.Module, opts: dict, report) -> torch.dtype:
    """The dtype the model computes in: its first parameter's, or (a quantized model of the
    automatic plan can hold no parameter at all: OLMo's norms have none) the asked-for one,
    else the checkpoint's."""
    p = next(model.parameters(), None)
    if p is not None:
        return p.dtype
    name = opts["dtype"] or getattr(report.config, "dtype", None) or getattr(report.config, "torch_dtype", None)
    name = str(name or "float32").replace("torch.", "")
    return getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else torch.float32


def _block_formats(model: nn.Module) -> list[str]:
    """The GGUF block formats this rank's weights are computed in (empty: none)."""
    from shardwise.kernels import BlockWeight

    held = {f for m in model.modules() for v in vars(m).values() if isinstance(v, BlockWeight) for f in v.formats}
    return sorted(held - {"F32", "F16", "BF16"})


def _ok(e: Err, tol: float) -> bool:
    return e is None or (e["max_rel"] is not None and e["max_rel"] <= tol)


def _worst(errs: list[Err]) -> Err:
    errs = [e for e in errs if e is not None]
    if not errs:
        return None
    return {k: None if any(e[k] is None for e in errs) else max(e[k] for e in errs) for k in ("max_abs", "max_rel")}


def _fmt(e: Err, key: str) -> str:
    return "-" if e is None else "non-finite" if e[key] is None else f"{e[key]:.2e}"


def run(args: argparse.Namespace) -> int:
    # auto: models without shardwise code
    model_dir, cfg = resolve_model(
        args.model, args.tp, auto=True, expert_parallel=args.expert_parallel, quantize=args.quantize
    )
    if args.tolerance is not None and not args.tolerance >= 0:
        return fail(f"--tolerance must be >= 0, got {args.tolerance}")
    if args.pp != 1:
        if cfg is None or not cfg.causal:
            what = "the automatic plan" if cfg is None else "a BERT encoder"
            return fail(f"--pp {args.pp}: pipeline stages need a decoder family, not {what}; use --pp 1")
        layout = resolve_stages(cfg, args.tp, args.pp, args.pp_layers)
    opts = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "pp": args.pp,
        "num_layers": cfg.num_layers if cfg else 0,
        "expert_parallel": args.expert_parallel,
    }
    opts["pp_layers"] = layout.layers if args.pp != 1 else None
    if cfg is not None:  # the automatic plan's models have no formulas: not checked
        check_inference(
            cfg, tp=args.tp, pp_layers=opts["pp_layers"], dtype=args.dtype, quantize=args.quantize,
            expert_parallel=args.expert_parallel, batch=len(LENGTHS), prompt_len=max(LENGTHS), kv_tokens=0,
            backend=args.backend, force=args.force, full_copy_on_rank0=True,
        )  # fmt: skip
    r = job(
        _verify_rank,
        args.tp * args.pp,
        opts,
        tp=args.tp,
        backend=args.backend,
        timeout_s=args.timeout,
        allow_cross_host_tp=args.allow_cross_host_tp,
    )
    if r is None:  # a non-zero rank under an external launcher
        return 0
    tol = args.tolerance if args.tolerance is not None else TOLERANCE.get(r["quantize"] or "", TOLERANCE[r["dtype"]])
    hf_tol = tol
    if args.tolerance is None and r["block_formats"]:
        hf_tol = max(tol, BLOCK_TOLERANCE)
    layers, final = r["layers"], r["final"]
    within = lambda x: _ok(x["vs_unsharded"], tol) and _ok(x["vs_transformers"], hf_tol)
    first = next((x["layer"] for x in layers if not within(x)), None)
    overall = {k: _worst([x[k] for x in [*layers, final]]) for k in ("vs_unsharded", "vs_transformers")}
    passed = first is None and within(final)
    result = {
        **r,
        "tolerance": tol,
        "transformers_tolerance": hf_tol,
        "overall": overall,
        "first_diverging_layer": first,
        "passed": passed,
    }
    if args.json:
        print(json.dumps(result))
        return 0 if passed else 1
    layout = f"tp={r['tp']}" if r["pp"] == 1 else f"tp={r['tp']} x pp={r['pp']}"
    layout += ", expert-parallel" if args.expert_parallel else ""
    print(
        f"verify: {r['family']} model at {model_dir}, {layout} ({r['backend']}), {r['dtype']}"
        + (f", --quantize {r['quantize']} (the unsharded twin too)" if r["quantize"] else "")
        + ", "
        f"2 prompts of {' and '.join(map(str, r['lengths']))} tokens, real tokens only"
    )
    print(f"\n{'':<10} {'sharded vs unsharded':>23}   {'sharded vs transformers':>23}")
    print(f"{'':<10} {'max abs':>11} {'max rel':>11}   {'max abs':>11} {'max rel':>11}")
    rows = [(f"layer {x['layer']}", x) for x in layers] + [(final["output"], final), ("overall", overall)]
    for name, x in rows:
        u, t = x["vs_unsharded"], x["vs_transformers"]
        flag = "" if name == "overall" or within(x) else "  <- exceeds tolerance"
        print(
            f"{name:<10} {_fmt(u, 'max_abs'):>11} {_fmt(u, 'max_rel'):>11}   "
            f"{_fmt(t, 'max_abs'):>11} {_fmt(t, 'max_rel'):>11}{flag}"
        )
    normed = " (its last hidden state has the final norm: last layer not compared)" * (final["output"] == "logits")
    seen = (
        f"{r['transformers_note']}{normed}" if r["transformers_compared"] else f"not compared: {r['transformers_note']}"
    )
    print(f"\ntransformers: {seen}")
    bound = f"{tol:g} relative error"
    if hf_tol != tol:
        formats = ", ".join(r["block_formats"])
        bound += f" ({hf_tol:g} against transformers: weights in {formats} blocks, activations in 8-bit blocks)"
    if passed:
        print(f"PASS: {layout} matches within {bound}")
    else:
        where = f"first diverging layer: {first}" if first is not None else f"the final {final['output']} diverge"
        print(f"FAIL: {layout} exceeds {bound}; {where}")
    return 0 if passed else 1
