"""planner.wire: which wire format the tp all-reduce carries, predicted per link; auto
stays fp32 on one host; training refuses compression in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardwise.comm import LocalCommunicator
from shardwise.planner.specs import Link
from shardwise.planner.wire import all_reduce_s, best_wire, choose_wire


def test_slow_links_compress_fast_ones_do_not():
    values = 4 * 576  # a decode step's all-reduce: batch 4 x SmolLM2's hidden 576
    slow = Link("100mbit", busbw_gbps=100e6 / 8 / 1e9, latency_us=100)
    fast = Link("loopback", busbw_gbps=2.0, latency_us=30)
    assert best_wire(slow, values, 2)[0] == "q8"
    assert best_wire(fast, values, 2)[0] == "fp32"
    # fp32's bytes over the slow link: n / busbw at p = 2, plus one latency
    assert all_reduce_s(slow, values, 2, "fp32") == pytest.approx(100e-6 + values * 4 / (100e6 / 8))


def test_auto_is_fp32_without_hosts_and_a_named_format_is_kept():
    one = LocalCommunicator("tp")
    assert choose_wire("auto", one, one, values=10) == "fp32"
    assert choose_wire("q8", one, one, values=10) == "q8"
    with pytest.raises(ValueError, match="--comm-dtype 'int4' is not one of auto, fp32, bf16, q8"):
        choose_wire("int4", one, one, values=10)


def test_train_refuses_a_compressed_wire_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--config", "none.toml", "--comm-dtype", "q8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("shardwise: error: --comm-dtype q8 is for inference")
