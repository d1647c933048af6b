"""A real out-of-memory kill: `generate` started inside a memory cgroup whose limit is smaller
than its two ranks need. Without --force the pre-check refuses in one line, naming the cgroup's
room; with --force a rank is killed by the kernel's OOM killer and the launcher says so (not
only "killed by signal SIGKILL"), and no rank outlives the job.

Needs a memory cgroup this test may create (root with cgroup v1's memory hierarchy, or a
delegated cgroup v2 subtree); skipped elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from processes import process_tag, wait_gone

LIMIT = 700 * 2**20


def _cgroup() -> tuple[Path, str] | None:
    """A new memory cgroup directory and the file that sets its limit, or None."""
    name = f"shardwise-oom-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        try:
            (v1 / name).mkdir()
            return v1 / name, "memory.limit_in_bytes"
        except OSError:
            return None
    own = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2].lstrip("/")
    v2 = Path("/sys/fs/cgroup") / own
    if "memory" in (v2 / "cgroup.subtree_control").read_text() if (v2 / "cgroup.subtree_control").exists() else False:
        try:
            (v2 / name).mkdir()
            return v2 / name, "memory.max"
        except OSError:
            return None
    return None


@pytest.fixture
def cgroup():
    found = _cgroup()
    if found is None:
        pytest.skip("no memory cgroup can be created here")
    path, limit_file = found
    (path / limit_file).write_text(str(LIMIT))
    yield path
    with contextlib.suppress(OSError):  # a process still inside: the kernel keeps it
        path.rmdir()


def _big_checkpoint(root: Path) -> Path:
    """A llama checkpoint of 194M parameters stored as bf16 (388 MB), loaded as fp32: 388 MB per
    rank at tp 2, each rank 550 MB or more with its runtime."""
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=4096,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=256, rms_norm_eps=1e-5, torch_dtype="bfloat16", tie_word_embeddings=False,
    )  # fmt: skip
    h, f, v = 1024, 4096, 32000
    tensors = {"model.embed_tokens.weight": torch.zeros(v, h), "lm_head.weight": torch.zeros(v, h)}
    tensors["model.norm.weight"] = torch.ones(h)
    for i in range(8):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{n}.weight"] = torch.zeros(h, h)
        tensors[p + "mlp.gate_proj.weight"] = torch.zeros(f, h)
        tensors[p + "mlp.up_proj.weight"] = torch.zeros(f, h)
        tensors[p + "mlp.down_proj.weight"] = torch.zeros(h, f)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _run_in(cgroup: Path, args: list[str], tag: dict[str, str]) -> subprocess.CompletedProcess:
    def enter() -> None:  # the command and every process it starts live in the cgroup
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    env = {**os.environ, "OMP_NUM_THREADS": "1", **tag}
    env.pop("SHARDWISE_MEMORY_LIMIT", None)
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=300, env=env,
        preexec_fn=enter, check=False,
    )  # fmt: skip


def test_a_rank_killed_by_the_oom_killer_is_reported_as_such(cgroup, tmp_path):
    model = _big_checkpoint(tmp_path)
    args = ["generate", "--model", str(model), "--tp", "2", "--dtype", "float32", "--prompt-ids", "1,2,3"]
    args += ["--max-new-tokens", "2", "--backend", "gloo"]
    refused = _run_in(cgroup, args, process_tag())
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and line.startswith("shardwise: error: not enough memory"), refused.stderr
    assert "cgroup v1 limit" in line or "cgroup v2 limit" in line, line  # the real limit, read from the cgroup
    tag = process_tag()
    killed = _run_in(cgroup, [*args, "--force"], tag)
    assert killed.returncode != 0
    assert "killed by the out-of-memory killer (cgroup oom_kill" in killed.stderr, killed.stderr[-2000:]
    assert "it needed about" in killed.stderr
    assert wait_gone(tag=tag) == [], "orphan rank processes remain"
