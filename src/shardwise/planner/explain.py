"""The recommendation in plain words: why this layout, which pipeline schedule it assumes,
when tensor parallelism does not pay, when a pipeline would win for inference (which does
not run one yet), and, when nothing fits, by how much and what would fit instead.

`rec` below is a recommend.Recommendation (read only: this module comes before it)."""

from __future__ import annotations

from dataclasses import replace

from shardwise.planner.footprint import kv_bytes_per_token, stage_params, touched_experts, weight_bytes
from shardwise.planner.search import NOT_RUNNABLE, evaluate
from shardwise.planner.specs import DTYPE_BYTES, GIB, InferenceWorkload, PlannerError, TrainingWorkload

__all__ = ["explain", "diagnose", "pipeline_line", "PAYOFF", "QUANTIZE_COST"]

PAYOFF = 1.1
"""tp > 1 pays off when it is at least this much faster than tp = 1."""

QUANTIZE_COST = {
    "fp16": "fp16 weights: 2 bytes a weight (half of fp32's, as bf16), activations stay in float32 (measured: "
    "+0.0002% held-out perplexity, the same greedy tokens as fp32 at every tp, docs/benchmarks/quantization.md); "
    "check your model's with `shardwise eval-ppl`",
    "int8": "int8 weights: ~4x less weight memory than fp32 (~2x less than bf16), activations quantized per call "
    "(measured: +0.5% held-out perplexity on the built-in model, docs/benchmarks/quantization.md); check your model's "
    "with `shardwise eval-ppl`",
}
"""What each `--quantize` format costs, in the words the plan prints."""


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def _ms(s: float) -> str:
    if s >= 10:
        return f"{s:.1f} s"
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.3g} ms"


def explain(rec) -> tuple[list[str], list[str]]:
    """(explanation lines, warnings) for a recommendation that has a layout."""
    r, cfg, cl = rec.recommended, rec.cfg, rec.cluster
    lay, mem, dev = r.layout, r.memory, cl.device
    n = stage_params(cfg, 1)
    why = [f"{rec.model}: {n / 1e9:.3g}B parameters, {_gib(n * DTYPE_BYTES[rec.dtype])} of weights in {rec.dtype}."]
    if rec.quantize is not None:
        q = weight_bytes(cfg, 1, width=DTYPE_BYTES[rec.dtype], quantize=rec.quantize)
        why[0] = f"{why[0][:-1]}; {_gib(q)} with {rec.quantize} projections and embeddings (--quantize {rec.quantize})."
    usable = f"{_gib(mem.budget)} usable per {dev.name}"
    one = [c for c in rec.candidates if c.layout.replica == 1]
    if isinstance(rec.workload, TrainingWorkload):
        need = f"at tp=1 pp=1 a device would hold {_gib(one[0].memory.total)}; " if one and lay.replica > 1 else ""
        why.append(
            f"Weights, gradients, optimizer state and activations: {need}the smallest tp that fits with "
            f"{rec.headroom:.0%} headroom is tp={lay.tp}, at {lay} ({_gib(mem.total)} of {usable} on its busiest "
            f"{'stage' if lay.pp > 1 else 'device'}, {_gib(mem.free)} free)."
        )
    elif lay.replica == 1:
        why.append(
            f"It fits on one device ({_gib(mem.total)} of {usable}, {_gib(mem.free)} free), so tp=1: "
            "no tensor parallelism is needed for memory."
        )
    elif one and one[0].fits and rec.workload.target_latency_ms is not None:
        why.append(
            f"It fits on one device ({_gib(one[0].memory.total)}), but the latency target of "
            f"{rec.workload.target_latency_ms:g} ms needs more: the fewest devices that meet it: "
            f"{lay.tp} x {lay.pp} = {lay.replica} per replica ({_gib(mem.total)} of {usable}, {_gib(mem.free)} free)."
        )
    else:
        need = f" (one device would need {_gib(one[0].memory.total)})" if one else ""
        why.append(
            f"It does not fit on one device{need}. The fewest devices that fit{_evenly(rec)} with {rec.headroom:.0%} headroom: "
            f"{lay.tp} x {lay.pp} = {lay.replica} per replica ({_gib(mem.total)} of {usable}, {_gib(mem.free)} free)."
        )
    warn = [f"tp={lay.tp} crosses a node boundary: its collectives go over {cl.inter.name}."] if r.cross_node_tp else []
    if lay.replica > cl.devices_per_node:
        warn.append(
            f"a replica spans {lay.replica // cl.devices_per_node} nodes: pipeline sends cross {cl.inter.name}."
        )
    why += _uneven(rec)
    if isinstance(rec.workload, InferenceWorkload):
        _inference(rec, why, warn)
    else:
        _training(rec, why, warn)
    if rec.pipeline is not None:
        warn.append(_pipeline_would_win(rec))
    return why, warn


