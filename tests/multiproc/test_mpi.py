"""The same layer, block, model and engine parity checks as on gloo, on the MPI backend
(ranks under mpiexec), plus its failure semantics. MPI ranks take seconds to start, so
each world size runs all its checks in one job."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from cases.blocks import TINY, TINY3, block_case, tiny_lm_case
from cases.comm import all_to_all_never_arrives, collectives_case, regions_case, uneven_case
from cases.failure import one_rank_never_arrives, raise_on_rank
from cases.layers import linear_case, merged_case, qkv_case, vocab_case
from cases.p2p import mesh_case, mismatch_case, p2p_case, peer_never_sends
from hf_models import prompts, save_tiny
from processes import wait_gone
from shardwise.launch import RankFailedError, launch
from shardwise.models import ModelConfig

pytest.importorskip("mpi4py")
try:
    from shardwise.launch.mpi import find_mpiexec

    find_mpiexec()
except RuntimeError:
    pytest.skip("mpiexec not installed", allow_module_level=True)


def _release_splits(world) -> list[bool]:
    """close_splits frees every MPI communicator split so far (each case above split some);
    a split made afterwards works."""
    made = list(world._splits or [])
    world.close_splits()
    freed = [sub.comm == sub._MPI.COMM_NULL for sub in made]
    again = world.split([[r] for r in range(world.size)], name="again")
    return [bool(made), all(freed), again.all_reduce(torch.ones(1)).item() == 1.0, world._splits == [again]]


def _all_checks(world, hf_path: str | None) -> dict:
    ws = world.size
    done = []
    for dtype in ("fp32", "bf16"):
        for kind, gather in (("column", False), ("column", True), ("row", False)):
            linear_case(world, kind, dtype, gather)
        merged_case(world, dtype)
        vocab_case(world, 50, dtype)
        done += [f"linear/{dtype}", f"merged/{dtype}", f"vocab/{dtype}"]
    heads = [(12, 12), (12, 6), (9, 3)] if ws == 3 else [(8, 2), (4, 1), (12, 12), (14, 2)]
    for nh, nkv in heads:
        qkv_case(world, nh, nkv, "fp32", False)
        done.append(f"qkv/{nh}/{nkv}")
    regions_case(world)
    collectives_case(world, ws)
    uneven_case(world)
    done += ["regions", "collectives", "uneven"]
    counts = block_case(
        world, ModelConfig.debug(hidden_size=24, num_heads=12, num_kv_heads=12, intermediate_size=48), "block"
    )
    tiny_lm_case(world, TINY3 if ws == 3 else TINY, "fp32")
    done += ["block", "tiny_lm"]
    p2p = []
    for tp, pp in [(1, ws), (2, 2)] if ws == 4 else [(1, ws)]:
        mesh_case(world, tp, pp)
        p2p += [p2p_case(world, tp, pp, check) for check in (False, True)]
    done.append("p2p")
    out = {"done": done, "block_counts": counts, "backend": world.backend, "p2p": p2p}
    out["p2p_mismatch"] = mismatch_case(world)
    out["splits_released"] = _release_splits(world)
    if hf_path is not None:
        from helpers import tp_group
        from hf_models import greedy
        from shardwise.engine import generate
        from shardwise.hf import load_pretrained

        tp = tp_group(world)
        model, _ = load_pretrained(hf_path, comm=tp)
        ids, mask = prompts(model.cfg.vocab_size)
        with torch.no_grad():
            out["logits"] = model(ids, attention_mask=mask)
            out["greedy"] = greedy(lambda i, m, pos: model(i, attention_mask=m, positions=pos), ids, mask)
        lists = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        out["generated"] = generate(model, lists, comm=tp, max_new_tokens=16).tokens
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = save_tiny("llama3", tmp_path_factory.mktemp("mpi"))
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids, mask = prompts(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        gen = model.generate(
            ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return path, logits, gen[:, ids.shape[1] :].tolist(), mask


@pytest.mark.parametrize(
    "world_size", [2, pytest.param(3, marks=pytest.mark.full), pytest.param(4, marks=pytest.mark.full)]
)
def test_parity_on_mpi(world_size, llama):
    path, ref_logits, ref_gen, mask = llama
    hf_path = str(path)  # at 3 ranks: 8 query heads split 3/3/2, the 2 KV heads shared (uneven)
    results = launch(_all_checks, world_size, args=(hf_path,), backend="mpi", timeout_s=120)
    both = "point-to-point mismatch on group 'pp': rank 0 sends float32 (2, 3) to rank 1, which expects bfloat16 (2, 4)"
    for rank, r in enumerate(results):
        assert r["backend"] == "mpi"
        assert r["splits_released"] == [True, True, True, True], r["splits_released"]
        assert len(r["done"]) >= 10
        assert all(p["counted"] == p["expected"] and p["other_ops"] == [] for p in r["p2p"]), r["p2p"]
        assert len(r["p2p_mismatch"]) == (rank < 2) and all(both in e for e in r["p2p_mismatch"])
        assert r["block_counts"]["fwd"]["all_reduce/tp"]["calls"] == 2
        assert r["block_counts"]["bwd"]["all_reduce/tp"]["calls"] == 2
        if hf_path is not None:
            real = mask.bool()
            err = (r["logits"][real] - ref_logits[real]).abs().max().item()
            assert err <= 1e-4 * max(ref_logits[real].abs().max().item(), 1.0)
            assert r["generated"] == ref_gen


@pytest.mark.full  # `make test` has the same on MPI through the CLI (test_generate_cli, auto backend)
def test_mpi_raising_rank_takes_the_job_down():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(raise_on_rank, 3, args=(1,), backend="mpi", timeout_s=30)
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in str(info.value)
    assert time.monotonic() - start < 30
    assert wait_gone(pids=info.value.pids) == []


@pytest.mark.full
@pytest.mark.parametrize(
    "case,message,missed",
    [
        (
            one_rank_never_arrives,
            "CollectiveError: all_reduce on group 'world' (rank 0 of 2, mpi, timeout 2s) failed: MPI all_reduce timed out",
            "all_reduce/world #1",
        ),
        (
            peer_never_sends,
            "CollectiveError: recv from rank 1 on group 'pp' (rank 0 of 2, mpi, timeout 2s) failed: MPI recv timed out",
            "recv/pp #1",
        ),
        (
            all_to_all_never_arrives,
            "CollectiveError: all_to_all on group 'world' (rank 0 of 2, mpi, timeout 2s) failed: MPI all_to_all timed out",
            "all_to_all/world #1",
        ),
    ],
    ids=["collective", "recv", "all_to_all"],
)
def test_mpi_op_times_out_instead_of_hanging(case, message, missed):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(case, 2, backend="mpi", timeout_s=2)
    assert info.value.rank == 1, "the rank that never arrived, not the one that timed out"
    waited = rf"stuck: never arrived at {re.escape(missed)} \(rank 0 waited 2\.\d s for it\); running"
    assert re.match(waited, info.value.summary), info.value.summary
    assert message in str(info.value)
    assert time.monotonic() - start < 2 + 20
    assert wait_gone(pids=info.value.pids) == []


def _idle_wait_cpu(world) -> tuple[float, float]:
    """Rank 1 waits in a broadcast while rank 0 sleeps for 2 s: (CPU s, wall s) of the wait."""
    t = torch.zeros(4)
    if world.rank == 0:
        time.sleep(2.0)
    cpu, wall = time.process_time(), time.perf_counter()
    world.broadcast(t, src=0)
    return time.process_time() - cpu, time.perf_counter() - wall


@pytest.mark.full
def test_a_waiting_mpi_rank_does_not_occupy_a_core():
    # A rank waiting for a peer that is busy elsewhere (an idle server's follower) naps
    # between polls: a spinning rank would burn about 2 s of CPU here.
    results = launch(_idle_wait_cpu, 2, backend="mpi", timeout_s=30)
    cpu, wall = results[1]
    assert wall > 1.5, f"rank 1 waited only {wall:.2f} s"
    assert cpu < 0.5 * wall, f"a waiting MPI rank used {cpu:.2f} s of CPU in {wall:.2f} s"


def _peer_raises(world, out: str) -> None:
    """Rank 1 raises; rank 0, inside collectives, writes down what stopped it and when."""
    if world.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom on rank 1")
    start = time.monotonic()
    try:
        while time.monotonic() - start < 20:
            world.all_reduce(torch.ones(4))
    except Exception as e:
        Path(out).write_text(f"{time.monotonic() - start:.3f}\n{type(e).__name__}: {e}")
        raise


@pytest.mark.full
def test_mpi_survivors_fail_at_once_when_a_peer_raises(tmp_path):
    # The launcher tells the other ranks: their collectives fail with the peer's error
    # well before their own timeout (30 s here), e.g. so a server can answer 503.
    out = tmp_path / "rank0.txt"
    with pytest.raises(RankFailedError) as info:
        launch(_peer_raises, 2, args=(str(out),), backend="mpi", timeout_s=30)
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in str(info.value)
    elapsed, error = out.read_text().split("\n", 1)
    assert float(elapsed) < 10, f"rank 0 learnt of the failure after {elapsed} s"
    assert "CollectiveError" in error and "rank 1 failed: ValueError: boom on rank 1" in error
    assert wait_gone(pids=info.value.pids) == []
