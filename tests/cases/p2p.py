"""Rank functions of the pipeline-mesh and point-to-point tests, fn(world, ...): the pp
groups of ParallelDims, send/recv along the pipeline and around the ring, the paired
exchange, the accounting, the p2p_check header, and a recv whose peer never sends. Each
raises on a mismatch; the gloo tests (through the rank pool) and the MPI test run them."""

from __future__ import annotations

import time

import torch

from shardwise.comm import P2PMismatchError, ParallelDims

__all__ = ["mesh_case", "p2p_case", "mismatch_case", "peer_never_sends"]

# (dtype, shape) of the messages: float and integer, half precision, a scalar, an empty tensor
MESSAGES = [
    (torch.float32, (2, 3)),
    (torch.bfloat16, (4, 5)),
    (torch.float16, (1, 2, 3)),
    (torch.int64, (7,)),
    (torch.bool, (3, 3)),
    (torch.float64, ()),
    (torch.float32, (0, 4)),
]


def _payload(dtype: torch.dtype, shape: tuple[int, ...], sender: int, salt: int) -> torch.Tensor:
    """A tensor that names its sender (a global rank) and the message (salt)."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.float64) + 1000 * sender + 100 * salt
    if dtype == torch.bool:
        return ((values.long() + sender + salt) % 2 == 0).view(shape)
    if dtype in (torch.bfloat16, torch.float16):
        values = values % 64 + sender + salt  # exact in half precision
    return values.to(dtype).view(shape)


def mesh_case(world, tp: int, pp: int) -> None:
    """Each rank's pp group holds the ranks with its tp and dp coordinates, in stage order."""
    dims = ParallelDims(world_size=world.size, tp=tp, pp=pp)
    mesh = dims.build(world)
    c = dims.coords(world.rank)
    assert (mesh.tp.size, mesh.dp.size, mesh.pp.size) == (tp, dims.dp, pp)
    assert (mesh.tp.rank, mesh.dp.rank, mesh.pp.rank, mesh.pp_rank) == (c["tp"], c["dp"], c["pp"], c["pp"])
    assert mesh.is_first_stage == (c["pp"] == 0) and mesh.is_last_stage == (c["pp"] == pp - 1)
    assert (mesh.prev_stage, mesh.next_stage) == ((c["pp"] - 1) % pp, (c["pp"] + 1) % pp)
    for comm, groups in ((mesh.tp, dims.tp_groups()), (mesh.dp, dims.dp_groups()), (mesh.pp, dims.pp_groups())):
        members = comm.all_gather(torch.tensor([world.rank]), dim=0).tolist()
        assert members in groups and world.rank in members, (comm.name, members, groups)
    assert mesh.pp.name == "pp"