def _lost(rec) -> list:
    """Uneven layouts that fit on a smaller replica than the recommendation's but are slower."""
    r = rec.recommended
    return [c for c in rec.candidates if c.fits and c.runnable and c.outrun and c.layout.replica < r.layout.replica]


def _evenly(rec) -> str:
    b = rec.recommended.balance
    return " with an even split" if _lost(rec) and (b is None or b.even) else ""


def _uneven(rec) -> list[str]:
    """What the recommendation's uneven split costs, or which uneven tp fitted but lost."""
    r, cfg = rec.recommended, rec.cfg
    if r.balance is not None and not r.balance.even:
        return [
            f"tp={r.layout.tp} does not divide the {cfg.num_heads} query heads: "
            f"{r.balance.describe().removeprefix('uneven: ')}. "
            "It is still faster than every even layout that fits."
        ]
    lost = _lost(rec)
    if not lost:
        return []
    c = min(lost, key=lambda c: c.time_s)
    return [
        f"tp={c.layout.tp} would fit on fewer devices but splits unevenly ({c.balance.describe().removeprefix('uneven: ')}); "
        f"it is slower than {r.layout} ({_ms(c.time_s)} against {_ms(r.time_s)} per "
        f"{'request' if c.inference is not None else 'step'}), and an uneven tp is recommended only where it wins."
    ]


def _pipeline_would_win(rec) -> str:
    """What the cost model's pick with pp > 1 has over the recommendation."""
    p, r = rec.pipeline, rec.recommended
    per = "per step" if p.training is not None else "per request"
    if p.layout.replica < r.layout.replica:
        better = f"{p.layout.replica} devices per replica instead of {r.layout.replica}"
    elif p.layout.tp < r.layout.tp:
        better = f"a smaller tp, tp={p.layout.tp}; predicted {_ms(p.time_s)} {per} instead of {_ms(r.time_s)}"
    else:
        better = f"predicted {_ms(p.time_s)} {per} instead of {_ms(r.time_s)}"
    return (
        f"{p.layout} would be recommended ({better}), but {NOT_RUNNABLE} (`generate --pp` and `serve --pp` run it); "
        f"{r.layout} is the best layout without a pipeline."
    )


def pipeline_line(c) -> str:
    """The schedule, m, layer split, bubble and stage-to-stage traffic a training layout assumes."""
    t, s = c.training, c.schedule
    sends = [x for x in t.collectives if x.key() == "send/pp"]
    each = sends[0].seconds / sends[0].calls if sends and sends[0].calls else 0.0
    chunks = f" ({s.virtual_stages} chunks per rank)" if s.virtual_stages > 1 else ""
    return (
        f"Pipeline: {s.name} schedule{chunks}, m={t.micro_batches} micro-batches per step, the runtime's default "
        f"layer split ({s.describe()}). Bubble {t.step.bubble_s / t.step.total_s:.0%} of the step "
        f"(the schedule idles {t.bubble_fraction:.1%} with free transfers); {s.profile().messages:.0f} "
        f"stage-to-stage messages per step, the busiest rank sending or receiving {sends[0].calls if sends else 0} "
        f"of them at {_ms(each)} each."
    )


