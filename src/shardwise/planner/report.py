"""A recommendation as text, as JSON, and as a plot of predicted latency against tp per interconnect."""

from __future__ import annotations

from dataclasses import asdict, replace

from shardwise.planner.cost import Collective, p2p_bytes_per_message
from shardwise.planner.footprint import stage_params
from shardwise.planner.recommend import Recommendation
from shardwise.planner.search import NOT_RUNNABLE, Candidate, evaluate
from shardwise.planner.specs import GIB, Cluster, InferenceWorkload

__all__ = ["render_text", "to_json", "plot"]


def _size(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _colls(colls: list[Collective]) -> str:
    if not colls:
        return "none"
    by_link: dict[str, list[str]] = {}
    for c in colls:
        by_link.setdefault(c.link, []).append(f"{c.key()} x{c.calls} ({_size(c.bytes)})")
    return "; ".join(f"{', '.join(v)} over {link}" for link, v in by_link.items())


def _cluster_line(cl: Cluster) -> str:
    d = cl.device
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in d.peak_tflops.items())
    s = (
        f"cluster: {cl.name}: {cl.devices} x {d.name} ({cl.devices_per_node} per node), {d.memory_gib:.4g} GiB"
        f"{' shared' if cl.shared_memory else ''}, peak TFLOP/s {peaks}, {d.mem_bw_gbps:.4g} GB/s memory\n"
        f"  intra-node: {cl.intra.name}: {cl.intra.busbw_gbps:.3g} GB/s, {cl.intra.latency_us:.3g} us"
    )
    if cl.inter is not None:
        s += f"; inter-node: {cl.inter.name}: {cl.inter.busbw_gbps:.3g} GB/s, {cl.inter.latency_us:.3g} us"
    if cl.intra.after_compute:
        s += "\n  inside a step, a collective costs more after a burst of compute: " + ", ".join(
            f"+{e * 1e6:.0f} us after {b * 1e3:.2g} ms" for b, e in sorted(cl.intra.after_compute)
        )
    if d.busy_compute < 1 or d.busy_memory < 1:
        s += (
            f"\n  with every device busy a device keeps {d.busy_compute:.0%} of its FLOP/s and "
            f"{d.busy_memory:.0%} of its memory bandwidth"
        )
    return s + "".join(f"\n  {n}" for n in cl.notes)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if s < 1 else f"{s * 1e3:.0f}"


def _pipeline(c: Candidate) -> str:
    """ "1f1b m=16" (training, pp > 1), "m=16" (training, pp = 1)."""
    s = c.schedule
    if s is None:
        return f"m={c.microbatches}"
    return f"{s.name}{f' v={s.virtual_stages}' if s.virtual_stages > 1 else ''} m={s.microbatches}"


