"""Checkpoints across device counts: train 10 steps at tp=2, save, resume at tp=1 and at
tp=4 (2 KV heads replicated on 2 ranks each, padded vocabulary), train 10 more, and match
an uninterrupted run; resume at the uneven tp=3 (query heads 2/1/1, KV head 1 on two ranks)
for 5 steps, save, and finish at tp=2 from that checkpoint, matching too (weights and AdamW
state go even -> uneven -> even); the offline resharder's output loads the same, at tp=4 and 3; a damaged checkpoint
raises the same CheckpointError, naming the file, on every rank, with none left waiting."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardwise.checkpoint import Checkpointer, CheckpointError, load_checkpoint
from shardwise.checkpoint.offline import reshard_checkpoint
from shardwise.comm import LocalCommunicator
from shardwise.train import setup, train
from train_helpers import tiny_config, write_tiny_tokens

LOSS_TOL, PARAM_TOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def run(rank_pool, tmp_path_factory):
    """An uninterrupted 20-step reference, and a tp=2 run stopped and saved at step 10."""
    tmp = tmp_path_factory.mktemp("resume")
    tokens = write_tiny_tokens(tmp / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp / "ref", steps=20)
    ref = train(LocalCommunicator(), cfg, return_state=True)
    first = cfg.replace(parallel={"tp": 2}, run={"steps": 10, "out_dir": str(tmp / "tp2")})
    half = rank_pool.run(train, 2, args=(first, Checkpointer()))[0]
    return {"cfg": cfg, "ref": ref, "half": half, "tmp": tmp}


def _check_resumed(result, run, what: str) -> None:
    ref = run["ref"]
    assert [s for s, _ in result.history] == list(range(1, 21)), "history carries the first 10 steps over"
    torch.testing.assert_close(
        torch.tensor([loss for _, loss in result.history]),
        torch.tensor([loss for _, loss in ref.history]),
        rtol=0,
        atol=LOSS_TOL,
        msg=lambda m: f"{what} losses: {m}",
    )
    for name, full in ref.state.items():
        torch.testing.assert_close(
            result.state[name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def test_first_half_matches_the_reference(run):
    got = [loss for _, loss in run["half"].history]
    want = [loss for _, loss in run["ref"].history[:10]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOSS_TOL)
    assert run["half"].checkpoint.endswith("step-00000010")


def test_resume_at_tp1_matches_uninterrupted_run(run):
    cfg = run["cfg"].replace(run={"resume": run["half"].checkpoint, "out_dir": str(run["tmp"] / "tp1")})
    _check_resumed(train(LocalCommunicator(), cfg, Checkpointer(), return_state=True), run, "tp2 -> tp1")


def test_resume_at_tp4_matches_uninterrupted_run(rank_pool, run):
    """tp=4 with 2 KV heads: each KV head on 2 ranks; the tp=2 chunks are resharded on load."""
    cfg = run["cfg"].replace(
        parallel={"tp": 4}, run={"resume": run["half"].checkpoint, "out_dir": str(run["tmp"] / "tp4")}
    )
    _check_resumed(rank_pool.run(_train_with_state, 4, args=(cfg,))[0], run, "tp2 -> tp4")


def test_resume_at_uneven_tp3_and_back_to_tp2_matches_uninterrupted_run(rank_pool, run):
    """tp=2 -> tp=3 (steps 11-15) -> tp=2 (steps 16-20): the history and the final weights
    match the uninterrupted run, so the tp=3 leg read and wrote every shard and AdamW moment."""
    tmp, cfg = run["tmp"], run["cfg"]
    uneven = cfg.replace(
        parallel={"tp": 3}, run={"steps": 15, "resume": run["half"].checkpoint, "out_dir": str(tmp / "tp3")}
    )
    mid = rank_pool.run(_train_with_state, 3, args=(uneven,))[0]
    assert mid.checkpoint.endswith("step-00000015")
    back = cfg.replace(parallel={"tp": 2}, run={"resume": mid.checkpoint, "out_dir": str(tmp / "tp3-tp2")})
    _check_resumed(rank_pool.run(_train_with_state, 2, args=(back,))[0], run, "tp2 -> tp3 -> tp2")


@pytest.mark.parametrize("tp", [4, 3])
def test_offline_reshard_loads_the_same_state(run, tp):
    resharded = run["tmp"] / f"tp{tp}-ckpt"
    stats = reshard_checkpoint(run["half"].checkpoint, resharded, tp=tp)
    assert (stats.tp_from, stats.tp_to, stats.tensors) == (2, tp, 45)
    assert stats.peak_chunk_bytes < stats.total_tensor_bytes / 8, "streams chunk by chunk"
    states = []
    for source in (run["half"].checkpoint, str(resharded)):
        tr = setup(LocalCommunicator(), run["cfg"])
        load_checkpoint(tr, source)
        states.append({n: (p.detach(), *tr.optimizer.state[p].values()) for n, p in tr.model.named_parameters()})
    for name, tensors in states[0].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, states[1][name], strict=True)), name


def _train_with_state(world, cfg):
    result = train(world, cfg, Checkpointer(), return_state=True)
    if world.rank:
        result.state = None  # rank 0's copy is enough
    return result


def _load_damaged(world, cfg, variants: list[str]) -> list[str]:
    tr = setup(world, cfg)
    messages = []
    for path in variants:
        try:
            load_checkpoint(tr, path)
            messages.append("loaded")
        except CheckpointError as e:
            messages.append(str(e))
    return messages


def test_damaged_checkpoint_fails_on_every_rank(rank_pool, run, tmp_path):
    """Each damage is seen by one rank only (each reads its own file); all ranks raise."""
    src = run["half"].checkpoint
    variants = []
    for name, damage in (("missing", "unlink"), ("corrupt", "flip")):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        f = dst / ("rank-00001.safetensors" if damage == "unlink" else "rank-00000.safetensors")
        if damage == "unlink":
            f.unlink()
        else:
            data = bytearray(f.read_bytes())
            data[-10] ^= 1
            f.write_bytes(bytes(data))
        variants.append(str(dst))
    variants.append(src)  # and a good one still loads afterwards: no rank was left behind
    cfg = run["cfg"].replace(parallel={"tp": 2})
    per_rank = rank_pool.run(_load_damaged, 2, args=(cfg, variants))
    for rank, (missing, corrupt, good) in enumerate(per_rank):
        assert "rank-00001.safetensors: missing file of checkpoint step 10" in missing, (rank, missing)
        assert "rank-00000.safetensors: SHA-256 mismatch" in corrupt, (rank, corrupt)
        assert good == "loaded"
    assert "[raised on rank 1" in per_rank[0][0] and "[raised on rank 0" in per_rank[1][1]