def _speedups(rec, pick) -> list[tuple[int, float, object]]:
    """(tp, speed-up over the recommendation, candidate) for fitting pp=1 layouts with a larger tp."""
    r = rec.recommended
    out = []
    for c in rec.candidates:
        same = c.layout.ep == r.layout.ep or c.layout.tp == 1
        if c.fits and c.layout.pp == 1 and c.layout.tp > r.layout.tp and not c.cross_node_tp and same:
            out.append((c.layout.tp, pick(r) / pick(c), c))
    return sorted(out, key=lambda x: x[0])


def _placement(rec) -> str:
    """Why tensor-parallel experts or expert parallelism wins at the recommended tp: the experts
    the busiest rank reads per decode step under each, and what routing skew would do."""
    r, cfg, wl = rec.recommended, rec.cfg, rec.workload
    lay = r.layout
    twins = {
        c.layout.expert_parallel: c
        for c in rec.candidates
        if (c.layout.tp, c.layout.pp, c.layout.dp) == (lay.tp, lay.pp, lay.dp) and c.fits
    }
    if len(twins) < 2:
        return f"Experts at {lay}: {'whole experts per rank' if lay.expert_parallel else 'every expert split over tp'}."
    tpe, epp = twins[False], twins[True]
    rows = wl.batch
    touched = {ep: touched_experts(cfg, lay.tp, rows, expert_parallel=ep) for ep in (False, True)}
    win, lose = (epp, tpe) if lay.expert_parallel else (tpe, epp)
    ratio = lose.inference.decode.total_s / win.inference.decode.total_s
    how = (
        f"per MoE layer and decode step of {rows} sequence(s) the busiest rank reads slices of "
        f"{touched[False]:.2f} experts (1/{lay.tp} of each) with tensor-parallel experts, and "
        f"{touched[True]:.2f} whole experts with expert parallelism (uniform routing)"
    )
    which = "expert parallelism" if lay.expert_parallel else "tensor-parallel experts"
    skew = (
        "; a skewed router only makes the busiest expert-parallel rank busier (measured: benchmarks/bench_moe.py)"
        if lay.expert_parallel
        else "; a skewed router would widen the gap (tensor-parallel experts split every routed pair evenly)"
    )
    return f"Experts: {which} decode {ratio:.2f}x faster than the other placement at {lay.tp} ranks: {how}{skew}."


def _inference(rec, why: list[str], warn: list[str]) -> None:
    r, wl, cfg = rec.recommended, rec.workload, rec.cfg
    p, lay = r.inference, r.layout
    kv = kv_bytes_per_token(cfg, 1, DTYPE_BYTES[rec.dtype])
    why.append(
        f"KV cache: {kv / 1024:.0f} KiB per token; {wl.batch} x {wl.prompt_len + wl.output_len} tokens take "
        f"{_gib(wl.batch * (wl.prompt_len + wl.output_len) * kv)} in all."
    )
    comm = p.decode.comm_s / p.decode.total_s
    why.append(
        f"Predicted at {lay}: prefill {_ms(p.prefill.total_s)}, decode {_ms(p.decode.total_s)}/token "
        f"({1 - comm:.0%} compute, {comm:.0%} communication), {_ms(p.request_s)} per request; "
        f"{lay.dp} replica(s) of batch {wl.batch} give {p.tokens_per_s:.4g} tokens/s."
    )
    if cfg.num_experts and lay.tp > 1:
        why.append(_placement(rec))
    why += _across_nodes(rec)
    why += _quantization(rec)
    ups = _speedups(rec, lambda c: c.inference.decode.total_s)
    if ups:
        link = rec.cluster.link_for(ups[-1][0]).name
        shown = ", ".join(f"tp={t}: {s:.2f}x" for t, s, _ in ups)
        why.append(f"Decode speed-up of a larger tp over tp={lay.tp} (over {link}): {shown}.")
    if lay.tp == 1 and ups and max(s for _, s, _ in ups) < PAYOFF:
        t, s, c = max(ups, key=lambda x: x[1])
        share = c.inference.decode.comm_s / c.inference.decode.total_s
        warn.append(
            f"tensor parallelism cannot pay off here: the best tp > 1 (tp={t}) decodes only {s:.2f}x as fast as "
            f"{lay} with {c.layout.replica / lay.replica:g}x the devices; communication is {share:.0%} of its decode "
            "step. Run replicas (dp) instead."
        )
    elif lay.tp > 1 and lay.pp == 1 and not (wl.target_latency_ms is not None and r.meets_target):
        why.append(f"tp={lay.tp} is needed for memory, not chosen for speed.")
    if wl.target_latency_ms is not None:
        if r.meets_target:
            why.append(f"Target {wl.target_latency_ms:g} ms per request: met ({_ms(p.request_s)}).")
        else:
            fast = min((c for c in rec.candidates if c.fits and c.runnable), key=lambda c: c.time_s)
            over = fast.time_s * 1e3 - wl.target_latency_ms
            warn.append(
                f"no layout meets the target of {wl.target_latency_ms:g} ms per request: the fastest that fits, "
                f"{fast.layout}, predicts {_ms(fast.time_s)} ({over:.4g} ms over)."
            )


