"""The planner with quantized weights (`--quantize fp16|int8`): bytes per rank against the real
sharded model, the quantized kernel's time by hand, and when the plan recommends quantizing.
The quantized kernel rates are this CPU's, from docs/benchmarks/bench_kernels.json (fbgemm on the 11008 x
4096 weight); nothing here depends on how fast this machine is."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardwise.bench.calibrate import Calibration
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.hf.families import family_for
from shardwise.layers import model_shard_specs
from shardwise.planner import InferenceWorkload, PlannerError, TrainingWorkload, cluster_preset, model_preset, recommend
from shardwise.planner.footprint import projections, stage_params, weight_bytes
from shardwise.planner.predict import Layout, predict_inference
from shardwise.planner.report import render_text, to_json
from shardwise.planner.specs import QUANTIZE
from shardwise.quant import SCHEMES
from shardwise.quant.convert import weight_bytes as runtime_weight_bytes
from shardwise.sharding import parallelize

ROOT = Path(__file__).resolve().parents[2]
BENCH = model_preset("bench-156m")  # h 1024, 8 layers, 16/4 heads, inter 2816, vocab 32000, untied

_MOE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301,
        "max_position_embeddings": 64, "num_experts_per_tok": 2}  # fmt: skip
RAW = {
    "llama": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 200, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301, "max_position_embeddings": 64},
    "qwen2-tied": {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301,
                   "max_position_embeddings": 64, "tie_word_embeddings": True},
    "gpt2-tied": {"model_type": "gpt2", "n_embd": 96, "n_layer": 2, "n_head": 6, "vocab_size": 500, "n_positions": 64},
    "mixtral": {**_MOE, "model_type": "mixtral", "intermediate_size": 96, "num_hidden_layers": 2,
                "num_local_experts": 5},
    "qwen2_moe": {**_MOE, "model_type": "qwen2_moe", "intermediate_size": 80, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 72, "num_hidden_layers": 3, "num_experts": 6,
                  "mlp_only_layers": [1]},
}  # fmt: skip
PROJECTIONS = (".qkv.weight", ".o.weight", ".up.weight", ".down.weight", ".experts.up", ".experts.down")
"""Parameter names `--quantize` converts (attention, the MLP, the shared expert's MLP, the
routed experts; with embed.weight and lm_head.weight); the rest (norms, biases, the router
`mlp.gate`, the shared expert's gate, learned positions) stay."""


def _real_bytes(cfg, model, width: int, quantize: str | None) -> float:
    """Bytes rank 0 (the busiest) holds, by the rules of footprint.weight_bytes applied to the
    real sharded model's local shapes: projections and tables (one per output row / vocab row)."""
    total = 0.0
    for name, spec in model_shard_specs(model).items():
        n = math.prod(spec.local_shape)
        converted = name in ("embed.weight", "lm_head.weight") or name.endswith(PROJECTIONS)
        if quantize is None or not converted:
            total += n * width
            continue
        cols = spec.local_shape[-1]
        if quantize == "fp16":  # a tied head is stored apart from the table
            total += (2 if name == "embed.weight" and cfg.tie_embeddings else 1) * 2 * n
        else:  # int8 is Q8_0 on CPU: 34 bytes per 32 weights, a row padded to whole blocks; tied: one copy
            total += (n // cols) * -(-cols // 32) * 34 if cols else 0
    return total


@pytest.mark.parametrize(
    ("name", "expert_parallel"), [(n, False) for n in RAW] + [("mixtral", True), ("qwen2_moe", True)]
)
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_weight_bytes_per_rank_match_the_real_sharded_model(name, tp, expert_parallel):
    family = family_for(RAW[name])
    cfg = family.config(RAW[name], where=name)
    with torch.device("meta"):
        model = family.model(cfg)
    parallelize(model, family.plan(cfg, expert_parallel=expert_parallel), comm=DryRunCommunicator(tp))
    for width in (4, 2):
        for quantize in (None, *QUANTIZE):
            ours = weight_bytes(cfg, tp, width=width, quantize=quantize, expert_parallel=expert_parallel)
            real = _real_bytes(cfg, model, width, quantize)
            # NOTE: the planner counts 34 / 32 bytes a weight; rows padded to whole blocks of 32
            # (these tiny models: widths of 16-96 per rank) hold up to 25% more; on real widths (multiples of 32) none
            assert ours == real if quantize != "int8" else ours == pytest.approx(real, rel=0.25), (
                width,
                quantize,
                ours,
                real,
            )
    for quantize in QUANTIZE:  # and what the runtime would convert (shardwise.quant, fp32 model)
        ours = weight_bytes(cfg, tp, width=4, quantize=quantize, expert_parallel=expert_parallel)
        assert ours == pytest.approx(runtime_weight_bytes(model, quantize), rel=0 if quantize == "fp16" else 0.25)


def test_weight_bytes_by_hand_and_across_stages():
    # bench-156m per layer: qkv 1536 x 1024, o 1024 x 1024, up 5632 x 1024, down 1024 x 2816
    layer, rows, table = 11_272_192, 1536 + 1024 + 5632 + 1024, 32000 * 1024
    plain = 8 * 2048 + 1024  # the layers' 2 norms and the final norm
    assert projections(BENCH, 1).params == 8 * layer and projections(BENCH, 1).rows == 8 * rows
    assert weight_bytes(BENCH, 1, width=4) == 4 * stage_params(BENCH, 1)
    assert weight_bytes(BENCH, 1, width=4, quantize="fp16") == 4 * plain + 2 * (8 * layer + 2 * table)
    int8 = 4 * plain + (8 * layer + 2 * table) * 34 / 32  # Q8_0: 34 bytes per block of 32
    assert weight_bytes(BENCH, 1, width=4, quantize="int8") == int8
    assert int8 / weight_bytes(BENCH, 1, width=4) == pytest.approx(34 / 128, abs=0.002)  # ~3.8x less
    # pp=2: the first stage holds the table, the last the head and the norm; tied or not, one copy each
    tied = replace(BENCH, tie_embeddings=True)
    for cfg in (BENCH, tied):
        first = weight_bytes(cfg, 1, 2, 0, width=4, quantize="int8")
        assert first == 4 * 4 * 2048 + (4 * layer + table) * 34 / 32
        assert weight_bytes(cfg, 1, 2, 1, width=4, quantize="int8") == first + 4 * 1024
    # tied at pp=1: one fp32 copy, and one Q8_0 copy (its blocks serve the head and the lookup)
    assert weight_bytes(tied, 1, width=4) == weight_bytes(BENCH, 1, width=4) - 4 * table
    assert weight_bytes(tied, 1, width=4, quantize="int8") == int8 - table * 34 / 32
    # fp16 of a bfloat16 tied model stores more than the model itself: the second copy
    assert weight_bytes(tied, 1, width=2, quantize="fp16") > weight_bytes(tied, 1, width=2)


def _kernel_rates() -> dict[str, tuple[tuple[int, float], ...]]:
    """TFLOP/s of fbgemm's fp16 and int8 linears by rows, as docs/benchmarks/bench_kernels.json measured them."""
    rows = json.loads((ROOT / "docs" / "benchmarks" / "bench_kernels.json").read_text())["rows"]
    out: dict[str, list] = {}
    for r in rows:
        if r["shape"] == "7b-mlp-up" and r["kernel"] in ("fp16-fbgemm", "int8-fbgemm"):
            tflops = 2 * r["out"] * r["inp"] * r["rows"] / (r["ms"] * 1e-3) / 1e12
            out.setdefault(r["kernel"].split("-")[0], []).append((r["rows"], tflops))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _calibration(memory_gib: float = 16.0, quantized: bool = True) -> Calibration:
    """A calibrated this-host (2 cores) whose fp32 rates are those the kernel benchmark measured
    too (10.7 GB/s streaming: 5.6 GFLOP/s at one row), with or without the quantized kernels."""
    rates = {k: {str(m): v for m, v in pts} for k, pts in _kernel_rates().items()} if quantized else {}
    return Calibration(
        host="fake", torch="0", devices=2, memory_gib=memory_gib, gemm_tflops={"float32": 0.05}, mem_gbps=10.7,
        layer_overhead_us=200.0, step_overhead_us=200.0, quantized_rows_tflops=rates,
        links={"gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": []}}, created="fake",
    )  # fmt: skip


def _host(memory_gib: float = 16.0, quantized: bool = True):
    return _calibration(memory_gib, quantized).cluster()


WL = InferenceWorkload(prompt_len=128, output_len=32)


def test_the_calibration_carries_the_quantized_kernels():
    dev = _host().device
    assert set(dev.quantized_rows_tflops) == {"fp16", "int8"}
    assert [m for m, _ in dev.quantized_rows_tflops["int8"]] == [1, 4, 16, 64]
    # docs/benchmarks/kernels.md: at one row fbgemm fp16 is ~1.4x and int8 ~2.7x fp32's F.linear
    fp32 = 2 * 11008 * 4096 / 16.1e-3
    assert dev.quantized_flops_at("fp16", 1) / fp32 == pytest.approx(1.43, abs=0.01)
    assert dev.quantized_flops_at("int8", 1) / fp32 == pytest.approx(2.73, abs=0.01)
    assert dev.quantized_flops_at("int8", 2) == pytest.approx(math.sqrt(dev.quantized_flops_at("int8", 1)
                                                                        * dev.quantized_flops_at("int8", 4)))  # fmt: skip
    assert dev.quantized_flops_at("int8", 0.5) == dev.quantized_flops_at("int8", 1)
    assert Calibration.from_json(_calibration().to_json()).cluster().device == dev  # the cache keeps them


def test_quantized_decode_by_hand():
    """tp=1 decode of one sequence: the projections and the head at the kernel's 1-row rate,
    the rest (norms, KV cache) on the roofline, plus the fixed times."""
    cl = _host()
    dev = cl.device
    kw = dict(batch=1, prompt_len=128, output_len=32, width=4, dtype="float32")
    plain = predict_inference(BENCH, cl, Layout(1, 1, 1), **kw).decode
    int8 = predict_inference(BENCH, cl, Layout(1, 1, 1), quantize="int8", **kw).decode
    context = 128 + 32 / 2
    kv = context * 2 * 8 * 4 * 64 * 4
    attention = 8 * 4 * context * 16 * 64  # flops: QK^T and AV
    proj = 2 * (8 * 11_272_192 + 32000 * 1024)
    rest = max(attention / dev.flops_at(1, "float32"), (kv + 4 * (8 * 2048 + 1024)) / dev.bytes_per_s())
    fixed = (8 * 200 + 200) * 1e-6
    assert int8.compute_s == pytest.approx(rest + proj / dev.quantized_flops_at("int8", 1) + fixed)
    assert 1.5 < plain.compute_s / int8.compute_s < 2.7  # the fixed times and the KV cache stay
    fp16 = predict_inference(BENCH, cl, Layout(1, 1, 1), quantize="fp16", **kw).decode
    assert int8.compute_s < fp16.compute_s < plain.compute_s


def test_a_model_that_fits_only_with_int8_is_planned_with_it():
    # bench-156m: 0.58 GiB of weights in fp32, 0.29 in fp16, 0.15 in int8; 0.4 GiB of host memory
    # leaves 0.3 GiB usable (0.27 with headroom), 0.15 per rank at tp=2
    rec = recommend("bench-156m", BENCH, WL, _host(memory_gib=0.4))
    assert rec.quantize == "int8" and rec.quantize_why == "memory"
    assert rec.recommended.layout.replica == 1
    assert rec.unquantized.recommended is None and rec.quantized[0].quantize == "fp16"
    assert rec.quantized[0].recommended is None  # fp16 does not fit either
    text = render_text(rec)
    assert "shardwise serve --model MODEL --tp 1 --quantize int8" in text and rec.command in text
    assert "model: bench-156m (llama, 0.156B parameters, float32, weights int8)" in text
    assert any(x.startswith("Quantized weights (--quantize int8): nothing fits in float32") for x in rec.explanation)
    assert any(x.startswith("int8 weights: ~4x less weight memory") and "shardwise eval-ppl" in x
               for x in rec.explanation)  # fmt: skip
    d = json.loads(json.dumps(to_json(rec)))
    assert d["quantize"] == "int8" and d["quantize_why"] == "memory" and d["workload"]["quantize"] == "int8"
    assert "--quantize int8" in d["command"]
    # fp16 first where it fits: the smaller quality cost; int8 named as the faster one
    more = recommend("bench-156m", BENCH, WL, _host(memory_gib=0.7))
    assert more.quantize == "fp16" and "--quantize fp16" in more.command
    assert any(x.startswith("--quantize int8 would decode") for x in more.explanation)
    # nothing fits even in int8: the dtype's diagnosis
    none = recommend("bench-156m", BENCH, WL, _host(memory_gib=0.1))
    assert none.recommended is None and none.quantize is None and "nothing fits" in none.nothing_fits


def test_a_model_that_fits_is_not_quantized_unless_a_latency_target_needs_it():
    cl = _host()
    rec = recommend("bench-156m", BENCH, WL, cl)
    assert rec.quantize is None and rec.recommended.layout.replica == 1 and "--quantize" not in rec.command
    # what quantizing would give is said, not done
    assert any(x.startswith("With --quantize int8: ") and "not chosen" in x for x in rec.explanation)
    fp32 = rec.recommended.time_s * 1e3
    met = recommend("bench-156m", BENCH, replace(WL, target_latency_ms=fp32 * 1.5), cl)
    assert met.quantize is None and met.recommended.meets_target
    # no fp32 layout meets a target that int8 meets on one device: int8 (no fp16 layout meets it either)
    fastest = {
        q: min(c.time_s for c in recommend("bench-156m", BENCH, replace(WL, quantize=q), cl).candidates) * 1e3
        for q in (None, "fp16", "int8")
    }
    int8 = recommend("bench-156m", BENCH, replace(WL, quantize="int8"), cl).recommended.time_s * 1e3
    assert int8 < fastest["fp16"] < fastest[None] < fp32
    need = recommend("bench-156m", BENCH, replace(WL, target_latency_ms=(int8 + fastest["fp16"]) / 2), cl)
    assert need.quantize == "int8" and need.quantize_why == "latency" and need.recommended.meets_target
    assert need.recommended.layout.replica == 1
    assert any(x.startswith("Quantized weights (--quantize int8): in float32 no layout meets the target")
               for x in need.explanation)  # fmt: skip
    assert "--quantize int8" in need.command
    # a target nothing meets: the dtype's plan, and the warning
    never = recommend("bench-156m", BENCH, replace(WL, target_latency_ms=1.0), cl)
    assert never.quantize is None and any("no layout meets the target" in w for w in never.warnings)


def test_a_format_asked_for_is_planned_alone():
    rec = recommend("bench-156m", BENCH, replace(WL, quantize="fp16"), _host())
    assert rec.quantize == "fp16" and rec.quantize_why is None and rec.quantized == []
    assert rec.explanation[0].endswith("0.29 GiB with fp16 projections and embeddings (--quantize fp16).")
    assert any(x.startswith("Weights in fp16 (--quantize fp16, as asked)") for x in rec.explanation)
    assert rec.recommended.memory.weights == weight_bytes(BENCH, 1, width=4, quantize="fp16")


def test_quantize_needs_a_measured_kernel_and_is_never_planned_for_training():
    with pytest.raises(PlannerError, match="--quantize int8: .* has no measured int8 linear kernel"):
        recommend("bench-156m", BENCH, replace(WL, quantize="int8"), cluster_preset("dgx-h100"))
    with pytest.raises(PlannerError, match="quantize must be one of fp16, int8, got 'int4'"):
        InferenceWorkload(quantize="int4")
    assert not hasattr(TrainingWorkload(), "quantize")
    # not measured (a preset; a calibration without them): the dtype's plan, as before
    assert recommend("bench-156m", BENCH, WL, _host(quantized=False)).quantized == []
    # training on a host with the kernels, in too little memory: never quantized
    wl = TrainingWorkload(global_batch=4, seq_len=128, precision="fp32")
    for memory in (16.0, 0.4):
        rec = recommend("bench-156m", BENCH, wl, _host(memory_gib=memory))
        assert rec.quantize is None and rec.quantized == [] and "--quantize" not in render_text(rec)


def test_the_formats_agree_with_the_runtime():
    assert set(QUANTIZE) <= set(SCHEMES)  # the planner picks among fp16 and int8; block formats come with a file
