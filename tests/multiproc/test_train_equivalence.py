"""Training on a tp x dp mesh matches single-process training of the same model and data:
per-step losses within 2e-5 and final unsharded weights within 1e-4 after 10 steps; the
replicated parameters stay bitwise identical across tp ranks; both dp paths (DDP on the
dp process group, and the Communicator's bucketed all-reduce that MPI uses) agree; the
RNG streams follow the tp/dp rules; the gradient norm is the unsharded one."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.launch import launch
from shardwise.train import BucketedSync, DDPSync, full_state, setup, train_step
from train_helpers import tiny_config, write_tiny_tokens

STEPS = 10
LOSS_TOL = 2e-5
PARAM_TOL = 1e-4


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


def _run(world, cfg) -> dict:
    """Train cfg.run.steps steps; losses, the unsharded weights (rank 0) and replica checks."""
    tr = setup(world, cfg)
    losses = [train_step(tr).loss for _ in range(cfg.run.steps)]
    state = full_state(tr.model, tr.mesh.tp, tr.specs)
    identical = []
    for name, p in tr.model.named_parameters():
        if tr.specs[name][0].dim is None:  # replicated: compare every tp rank's copy bit for bit
            copies = tr.mesh.tp.all_gather(p.detach().reshape(1, -1), dim=0)
            identical.append((name, all(torch.equal(copies[0], c) for c in copies)))
    return {
        "losses": losses,
        "state": state if world.rank == 0 else None,
        "replicated_identical": identical,
        "sync": type(tr.sync).__name__,
    }


def _rng_streams(world, cfg) -> dict:
    """Dropout masks drawn on the default stream and on the tp fork, gathered over the world."""
    tr = setup(world, cfg)
    ones = torch.ones(64)
    replicated = torch.nn.functional.dropout(ones, p=0.5)  # e.g. on the residual stream
    with tr.rng.fork():
        sharded = torch.nn.functional.dropout(ones, p=0.5)  # e.g. on this rank's heads
    after = torch.nn.functional.dropout(ones, p=0.5)
    gather = lambda t: tr.mesh.world.all_gather(t.view(1, -1), dim=0)  # noqa: E731
    return {"replicated": gather(replicated), "sharded": gather(sharded), "after": gather(after)}


def _reference(cfg) -> dict:
    return _run(LocalCommunicator(), cfg.replace(parallel={"tp": 1, "dp": 1}))


def _assert_matches(got: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=LOSS_TOL, msg=lambda m: f"{what}: {m}"
    )
    for name, full in ref["state"].items():
        torch.testing.assert_close(
            got["state"][name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
    assert got["replicated_identical"] and all(ok for _, ok in got["replicated_identical"]), got


def test_tp2_dp2_ddp_and_bucketed_match_single_process(rank_pool, tokens, tmp_path):
    cfg = tiny_config(tokens, tmp_path, tp=2, dp=2, steps=STEPS)
    ref = _reference(cfg)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the tiny model should learn something in 10 steps"
    ddp = rank_pool.run(_run, 4, args=(cfg.replace(parallel={"dp_sync": "ddp"}),))
    bucketed = rank_pool.run(_run, 4, args=(cfg.replace(parallel={"dp_sync": "bucketed"}),))
    assert ddp[0]["sync"] == DDPSync.__name__ and bucketed[0]["sync"] == BucketedSync.__name__
    for results, what in ((ddp, "tp2 x dp2 ddp"), (bucketed, "tp2 x dp2 bucketed")):
        _assert_matches(results[0], ref, what)
        for r in results[1:]:  # every rank reports the same losses
            assert r["losses"] == results[0]["losses"]
            assert all(ok for _, ok in r["replicated_identical"])


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
        return True
    except (ImportError, RuntimeError):
        return False


@pytest.mark.full
@pytest.mark.skipif(not _mpi_available(), reason="needs mpi4py and mpiexec")
def test_dp2_on_mpi_uses_the_bucketed_all_reduce_and_matches(tokens, tmp_path):
    """On MPI there is no process group for DDP: dp_sync="auto" picks the Communicator's
    bucketed all-reduce (small buckets, so the gradients span several). 2 ranks: MPI ranks
    start without the forkserver, so each pays the full import."""
    cfg = tiny_config(tokens, tmp_path, tp=1, dp=2, steps=STEPS, parallel={"bucket_mb": 0.05})
    results = launch(_run, 2, args=(cfg,), backend="mpi")
    assert results[0]["sync"] == BucketedSync.__name__
    _assert_matches(results[0], _reference(cfg), "dp2 on mpi")


def test_tp2_dp1_with_grad_accumulation_matches_single_process(rank_pool, tokens, tmp_path):
    cfg = tiny_config(tokens, tmp_path, tp=2, dp=1, steps=STEPS)  # 4 micro-steps of 2 per step
    ref = _reference(cfg.replace(data={"micro_batch_size": 8}))  # reference: one micro-batch of 8
    _assert_matches(rank_pool.run(_run, 2, args=(cfg,))[0], ref, "tp2 x dp1")


def test_bf16_autocast_trains_close_to_fp32(rank_pool, tokens, tmp_path):
    cfg = tiny_config(tokens, tmp_path, tp=2, dp=1, steps=4)
    ref = _reference(cfg)
    got = rank_pool.run(_run, 2, args=(cfg.replace(run={"bf16": True}),))[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=3e-2)


def test_rng_streams_follow_tp_and_dp(rank_pool, tokens, tmp_path):
    """4 ranks = tp groups [0,1] [2,3]; dp groups [0,2] [1,3]."""
    got = rank_pool.run(_rng_streams, 4, args=(tiny_config(tokens, tmp_path, tp=2, dp=2),))[0]
    rep, shard, after = got["replicated"], got["sharded"], got["after"]
    assert torch.equal(rep[0], rep[1]) and torch.equal(rep[2], rep[3]), "same mask within a tp group"
    assert not torch.equal(rep[0], rep[2]), "different masks across dp replicas"
    masks = [shard[r] for r in range(4)]
    assert all(not torch.equal(masks[a], masks[b]) for a in range(4) for b in range(a + 1, 4)), "sharded: all differ"
    assert torch.equal(after[0], after[1]), "the fork leaves the replicated stream in step across tp"


def _grad_norm(world, cfg) -> dict:
    tr = setup(world, cfg)
    x, y = tr.data.batch(list(range(4)))
    from shardwise.layers import vocab_parallel_cross_entropy

    vocab_parallel_cross_entropy(tr.model(x), y, comm=tr.mesh.tp).mean().backward()
    norm = tr.grad_norm.norm().item()
    tr.grad_norm.clip_(norm / 2)
    return {"norm": norm, "clipped": tr.grad_norm.norm().item()}


def test_grad_norm_counts_replicated_rows_once(rank_pool, tokens, tmp_path):
    """tp=4 with 2 KV heads: each KV head lives on 2 ranks, norms on all 4; the norm is still
    the unsharded gradient's, and clipping scales it as torch's clip_grad_norm_ does."""
    cfg = tiny_config(tokens, tmp_path, tp=4)
    ref = _grad_norm(LocalCommunicator(), cfg.replace(parallel={"tp": 1}))
    for r in rank_pool.run(_grad_norm, 4, args=(cfg,)):
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert r["clipped"] == pytest.approx(ref["norm"] / 2, rel=1e-5)