def render_text(rec: Recommendation, *, top: int = 12) -> str:
    cfg, wl = rec.cfg, rec.workload
    inf = isinstance(wl, InferenceWorkload)
    out = [
        f"model: {rec.model} ({cfg.family}, {stage_params(cfg, 1) / 1e9:.3g}B parameters, {rec.dtype}"
        + (f", weights {rec.quantize})" if rec.quantize else ")"),
        _cluster_line(rec.cluster),
        (
            f"workload: inference, batch {wl.batch} per replica, prompt {wl.prompt_len} + {wl.output_len} new tokens"
            + (f", target {wl.target_latency_ms:g} ms per request" if wl.target_latency_ms else "")
            if inf
            else f"workload: training, global batch {wl.global_batch}, micro-batch {wl.micro_batch}, sequence "
            f"{wl.seq_len}, {wl.optimizer}, {wl.precision}, recomputation {'off' if wl.recompute == 'none' else wl.recompute}"
            + (", sequence parallel" if wl.sequence_parallel else "")
        ),
        f"headroom: {rec.headroom:.0%} of each device's usable memory kept free",
        "",
    ]
    shown = rec.candidates[:top]
    if inf:
        out.append(
            f"  {'layout':<18} {'fits':<4} {'weights':>8} {'KV':>7} {'act':>6} {'total':>7} {'free':>7} GiB/device |"
            f" {'prefill ms':>10} | {'decode ms/token = compute + comm':>32} | {'request ms':>10} | {'tokens/s':>9}"
        )
    else:
        out.append(
            f"  {'layout':<18} {'fits':<4} {'weights':>8} {'grads':>7} {'optim':>7} {'act':>7} {'total':>7}"
            f" {'free':>7} GiB/device | {'step ms = compute + comm + bubble':>38} | {'tokens/s':>9} | MFU | pipeline"
        )
    for c in shown:
        m = c.memory
        mark = ">" if c is rec.recommended else " "
        fit = "yes" if c.fits else "no"
        row = f"{mark} {str(c.layout):<18} {fit:<4} {m.weights / GIB:>8.2f}"
        if inf:
            p = c.inference
            d = p.decode
            row += (
                f" {m.kv_cache / GIB:>7.2f} {m.activations / GIB:>6.2f} {m.total / GIB:>7.2f} {m.free / GIB:>7.2f}"
                f"            | {_ms(p.prefill.total_s):>10} | {_ms(d.total_s):>12} = {_ms(d.compute_s):>8} + "
                f"{_ms(d.comm_s):>7} | {_ms(p.request_s):>10} | {p.tokens_per_s:>9.4g}"
            )
        else:
            t = c.training
            s = t.step
            row += (
                f" {m.grads / GIB:>7.2f} {m.optimizer / GIB:>7.2f} {m.activations / GIB:>7.2f} {m.total / GIB:>7.2f}"
                f" {m.free / GIB:>7.2f}            | {_ms(s.total_s):>9} = {_ms(s.compute_s):>8} + {_ms(s.comm_s):>7}"
                f" + {_ms(s.bubble_s):>7} | {t.tokens_per_s:>9.4g} | {t.mfu:>3.0%} | {_pipeline(c)}"
            )
        uneven = c.balance is not None and not c.balance.even
        out.append(
            row
            + ("  (tp crosses nodes)" if c.cross_node_tp else "")
            + (
                f"  (uneven: {'/'.join(map(str, sorted(set(c.balance.heads), reverse=True)))} heads per rank)"
                if uneven
                else ""
            )
            + ("" if c.runnable else f"  ({NOT_RUNNABLE})")
        )
    if len(rec.candidates) > top:
        out.append(f"  ... {len(rec.candidates) - top} more layouts (--top N, or --json for all)")
    out.append("")
    out.append(f"communication per {'decode token' if inf else 'step'} (one rank; every stage on the critical path):")
    for c in shown:
        pred = c.inference or c.training
        secs = pred.decode.comm_s if inf else pred.step.comm_s
        out.append(f"  {str(c.layout):<18} {_colls(pred.collectives)}: {_ms(secs)} ms")
    if rec.skipped:
        out.append(f"left out: {'; '.join(rec.skipped[:4])}" + (" ..." if len(rec.skipped) > 4 else ""))
    out.append("")
    if rec.recommended is None:
        out.append(f"{rec.nothing_fits[0].upper()}{rec.nothing_fits[1:]}.")
        if rec.alternatives:
            out.append("what would fit instead:")
            out += [f"  - {a}" for a in rec.alternatives]
        return "\n".join(out)
    r = rec.recommended
    extra = f", {r.layout.dp} replicas" if inf and r.layout.dp > 1 else ""
    out.append(f"recommended: {r.layout} (tp={r.layout.tp}{extra})")
    out += [f"  {line}" for line in rec.explanation]
    out += [f"warning: {w}" for w in rec.warnings]
    if rec.command is not None and inf:
        notes = ["MODEL: the checkpoint directory"] if "--model MODEL " in rec.command else []
        notes += [f"{r.layout.dp} replicas: one server each"] if r.layout.dp > 1 else []
        out.append("run it" + (f" ({'; '.join(notes)})" if notes else "") + ":")
        out.append(f"  {rec.command}")
    elif rec.command is not None:
        out.append(
            f"run it (CONFIG.toml with data.global_batch_size = {wl.global_batch}, data.seq_len = {wl.seq_len}):"
        )
        out.append(f"  {rec.command}")
    return "\n".join(out)


def _run_json(c: Candidate, wl) -> dict:
    """How `shardwise train` runs a training candidate: the layout string, schedule, m, split,
    and the [parallel] and [data] config fields that say the same."""
    s = c.schedule
    parallel = {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp}
    if s is not None:
        parallel |= {"schedule": s.name, "virtual_stages": s.virtual_stages}
    if wl.sequence_parallel and c.layout.tp > 1:
        parallel["sequence_parallel"] = True
    return {
        "schedule": None if s is None else s.name,
        "microbatches": c.microbatches,
        "virtual_stages": 1 if s is None else s.virtual_stages,
        "pp_layers": None if s is None else list(s.layers),
        "stages": None if s is None else s.describe(),
        "train_config": {
            "parallel": parallel,
            "data": {"global_batch_size": wl.global_batch, "seq_len": wl.seq_len, "microbatches": c.microbatches},
        }
        | ({"run": {"recompute": wl.recompute}} if wl.recompute != "none" else {}),
    }


