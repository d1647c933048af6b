"""Point-to-point without processes: peer checks, the dry-run accounting, the error texts."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import CollectiveError, LocalCommunicator
from shardwise.comm.communicator import _describe, _header
from shardwise.comm.dryrun import DryRunCommunicator


@pytest.mark.parametrize(
    "peer,match", [(2, r"peer rank 2 is outside group 'pp' of size 2"), (-1, "outside"), (0, "itself")]
)
def test_peers_are_checked(peer, match):
    comm = DryRunCommunicator(2, 0, name="pp")
    with pytest.raises(ValueError, match=match):
        comm.send(torch.ones(2), peer)
    with pytest.raises(ValueError, match=match):
        comm.recv((2,), torch.float32, peer)
    assert comm.stats.calls() == 0


def test_a_single_process_has_no_peer():
    with pytest.raises(ValueError, match=r"send: peer rank 1 is outside group 'pp' of size 1"):
        LocalCommunicator("pp").send(torch.ones(1), 1)


def test_dry_run_counts_point_to_point():
    comm = DryRunCommunicator(4, 1, name="pp")
    comm.send(torch.ones(2, 3, device="meta"), 2)
    got = comm.recv((5, 2), torch.bfloat16, 0, device="meta")
    assert got.shape == (5, 2) and got.dtype == torch.bfloat16 and got.is_meta
    got = comm.send_recv(torch.ones(3), 0, (3,), torch.float32, 0)
    assert torch.equal(got, torch.zeros(3))
    assert comm.stats.snapshot() == {
        "recv/pp": {"calls": 2, "bytes": 20 + 12},
        "send/pp": {"calls": 2, "bytes": 24 + 12},
    }


def test_header_round_trips_shape_and_dtype():
    assert _describe(_header(torch.Size([2, 3]), torch.bfloat16, torch.device("cpu"))) == "bfloat16 (2, 3)"
    assert _describe(_header(torch.Size([]), torch.float64, torch.device("cpu"))) == "float64 ()"
    assert _describe(_header(torch.Size([1]), torch.float8_e4m3fn, torch.device("cpu"))) == "another dtype (1,)"


def test_collective_error_names_the_peer():
    comm = DryRunCommunicator(2, 0, name="pp")
    err = CollectiveError("recv", comm, RuntimeError("timed out"), peer=1)
    assert str(err) == "recv from rank 1 on group 'pp' (rank 0 of 2, dry-run, timeout 60s) failed: timed out"
    assert (err.op, err.group, err.peer) == ("recv", "pp", 1)
    assert str(CollectiveError("all_reduce", comm, RuntimeError("x"))).startswith("all_reduce on group 'pp' (rank 0")