def _across_nodes(rec) -> list[str]:
    """A replica over several nodes: what its layout sends across them, against the same devices
    as one tp group across the nodes, its all-reduces in fp32 and in the fastest compressed
    wire format (planner.wire: what `--comm-dtype auto` picks on such a link)."""
    from shardwise.planner.predict import Layout, predict_inference

    r, cl, wl = rec.recommended, rec.cluster, rec.workload
    lay = r.layout
    if cl.nodes == 1 or cl.inter is None or lay.replica <= cl.devices_per_node:
        return []
    kw = dict(batch=wl.batch, prompt_len=wl.prompt_len, output_len=wl.output_len, width=DTYPE_BYTES[rec.dtype],
              dtype=rec.dtype, quantize=wl.quantize)  # fmt: skip
    across = Layout(lay.replica, 1, lay.dp)
    by_wire = {w: predict_inference(rec.cfg, cl, across, comm_dtype=w, **kw) for w in ("fp32", "auto")}
    fp32, best = by_wire["fp32"].decode.total_s, by_wire["auto"]
    ours = r.inference.decode.total_s
    if lay.tp > cl.devices_per_node:
        head = f"{lay}: its tp group crosses the nodes ({cl.inter.name})"
    else:
        head = f"{lay}: tp inside a node, the pipeline across the nodes ({cl.inter.name}: one activation a token)"
    line = f"Across nodes: {head}, {_ms(ours)}/token. tp={across.tp} across the nodes would decode at {_ms(fp32)}/token with fp32 all-reduces"
    if best.wire != "fp32":
        saved = 1 - best.decode.total_s / fp32
        if lay.tp > cl.devices_per_node:
            verdict = "which is the layout recommended"
        elif best.decode.total_s < ours:
            verdict = "and wins (--allow-cross-node-tp plans it)"
        else:
            verdict = f"and still loses to {lay}"
        line += (
            f", {_ms(best.decode.total_s)} with them compressed to {best.wire} on the wire (`--comm-dtype {best.wire}`, "
            f"what `auto` picks there): compression saves {saved:.0%} {verdict}."
        )
    else:
        line += "; compressing them (bf16, q8) would not be faster on this link: the cost is per message, not bytes."
    return [line]


def _weights_at(rec, c, quantize: str | None) -> float:
    """Weight bytes per device of candidate c's layout with weights stored as `quantize`."""
    lay, kw = c.layout, dict(width=DTYPE_BYTES[rec.dtype], expert_parallel=c.layout.expert_parallel)
    return max(weight_bytes(rec.cfg, lay.tp, lay.pp, s, quantize=quantize, **kw) for s in {0, lay.pp - 1})


