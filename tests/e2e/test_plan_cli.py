"""`shardwise plan` as a user runs it (this-host with fake calibration data in a temp cache)."""

from __future__ import annotations

import json
import platform
import subprocess

import pytest
import torch

from processes import run_cli_inline


def _plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`shardwise plan ...` in this process: a plan starts no rank (a this-host plan reads its
    calibration from the cache here; see run_cli_inline)."""
    return run_cli_inline("plan", *args, env=env)


@pytest.mark.gate
def test_plan_a_preset_as_json_and_bad_input():
    out = _plan("--model", "Llama-3-8B", "--cluster", "dgx-a100-80gb", "--batch", "4", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["recommended"]["layout"] == plan["layout"] == "tp=1,pp=1,dp=8"
    assert plan["schedule"] is None and plan["microbatches"] is None and plan["quantize"] is None
    assert plan["command"] == "shardwise serve --model MODEL --tp 1 --max-batch-size 4 --max-model-len 640"
    assert plan["model"]["parameters"] == 8_030_261_248  # Llama-3-8B
    assert {c["tp"] for c in plan["layouts"]} == set(range(1, 9))  # any tp up to the 8 devices (32 heads)
    assert {c["tp"] for c in plan["layouts"] if c["uneven"] is None} == {1, 2, 4, 8}
    bad = _plan("--model", "llama-3-9b", "--cluster", "dgx-a100-80gb")
    assert bad.returncode == 2 and "unknown model preset 'llama-3-9b' (did you mean 'llama-3-8b'?)" in bad.stderr
    none = _plan("--model", "gpt3-175b", "--cluster", "pcie-8x-rtx4090")
    assert none.returncode == 2 and "Nothing fits on" in none.stdout and "GiB short" in none.stdout
    # a workload the model's context cannot take is refused before this host is calibrated (minutes)
    long = _plan("--model", "src/shardwise/assets/default", "--cluster", "this-host", "--recalibrate",
                 "--prompt-len", "512", "--output-len", "128")  # fmt: skip
    assert long.returncode == 2 and "= 640 exceeds the model's context of 512 tokens" in long.stderr, long.stderr


@pytest.mark.gate
def test_plan_this_host_from_the_cache_with_a_plot(tmp_path):
    from shardwise.bench.calibrate import VERSION, _cores

    cal = {
        "host": platform.node() or "localhost", "torch": torch.__version__, "devices": _cores(), "memory_gib": 16.0,
        "gemm_tflops": {"float32": 0.05}, "mem_gbps": 10.0, "layer_overhead_us": 200.0, "step_overhead_us": 200.0,
        "links": {"gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": []}}, "unavailable": {"mpi": "test"},
        "version": VERSION,
    }  # fmt: skip
    (tmp_path / "calibration.json").write_text(json.dumps(cal))
    png = tmp_path / "plan.png"
    out = _plan(
        "--model", "bench-156m", "--cluster", "this-host", "--prompt-len", "128", "--output-len", "32",
        "--link", "gloo", "--plot", str(png), env={"SHARDWISE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "calibrating" not in out.stderr  # the cache was used
    assert "recommended: tp=1 pp=1" in out.stdout and "gloo (measured)" in out.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    uncalibrated = _plan("--model", "bench-156m", "--link", "mpi", env={"SHARDWISE_CACHE_DIR": str(tmp_path)})
    assert uncalibrated.returncode == 2
    assert "backend 'mpi' has no calibration on this host (test)" in uncalibrated.stderr


@pytest.mark.gate
def test_plan_recommends_a_training_pipeline_with_the_line_that_runs_it():
    from shardwise.train.config import ParallelSection

    args = ("--model", "llama-3-8b", "--cluster", "dgx-h100", "--train", "--global-batch", "64")
    out = _plan(*args, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    rec = plan["recommended"]
    # the layout in the form `shardwise train --layout` takes (ParallelSection.layout())
    assert plan["layout"] == rec["layout"] == ParallelSection(tp=1, pp=4, dp=2).layout() == "tp=1,pp=4,dp=2"
    assert plan["schedule"] == rec["schedule"] == "1f1b" and plan["microbatches"] == rec["microbatches"] == 32
    assert rec["train_config"]["parallel"] == {"tp": 1, "pp": 4, "dp": 2, "schedule": "1f1b", "virtual_stages": 1}
    assert rec["pp_layers"] == [8] * 4 and rec["training"]["p2p"]["messages_per_step"] == 2 * 32 * (4 - 1)
    assert (
        plan["command"]
        == "shardwise train --config CONFIG.toml --layout tp=1,pp=4,dp=2 --schedule 1f1b --microbatches 32"
    )
    assert all(c["runnable"] for c in plan["layouts"])
    text = _plan(*args)
    assert "> tp=1 pp=4 dp=2" in text.stdout and "Pipeline: 1f1b schedule, m=32 micro-batches" in text.stdout
    assert f"  {plan['command']}" in text.stdout
    assert "not runnable" not in text.stdout and "not recommended for inference" not in text.stdout
    # GPipe holds all 32 micro-batches' activations: no pipeline fits; without one tp=4 does (at tp=2
    # bf16 training's 18 bytes per parameter, as shardwise holds them, and the activations do not)
    gpipe = _plan(*args, "--schedule", "gpipe", "--top", "20")
    assert gpipe.returncode == 0, gpipe.stderr
    (row,) = [line for line in gpipe.stdout.splitlines() if line.startswith("  tp=1 pp=4 dp=2 ") and "|" in line]
    assert " no " in row and row.endswith("gpipe m=32")
    assert "recommended: tp=4 pp=1 dp=2" in gpipe.stdout
    assert "  shardwise train --config CONFIG.toml --layout tp=4,pp=1,dp=2 --microbatches 32" in gpipe.stdout


@pytest.mark.gate
def test_plan_inference_ranks_pipelines_like_other_layouts():
    out = _plan("--model", "llama-3-70b", "--cluster", "dgx-a100-80gb", "--batch", "8", "--top", "20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "recommended: tp=2 pp=1 dp=4" in out.stdout
    assert "tp=1 pp=2 dp=4" in out.stdout and "not recommended for inference" not in out.stdout
    assert "shardwise train" not in out.stdout


@pytest.mark.gate
def test_plan_recommends_quantized_weights_when_nothing_else_fits(tmp_path):
    from shardwise.bench.calibrate import VERSION, _cores

    # this-host with fbgemm's kernels as docs/benchmarks/bench_kernels.json measured them (TFLOP/s by rows)
    rates = {"fp16": {"1": 0.0080, "4": 0.0251, "16": 0.0328}, "int8": {"1": 0.0153, "4": 0.0671, "16": 0.0972}}
    cal = {
        "host": platform.node() or "localhost", "torch": torch.__version__, "devices": _cores(), "memory_gib": 16.0,
        "gemm_tflops": {"float32": 0.05}, "mem_gbps": 10.7, "layer_overhead_us": 200.0, "step_overhead_us": 200.0,
        "links": {"gloo": {"latency_us": 300.0, "busbw_gbps": 1.0, "points": []}}, "quantized_rows_tflops": rates,
        "version": VERSION,
    }  # fmt: skip
    (tmp_path / "calibration.json").write_text(json.dumps(cal))
    env = {"SHARDWISE_CACHE_DIR": str(tmp_path)}
    # bench-156m: 0.58 GiB of weights in fp32, 0.15 GiB in int8; 0.3 GiB usable (2 GiB kept for the runtime)
    args = ("--model", "bench-156m", "--prompt-len", "128", "--output-len", "32", "--memory-gib", "2.3")
    out = _plan(*args, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model: bench-156m (llama, 0.156B parameters, float32, weights int8)" in out.stdout
    assert "Quantized weights (--quantize int8): nothing fits in float32" in out.stdout
    assert "int8 weights: ~4x less weight memory than fp32 (~2x less than bf16), activations quantized" in out.stdout
    cmd = "  shardwise serve --model MODEL --tp 1 --quantize int8 --max-batch-size 1 --max-model-len 160"
    assert cmd in out.stdout.splitlines()
    plan = json.loads(_plan(*args, "--json", env=env).stdout)
    assert plan["quantize"] == "int8" and plan["quantize_why"] == "memory" and plan["command"] == cmd.strip()
    # asked for: planned with that format; in plenty of memory, not chosen unasked
    fp16 = _plan(*args[:-1], "16", "--quantize", "fp16", env=env)
    assert fp16.returncode == 0 and "Weights in fp16 (--quantize fp16, as asked)" in fp16.stdout
    assert "--quantize" not in _plan(*args[:-1], "16", env=env).stdout.split("run it")[-1]
    # never for training; nor where the kernels were not measured
    train = _plan("--model", "bench-156m", "--train", "--quantize", "int8", env=env)
    assert (
        train.returncode == 2 and "--quantize int8 is for inference; training does not take --quantize" in train.stderr
    )
    gpu = _plan("--model", "llama-3-8b", "--cluster", "dgx-h100", "--quantize", "int8")
    assert gpu.returncode == 2 and "has no measured int8 linear kernel" in gpu.stderr


@pytest.mark.gate
def test_plan_two_hosts_like_this_one_from_the_command_line(tmp_path):
    from shardwise.bench.calibrate import VERSION, _cores

    def link(small_us: float, big_us: float, send_us: float) -> dict:
        pts = [{"size_bytes": 4096, "latency_us": small_us}, {"size_bytes": 1 << 20, "latency_us": big_us}]
        return {"latency_us": small_us, "busbw_gbps": 1.0, "points": pts, "send_us": send_us}

    cal = {
        "host": platform.node() or "localhost", "torch": torch.__version__, "devices": _cores(), "memory_gib": 16.0,
        "gemm_tflops": {"float32": 0.05, "bfloat16": 0.1}, "mem_gbps": 10.0, "layer_overhead_us": 200.0,
        "step_overhead_us": 200.0, "version": VERSION,
        "links": {"gloo": link(300, 1300, 150), "shm": link(20, 400, 20), "veth": link(700, 2500, 350)},
    }  # fmt: skip
    (tmp_path / "calibration.json").write_text(json.dumps(cal))
    env = {"SHARDWISE_CACHE_DIR": str(tmp_path)}
    # llama-3-8b in bf16 needs 4 devices of 7 GiB: 2 hosts x 2 ranks, 100 Mbit/s between them
    args = ["--model", "llama-3-8b", "--cluster", "this-host", "--nodes", "2", "--devices-per-node", "2"]
    args += ["--inter-gbps", "0.0125", "--batch", "32", "--prompt-len", "64", "--output-len", "16"]
    out = _plan(*args, "--allow-cross-node-tp", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "recommended: tp=2 pp=2 dp=1" in out.stdout
    assert "veth (measured) at 0.0125 GB/s" in out.stdout and "shm over gloo (measured)" in out.stdout
    assert "compressed to q8 on the wire" in out.stdout and "still loses to tp=2 pp=2" in out.stdout
    plan = json.loads(_plan(*args, "--json", env=env).stdout)
    assert plan["layout"] == "tp=2,pp=2,dp=1"
    one = _plan("--model", "llama-3-8b", "--cluster", "this-host", "--nodes", "0", env=env)
    assert one.returncode == 2 and "--nodes must be >= 1, got 0" in one.stderr
