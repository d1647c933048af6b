"""`shardwise generate` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_models import TINY, prompts, save_tiny
from processes import process_tag, run_cli, run_cli_inline, wait_gone
from shardwise.launch.env import resolve_backend

BIN = Path(sys.executable).parent
_AUTO = resolve_backend("auto")


def test_default_model_json_at_tp2_matches_tp1():
    out = run_cli("generate", "--tp", "2", "--max-new-tokens", "8", "--json", "--compare-tp1")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)  # stdout is exactly one JSON object
    assert r["tp"] == 2 and r["backend"] == _AUTO and r["matches_tp1"] is True  # --backend auto, recorded
    assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == 8 and isinstance(r["text"][0], str)
    assert r["prefill_ms"] > 0 and r["decode_ms_per_token"] > 0
    assert len(r["param_bytes_per_rank"]) == 2 and r["param_bytes_per_rank"][0] == r["param_bytes_per_rank"][1]
    # 4 layers x 2 + the embedding = 9 all-reduces, and greedy: 1 all-gather of each rank's best
    # (value, index), 16 bytes, no logits gathered and no token broadcast (engine.argmax)
    c = r["collectives_per_token"]
    assert (c["all_reduce/tp"]["calls"], c["all_gather/tp"]["calls"]) == (9, 1) and "broadcast/tp" not in c
    assert c["all_gather/tp"]["bytes"] == 16


def test_human_output_streams_text_and_summarises():
    out = run_cli("generate", "--tp", "2", "--prompt", "Hello there", "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert "trained on Jane Austen's novels" in out.stdout
    assert out.stdout.split("\n\n", 1)[1].startswith("Hello there")
    assert f"tp=2 ({_AUTO}), float32: 6 tokens" in out.stdout and "ms/token (median)" in out.stdout


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = save_tiny("llama3", tmp_path_factory.mktemp("cli"))
    model = getattr(transformers, TINY["llama3"][1]).from_pretrained(path).eval()
    ids, mask = prompts(model.config.vocab_size)
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    lists = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    return path, lists, ref[:, ids.shape[1] :].tolist()


def test_batch_of_prompt_ids_matches_transformers(tiny_llama):
    """At tp=3: 8 query heads / 2 KV heads split 3/3/2, rank 1 with irregular groups (1, 2)."""
    path, lists, ref = tiny_llama
    args = ["generate", "--model", str(path), "--tp", "3", "--max-new-tokens", "10", "--json", "--ignore-eos"]
    for p in lists:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"] == ref


def test_under_torchrun(tiny_llama):
    path, lists, ref = tiny_llama
    if not (BIN / "torchrun").exists():
        pytest.skip("torchrun not installed")
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "shardwise", "generate"]
    cmd += ["--model", str(path), "--tp", "2", "--max-new-tokens", "10", "--json", "--ignore-eos"]
    cmd += ["--prompt-ids", ",".join(map(str, lists[0]))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, "only rank 0 prints"
    assert json.loads(lines[0])["tokens"] == [ref[0]]


@pytest.mark.gate
@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "9"], r"tp=9 is more than the model's num_attention_heads=8: .*; valid tp sizes: 1-8"),
        (["--model", "/nonexistent/model"], r"model directory /nonexistent/model does not exist"),
        (["--prompt-ids", "1,2,99999"], r"prompt 0 has token ids outside the vocabulary \[0, 512\): \[99999\]"),
        (["--prompt", ""], r"prompt 0 is empty"),
        (["--max-new-tokens", "1000"], r"over the model's context of 512"),
    ],
)
def test_bad_input_is_one_line_and_starts_no_rank(args, message):
    import re

    start = time.monotonic()
    out = run_cli_inline("generate", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), out.stderr
    assert time.monotonic() - start < 30


@pytest.mark.gate
def test_failing_rank_takes_the_job_down_and_leaves_no_process():
    tag = process_tag()
    start = time.monotonic()
    out = run_cli("generate", "--tp", "3", "--debug-fail-rank", "1", "--timeout", "20", env=tag)
    assert out.returncode == 1
    assert out.stderr.count("rank 1 failed: RuntimeError: injected failure on rank 1") == 1
    assert time.monotonic() - start < 20 + 30
    assert wait_gone(tag=tag, within_s=10) == [], "orphan rank processes remain"


def test_console_script_is_installed():
    exe = shutil.which("shardwise", path=str(BIN))
    assert exe is not None
    out = subprocess.run([exe, "info", "--tp", "2"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "parameters per rank" in out.stdout


@pytest.mark.gate
@pytest.mark.parametrize("backend", ["mpi", pytest.param("gloo", marks=pytest.mark.full)])
def test_under_mpiexec(tiny_llama, backend):
    """mpiexec starts the ranks: MPI needs nothing more; gloo meets at MASTER_ADDR:MASTER_PORT."""
    from shardwise.launch import free_port

    path, lists, ref = tiny_llama
    if not (BIN / "mpiexec").exists():
        pytest.skip("mpiexec not installed (pip install mpich)")
    cmd = [str(BIN / "mpiexec"), "-n", "2"]
    if backend == "gloo":
        cmd += ["-genv", "MASTER_ADDR", "127.0.0.1", "-genv", "MASTER_PORT", str(free_port())]
    cmd += [sys.executable, "-m", "shardwise", "generate", "--model", str(path), "--tp", "2", "--max-new-tokens", "10"]
    cmd += ["--backend", backend, "--json", "--ignore-eos", "--prompt-ids", ",".join(map(str, lists[1]))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, "only rank 0 prints"
    result = json.loads(lines[0])
    assert result["tokens"] == [ref[1]] and result["backend"] == backend


def test_backend_mpi_starts_its_own_ranks_under_mpiexec(tiny_llama):
    path, lists, ref = tiny_llama
    out = run_cli(
        "generate",
        "--model",
        str(path),
        "--tp",
        "2",
        "--max-new-tokens",
        "10",
        "--backend",
        "mpi",
        "--json",
        "--ignore-eos",
        "--prompt-ids",
        ",".join(map(str, lists[0])),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["backend"] == "mpi" and result["tokens"] == [ref[0]]