def p2p_case(world, tp: int, pp: int, check: bool) -> dict:
    """Messages of every kind along the pipeline (forward and backward), around the ring,
    and exchanged between neighbours in both directions at once. Returns this rank's
    expected and counted send/recv accounting."""
    dims = ParallelDims(world_size=world.size, tp=tp, pp=pp)
    mesh = dims.build(world)
    comm, s = mesh.pp, mesh.pp_rank
    comm.p2p_check = check
    members = dims.pp_groups()[dims.coords(world.rank)["dp"] * tp + dims.coords(world.rank)["tp"]]
    sends = recvs = nbytes_out = nbytes_in = 0

    def nbytes(dtype, shape):
        return torch.empty(shape, dtype=dtype).nbytes

    with world.stats.track() as counted:
        # forward along the pipeline: stage s receives from s - 1, then sends on to s + 1
        for i, (dtype, shape) in enumerate(MESSAGES):
            if not mesh.is_first_stage:
                got = comm.recv(shape, dtype, mesh.prev_stage)
                assert got.dtype == dtype and got.shape == torch.Size(shape)
                assert torch.equal(got, _payload(dtype, shape, members[s - 1], i)), (s, i, got)
                recvs, nbytes_in = recvs + 1, nbytes_in + nbytes(dtype, shape)
            if not mesh.is_last_stage:
                comm.send(_payload(dtype, shape, world.rank, i), mesh.next_stage)
                sends, nbytes_out = sends + 1, nbytes_out + nbytes(dtype, shape)

        # backward: the last stage starts, gradients flow to stage 0
        shape = (3, 2)
        if not mesh.is_last_stage:
            got = comm.recv(shape, torch.float32, mesh.next_stage)
            assert torch.equal(got, _payload(torch.float32, shape, members[s + 1], 50))
            recvs, nbytes_in = recvs + 1, nbytes_in + 24
        if not mesh.is_first_stage:
            comm.send(_payload(torch.float32, shape, world.rank, 50), mesh.prev_stage)
            sends, nbytes_out = sends + 1, nbytes_out + 24

        # around the ring (pp = 2: both neighbours send to each other at once)
        for i, (dtype, shape) in enumerate(MESSAGES[:3]):
            got = comm.send_recv(
                _payload(dtype, shape, world.rank, 60 + i), mesh.next_stage, shape, dtype, mesh.prev_stage
            )
            assert torch.equal(got, _payload(dtype, shape, members[mesh.prev_stage], 60 + i))
            sends, recvs = sends + 1, recvs + 1
            nbytes_out, nbytes_in = nbytes_out + nbytes(dtype, shape), nbytes_in + nbytes(dtype, shape)

        # paired exchange between stages 2k and 2k + 1, a different shape each way
        # (activations forward, gradients of another shape backward)
        partner = s + 1 if s % 2 == 0 else s - 1
        if partner < pp:
            mine, theirs = ((2, 3), (5,)) if s % 2 == 0 else ((5,), (2, 3))
            got = comm.send_recv(_payload(torch.float32, mine, world.rank, 70), partner, theirs, torch.float32, partner)
            assert torch.equal(got, _payload(torch.float32, theirs, members[partner], 70))
            sends, recvs = sends + 1, recvs + 1
            nbytes_out += nbytes(torch.float32, mine)
            nbytes_in += nbytes(torch.float32, theirs)
    comm.p2p_check = False
    return {
        "expected": {"send": (sends, nbytes_out), "recv": (recvs, nbytes_in)},
        "counted": {op: (counted.calls(op, "pp"), counted.bytes(op, "pp")) for op in ("send", "recv")},
        "other_ops": sorted({f"{o}/{g}" for (o, g) in counted.counts if g == "pp" and o not in ("send", "recv")}),
    }


def mismatch_case(world) -> list[str]:
    """Under p2p_check, stage 0 sends float32 (2, 3) where stage 1 expects bfloat16 (2, 4):
    both raise P2PMismatchError; afterwards the two are still in step."""
    mesh = ParallelDims(world_size=world.size, pp=world.size).build(world)
    comm = mesh.pp
    comm.p2p_check = True
    errors = []
    try:
        if comm.rank == 0:
            comm.send(torch.zeros(2, 3), 1)
        elif comm.rank == 1:
            comm.recv((2, 4), torch.bfloat16, 0)
    except P2PMismatchError as e:
        errors.append(str(e))
    # nothing moved: the next, matching message arrives intact
    if comm.rank == 0:
        comm.send(torch.arange(4.0), 1)
    elif comm.rank == 1:
        assert torch.equal(comm.recv((4,), torch.float32, 0), torch.arange(4.0))
    comm.p2p_check = False
    return errors


def peer_never_sends(world) -> None:
    """Stage 0 receives from stage 1, which never sends (run by launch, with a short timeout)."""
    mesh = ParallelDims(world_size=world.size, pp=world.size).build(world)
    if mesh.pp_rank == 1:
        time.sleep(120)  # stuck outside any communication
    mesh.pp.recv((4,), torch.float32, 1)