def _quantization(rec) -> list[str]:
    """Quantized weights: why the plan stores them (memory, a latency target, or asked for),
    what they cost; or, weights in the dtype, what a measured `--quantize` format would give."""
    r, q, wl = rec.recommended, rec.quantize, rec.workload
    d = r.inference.decode.total_s
    if q is None:
        out = []
        for other in rec.quantized:
            c = other.recommended
            if c is None:
                continue
            speed = d / c.inference.decode.total_s
            if c.layout.replica < r.layout.replica or speed >= PAYOFF:
                out.append(
                    f"With --quantize {other.quantize}: {c.layout}, decode {speed:.2f}x as fast "
                    f"({_ms(c.inference.decode.total_s)}/token), {_gib(c.memory.weights)} of weights per device; "
                    f"not chosen, as {rec.dtype} fits{' and meets the target' if wl.target_latency_ms else ''} "
                    f"({QUANTIZE_COST[other.quantize]})."
                )
        return out
    held = f"{_gib(r.memory.weights)} of weights per device at {r.layout} ({_gib(_weights_at(rec, r, None))} in {rec.dtype})"
    base = rec.unquantized
    if rec.quantize_why == "memory":
        small = min(base.candidates, key=lambda c: c.memory.total)
        why = (
            f"Quantized weights (--quantize {q}): nothing fits in {rec.dtype} (the smallest footprint, {small.layout}, "
            f"needs {_gib(small.memory.total)} per device of {_gib(small.memory.budget)} usable); in {q}, {held}."
        )
    elif rec.quantize_why == "latency":
        fast = min((c for c in base.candidates if c.fits and c.runnable), key=lambda c: c.time_s)
        why = (
            f"Quantized weights (--quantize {q}): in {rec.dtype} no layout meets the target of "
            f"{wl.target_latency_ms:g} ms per request (the fastest that fits, {fast.layout}, takes {_ms(fast.time_s)}); "
            f"in {q}, {r.layout} takes {_ms(r.time_s)}."
        )
    else:
        why = f"Weights in {q} (--quantize {q}, as asked): {held}."
    out = [why, f"{QUANTIZE_COST[q]}."]
    for other in rec.quantized:  # a faster format that fits too (int8 after fp16)
        c = other.recommended
        if c is not None and d / c.inference.decode.total_s >= PAYOFF:
            out.append(
                f"--quantize {other.quantize} would decode {d / c.inference.decode.total_s:.2f}x as fast "
                f"({c.layout}, {_ms(c.inference.decode.total_s)}/token), at a larger quality cost."
            )
    return out


def _training(rec, why: list[str], warn: list[str]) -> None:
    r, wl = rec.recommended, rec.workload
    t, lay = r.training, r.layout
    s = t.step
    why.append(
        f"Predicted at {lay}: {_ms(s.total_s)} per step ({s.compute_s / s.total_s:.0%} compute, "
        f"{s.comm_s / s.total_s:.0%} communication, {s.bubble_s / s.total_s:.0%} pipeline bubble with "
        f"{t.micro_batches} micro-batches), {t.tokens_per_s:.4g} tokens/s, MFU {t.mfu:.0%}."
    )
    if r.schedule is not None:
        why.append(pipeline_line(r))
    fastest = min((c for c in rec.candidates if c.fits and c.runnable), key=lambda c: c.time_s)
    if fastest is not r and r.time_s / fastest.time_s >= 1.05:
        why.append(
            f"{fastest.layout} is predicted {r.time_s / fastest.time_s:.2f}x faster per step, with a larger tp; "
            "pick it if throughput matters more than the smallest tp."
        )
    if lay.tp == 1:
        ups = [c for c in rec.candidates if c.fits and c.runnable and c.layout.tp > 1]
        if ups and max(r.time_s / c.time_s for c in ups) < PAYOFF:
            warn.append(
                "tensor parallelism cannot pay off here: no layout with tp > 1 is "
                f"{PAYOFF:.1f}x faster per step than {lay}; data parallelism uses the devices better."
            )
    elif wl.recompute != "full" and lay.tp > 1:
        ranked, _ = evaluate(rec.cfg, replace(wl, recompute="full"), rec.cluster, headroom=rec.headroom)
        if ranked and ranked[0].fits and ranked[0].runnable and ranked[0].layout.tp < lay.tp:
            c = ranked[0]
            why.append(
                f"With activation recomputation (--recompute) tp={c.layout.tp} would fit: {c.layout}, "
                f"{_ms(c.time_s)} per step instead of {_ms(r.time_s)}."
            )