def _cand_json(c: Candidate, cfg, wl) -> dict:
    m = c.memory
    d = {
        "layout": c.layout.arg(),
        "tp": c.layout.tp,
        "pp": c.layout.pp,
        "dp": c.layout.dp,
        "fits": c.fits,
        "cross_node_tp": c.cross_node_tp,
        "runnable": c.runnable,
        "why_not": c.why_not,
        "uneven": None
        if c.balance is None or c.balance.even
        else {"query_heads": list(c.balance.heads), "slowdown": c.balance.slowdown, "outrun": c.outrun},
        "memory_gib": {
            k: getattr(m, k) / GIB
            for k in ("weights", "kv_cache", "activations", "grads", "optimizer", "total", "free")
        }
        | {"usable": m.budget / GIB},
    }
    pred = c.inference or c.training
    d["collectives"] = [asdict(x) for x in pred.collectives]
    if c.inference is not None:
        p = c.inference
        d |= {"schedule": None, "microbatches": None}
        d["inference"] = {
            "prefill_ms": {k: v * 1e3 for k, v in asdict(p.prefill).items()} | {"total": p.prefill.total_s * 1e3},
            "decode_ms_per_token": {k: v * 1e3 for k, v in asdict(p.decode).items()}
            | {"total": p.decode.total_s * 1e3},
            "request_ms": p.request_s * 1e3,
            "tokens_per_s": p.tokens_per_s,
            "idle_fraction": p.idle_fraction,
            "meets_target": c.meets_target,
        }
    else:
        t = c.training
        d |= _run_json(c, wl)
        d["training"] = {
            "step_ms": {k: v * 1e3 for k, v in asdict(t.step).items()} | {"total": t.step.total_s * 1e3},
            "micro_batches": t.micro_batches,
            "bubble_fraction": t.bubble_fraction,
            "tokens_per_s": t.tokens_per_s,
            "mfu": t.mfu,
        }
        if c.schedule is not None:
            d["training"]["p2p"] = {
                "messages_per_step": c.schedule.profile().messages,
                "bytes_per_message": p2p_bytes_per_message(
                    wl.micro_batch, wl.seq_len, cfg.hidden_size, wl.prec.weight_bytes
                ),  # fmt: skip
            }
    return d


def to_json(rec: Recommendation) -> dict:
    cfg, cl, wl, r = rec.cfg, rec.cluster, rec.workload, rec.recommended
    return {
        "model": {
            "name": rec.model,
            "family": cfg.family,
            "parameters": stage_params(cfg, 1),
            "dtype": rec.dtype,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
        },
        "workload": {"kind": rec.workload.kind, **asdict(rec.workload)},
        "cluster": {
            "name": cl.name,
            "devices": cl.devices,
            "devices_per_node": cl.devices_per_node,
            "device": asdict(cl.device),
            "intra": asdict(cl.intra),
            "inter": None if cl.inter is None else asdict(cl.inter),
            "shared_memory": cl.shared_memory,
        },
        "headroom": rec.headroom,
        # inference: the weights' format planned (`--quantize`), and why the planner chose it
        "quantize": rec.quantize,
        "quantize_why": rec.quantize_why,
        # the recommendation as `shardwise train` takes it (--layout, --schedule, --microbatches)
        "layout": None if r is None else r.layout.arg(),
        "schedule": None if r is None or r.schedule is None else r.schedule.name,
        "microbatches": None if r is None else r.microbatches,
        "command": rec.command,
        "layouts": [_cand_json(c, cfg, wl) for c in rec.candidates],
        "recommended": None if r is None else _cand_json(r, cfg, wl),
        "pipeline": None if rec.pipeline is None else _cand_json(rec.pipeline, cfg, wl),
        "explanation": rec.explanation,
        "warnings": rec.warnings,
        "skipped": rec.skipped,
        "nothing_fits": rec.nothing_fits,
        "alternatives": rec.alternatives,
    }


def _links(cl: Cluster) -> dict[str, Cluster]:
    """The cluster once per interconnect, with tp groups on that interconnect."""
    out = {cl.intra.name: cl}
    for link in [*([cl.inter] if cl.inter else []), *cl.other_links.values()]:
        out[link.name] = replace(cl, intra=link, inter=None, devices_per_node=cl.devices, other_links={})
    return out


def plot(rec: Recommendation, path: str) -> None:
    """Predicted latency against tp (pp = 1), one line per interconnect; hollow = does not fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inf = isinstance(rec.workload, InferenceWorkload)
    panels = (
        [("decode ms / token", lambda c: c.inference.decode.total_s), ("prefill ms", lambda c: c.inference.prefill.total_s)]
        if inf
        else [("step ms", lambda c: c.training.step.total_s)]
    )  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for name, cl in _links(rec.cluster).items():
        ranked, _ = evaluate(rec.cfg, rec.workload, cl, headroom=rec.headroom, allow_cross_node_tp=True)
        best: dict[int, Candidate] = {}
        for c in ranked:  # per tp: pp = 1 for inference; the fastest fitting pp for training
            if (inf and c.layout.pp != 1) or c.layout.tp in best and not (c.fits and not best[c.layout.tp].fits):
                continue
            best[c.layout.tp] = c
        tps = sorted(best)
        for ax, (label, get) in zip(axes[0], panels, strict=True):
            ys = [get(best[t]) * 1e3 for t in tps]
            (line,) = ax.plot(tps, ys, "-", label=name)
            for t, y in zip(tps, ys, strict=True):
                face = line.get_color() if best[t].fits else "none"
                ax.plot([t], [y], "o", color=line.get_color(), markerfacecolor=face)
            ax.set_xscale("log", base=2)
            ax.set_xticks(tps, [str(t) for t in tps])
            ax.set_xlabel("tp")
            ax.set_ylabel(f"predicted {label}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{rec.model} on {rec.cluster.name} (hollow: does not fit in memory)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
