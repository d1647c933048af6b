"""`shardwise generate` at tp=2 with the shared-memory all-reduce on and off
(SHARDWISE_SHM_ALLREDUCE): the same tokens and the same collectives per token."""

from __future__ import annotations

import json

import pytest

from processes import run_cli

ARGS = ("generate", "--tp", "2", "--max-new-tokens", "12", "--ignore-eos", "--json", "--prompt", "Once upon a time")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_generate_gives_the_same_tokens_with_shm_on_and_off(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    runs = {}
    for mode in ("on", "off"):
        out = run_cli(*ARGS, "--backend", backend, env={"SHARDWISE_SHM_ALLREDUCE": mode})
        assert out.returncode == 0, out.stderr
        assert "keeps" not in out.stderr, out.stderr  # =on warns where it cannot be used
        runs[mode] = json.loads(out.stdout)
    assert runs["on"]["tokens"] == runs["off"]["tokens"] and len(runs["on"]["tokens"][0]) == 12
    assert runs["on"]["collectives_per_token"] == runs["off"]["collectives_per_token"]


def test_a_bad_mode_is_refused_naming_the_variable():
    out = run_cli(*ARGS, "--backend", "gloo", env={"SHARDWISE_SHM_ALLREDUCE": "fast"})
    assert out.returncode != 0
    assert "SHARDWISE_SHM_ALLREDUCE='fast' is not one of auto, on, off" in out.stderr