def diagnose(rec, allow_cross: bool) -> tuple[str, list[str]]:
    """(how far the smallest footprint shardwise can run is over budget, what would fit instead)."""
    cfg, wl, cl, h = rec.cfg, rec.workload, rec.cluster, rec.headroom
    runnable = [c for c in rec.candidates if c.runnable] or rec.candidates
    best = min(runnable, key=lambda c: c.memory.total)
    m = best.memory
    need = m.total / (1 - h)
    named = (("weights", m.weights), ("KV cache", m.kv_cache), ("activations", m.activations))
    named += (("gradients", m.grads), ("optimizer state", m.optimizer))
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in named if v)
    msg = (
        f"nothing fits on {cl.devices} x {cl.device.name}"
        + (" without a pipeline" if rec.pipeline is not None else "")
        + f": the smallest footprint, {best.layout}, needs "
        f"{_gib(m.total)} per device ({parts}), but a device has "
        f"{_gib(m.budget)} usable; with {h:.0%} headroom that is {_gib(need - m.budget)} short"
    )

    def first_fit(wl2, cl2, *, pipeline: bool = False):
        """The best fitting layout of wl2 on cl2 (one with pp > 1 only if `pipeline`), or None.
        Training: with 1F1B unless a schedule is asked for (it holds the fewest activations, so
        what fits with any schedule fits with it; and it is the cheapest to simulate)."""
        if isinstance(wl2, TrainingWorkload) and wl2.schedule is None:
            wl2 = replace(wl2, schedule="1f1b")
        try:
            ranked, _ = evaluate(cfg, wl2, cl2, headroom=h, allow_cross_node_tp=allow_cross)
        except PlannerError:
            return None
        return ranked[0] if ranked and ranked[0].fits and (pipeline or ranked[0].runnable) else None

    alts = []
    if rec.pipeline is not None:
        alts.append(f"a pipeline, once its prediction is validated ({NOT_RUNNABLE}): {rec.pipeline.layout}")
    if cl.inter is not None:
        for nodes in [*range(cl.nodes + 1, cl.nodes + 16), 32, 64, 128, 256]:
            c = first_fit(wl, replace(cl, devices=nodes * cl.devices_per_node), pipeline=True)
            if c is not None:
                label = "" if c.runnable else f" ({NOT_RUNNABLE})"
                alts.append(f"{nodes} nodes ({nodes * cl.devices_per_node} devices): {c.layout}{label}")
                break
    alts.append(f"a device with at least {_gib(need + cl.device.reserved_gib * GIB)} of memory, at {best.layout}")
    if isinstance(wl, InferenceWorkload):
        if wl.batch > 1:
            ok = [b for b in range(wl.batch - 1, 0, -1) if first_fit(replace(wl, batch=b), cl)]
            if ok:
                alts.append(f"batch {ok[0]} instead of {wl.batch}")
        if (wl.dtype or cfg.dtype) == "float32" and first_fit(replace(wl, dtype="bfloat16"), cl):
            alts.append("bfloat16 instead of float32 (--dtype bfloat16)")
    elif isinstance(wl, TrainingWorkload):
        tries = [("activation recomputation (--recompute)", dict(recompute="full"))] if wl.recompute != "full" else []
        if wl.micro_batch > 1:
            tries.append(("micro-batch 1", dict(micro_batch=1)))
        if wl.precision == "fp32":
            tries.append(("bf16-mixed precision", dict(precision="bf16-mixed")))
        for what, kw in tries:
            c = first_fit(replace(wl, **kw), cl)
            if c is not None:
                alts.append(f"{what}: {c.layout}")
    return msg, alts
