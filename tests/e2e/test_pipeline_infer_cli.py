"""`generate`, `verify`, `info` and `embed` with --pp, as a user runs them (default model, 4 layers)."""

from __future__ import annotations

import json

import pytest

from processes import run_cli, run_cli_inline


def test_generate_tp2_pp2_json_counts_point_to_point_and_matches_tp1():
    out = run_cli("generate", "--tp", "2", "--pp", "2", "--max-new-tokens", "8", "--compare-tp1", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["tp"], r["pp"], r["matches_tp1"]) == (2, 2, True)
    per_token = r["collectives_per_token"]
    assert per_token["send/pp"]["calls"] == 1 and per_token["recv/pp"]["calls"] == 1, per_token
    assert per_token["send/pp"]["bytes"] == per_token["recv/pp"]["bytes"] > 0
    by_stage = r["collectives_per_token_by_stage"]
    assert "send/pp" in by_stage[0] and "recv/pp" not in by_stage[0]
    assert "recv/pp" in by_stage[1] and "send/pp" not in by_stage[1]
    assert len(r["param_bytes_per_rank"]) == 4


def test_verify_pp2_passes_layer_by_layer():
    out = run_cli("verify", "--tp", "1", "--pp", "2", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["passed"] and r["pp"] == 2 and len(r["layers"]) == 4
    assert all(x["vs_unsharded"] is not None for x in r["layers"])


@pytest.mark.gate
def test_info_pp2_names_each_stage():
    out = run_cli_inline("info", "--tp", "2", "--pp", "2")
    assert out.returncode == 0, out.stderr
    assert "pipeline: 2 stages x tp=2 = 4 ranks" in out.stdout
    r = json.loads(run_cli_inline("info", "--tp", "2", "--pp", "2", "--json").stdout)
    stages = r["stages"]
    assert [s["layers"] for s in stages] == [[0, 1], [2, 3]]
    assert [(s["embedding"], s["head"]) for s in stages] == [(True, False), (False, True)]
    assert sum(s["bytes_per_rank"] for s in stages) == r["bytes_per_rank"]  # the stages split tp rank 0's part
    assert "send/pp" in stages[0]["decode_step"] and "recv/pp" in stages[1]["decode_step"]


@pytest.mark.gate
def test_bad_pp_refused_in_one_line_before_ranks_start():
    for cmd in ("generate", "verify", "info"):
        out = run_cli_inline(cmd, "--tp", "1", "--pp", "6")
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            "shardwise: error: pp=6 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"
        ], out.stderr
    out = run_cli_inline("embed", "--pp", "2", "--text", "hi")
    assert out.returncode == 2 and "embed's encoders (bert) run at --pp 1" in out.stderr
    out = run_cli_inline("generate", "--tp", "2", "--pp", "2", env={"RANK": "0", "WORLD_SIZE": "2"})
    assert out.returncode == 2
    assert "tp(2) * pp(2) = 4 but torchrun started 2 ranks" in out.stderr
