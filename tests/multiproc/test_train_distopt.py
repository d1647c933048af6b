"""The distributed optimizer (optim.distributed: master weights, AdamW moments and reduced
gradients split over dp) trains exactly as the plain optimizer: per-step losses, gradient
norms (clipping active at every step) and the unsharded weights after 3 steps, at
1x1x2, 1x1x3 (uneven slices), 2x1x2, 1x2x2, 1x1x4 and 2x2x2 (tp x pp x dp), with experts
over edp (Mixtral, ep=2 at dp=4), sequence parallelism with recomputation, and tied
embeddings across stages, on gloo (pooled) and MPI (2x1x2, 1x2x2, ep=2; full tier).

Checkpoints: saved with the distributed optimizer at dp=4, resumed at dp=3 with it (uneven
slices) and at dp=1 without it; saved at tp=2 x dp=2 with it, resumed at tp=1 x pp=2 x dp=2
(full tier); saved without it, resumed with it (full tier); every one continues as an
uninterrupted run.

bf16 weights (run.dtype = "bf16") keep an fp32 master: the model holds bf16, the state each
rank holds equals the bytes-per-parameter formula, the checkpoint stores the fp32 master, and
resumed in fp32 the losses stay within 2e-2 of an uninterrupted bf16 run's (full tier).
"""

from __future__ import annotations

import pytest
import torch

from cases.distopt import layouts_case, memory_case, merged_state, resumes_case
from shardwise.comm import LocalCommunicator
from train_helpers import TINY_MODEL, tiny_config, write_tiny_tokens

STEPS = 3
CLIP = 0.5  # below the tiny model's gradient norms: every step clips
SAME_TOL = 1e-6  # distributed against plain at the same layout (only the sums' order differs)
LOSS_TOL, PARAM_TOL = 2e-5, 1e-4  # against the single-process run (another layout)
MIXTRAL = {"num_experts": 4, "experts_per_token": 2, "expert_size": 48, "router_aux_loss_coef": 0.1}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


def _cfg(tokens, out, *, tp=1, pp=1, dp=1, ep=1, model=None, batch=8, **sections):
    """Clipping on; 4 layers (so pp=2 splits them); one micro-step per dp rank for MoE."""
    micro = batch // dp if model else 2 if batch % (2 * dp) == 0 else 1
    return tiny_config(
        tokens,
        out,
        tp=tp,
        dp=dp,
        steps=STEPS,
        model={**TINY_MODEL, "num_layers": 4, **(model or {})},
        data={"global_batch_size": batch, "micro_batch_size": micro},
        optim={"grad_clip": CLIP, **sections.pop("optim", {})},
        parallel={"pp": pp, "ep": ep, "bucket_mb": 0.05, **sections.pop("parallel", {})},  # several buckets
        **sections,
    )


def _both(cfg):
    return [cfg, cfg.replace(optim={"distributed": True})]


def _assert_same(got: dict, want: dict, what: str, tol: float = SAME_TOL) -> None:
    close = lambda a, b, m: torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda e: f"{what} {m}: {e}")  # noqa: E731
    close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), "losses")
    close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), "grad norms")
    assert set(got["state"]) == set(want["state"]), what
    for name, w in want["state"].items():
        close(got["state"][name], w, name)


def _check_layouts(results: list[list[dict]], layouts: list[str], tol: float = SAME_TOL) -> None:
    """results: per rank, [plain, distributed] per layout."""
    for i, what in enumerate(layouts):
        plain = {**results[0][2 * i], "state": merged_state([r[2 * i] for r in results])}
        dist = {**results[0][2 * i + 1], "state": merged_state([r[2 * i + 1] for r in results])}
        _assert_same(dist, plain, f"{what}: distributed vs plain", tol)
        for r in results:  # every rank reports the same losses
            assert r[2 * i + 1]["losses"] == dist["losses"], what


def test_distributed_optimizer_matches_plain_tp2_dp2_and_pp2_dp2(rank_pool, tokens, tmp_path):
    cfgs = [_cfg(tokens, tmp_path, tp=2, dp=2), _cfg(tokens, tmp_path, pp=2, dp=2)]
    r4 = rank_pool.run(layouts_case, 4, args=([c for cfg in cfgs for c in _both(cfg)],))
    _check_layouts(r4, ["2x1x2", "1x2x2"])
    # each rank holds its 1/dp share of the moments of its (tp, pp) position
    for i in (0, 2):
        assert [r[i + 1]["held"]["moments"] * 2 for r in r4] == [r[i]["held"]["moments"] for r in r4]


@pytest.mark.full
def test_distributed_optimizer_matches_plain_dp2_dp4_and_one_process(rank_pool, tokens, tmp_path):
    r2 = rank_pool.run(layouts_case, 2, args=(_both(_cfg(tokens, tmp_path, dp=2)),))
    r4 = rank_pool.run(layouts_case, 4, args=(_both(_cfg(tokens, tmp_path, dp=4)),))
    _check_layouts(r2, ["1x1x2"])
    _check_layouts(r4, ["1x1x4"], tol=1e-5)  # 4 ranks: another summation order (see dp=3)
    ref = layouts_case(LocalCommunicator(), [_cfg(tokens, tmp_path)])[0]
    for results, what in ((r2, "1x1x2"), (r4, "1x1x4")):
        dist = {**results[0][1], "state": merged_state([r[1] for r in results])}
        _assert_same(dist, ref, f"{what} distributed vs one process", tol=PARAM_TOL)
    plain_moments = r2[0][0]["held"]["moments"]
    assert [r[1]["held"]["moments"] for r in r2] == [plain_moments // 2, plain_moments // 2]
    assert sum(r[1]["held"]["moments"] for r in r4) == plain_moments


@pytest.mark.full
def test_distributed_optimizer_uneven_dp3(rank_pool, tokens, tmp_path):
    """dp=3 splits the buckets unevenly (the first ranks one element more of each)."""
    cfg = _cfg(tokens, tmp_path, dp=3, batch=6)
    results = rank_pool.run(layouts_case, 3, args=(_both(cfg),))
    # NOTE: at dp=3 gloo's reduce-scatter sums the three ranks in another order than its
    # all-reduce: the gradients differ in the last bit, and AdamW's m / sqrt(v) turns that
    # into up to ~2e-6 on a weight whose gradient is near zero.
    _check_layouts(results, ["1x1x3"], tol=1e-5)
    held = [r[1]["held"]["moments"] // 8 for r in results]
    # every bucket deals its L elements 1/3 each, the first L % 3 ranks one more
    assert held == sorted(held, reverse=True) and held[0] - held[-1] <= 20 and held[0] > held[-1], held


@pytest.mark.full
def test_distributed_optimizer_with_experts_seqpar_recompute(rank_pool, tokens, tmp_path):
    """Mixtral with ep=2 at dp=4 (experts over edp=2); tp=2 x dp=2 with sequence
    parallelism, full recomputation and gradient accumulation (4 micro-steps); pp=2 x dp=2
    with tied embeddings."""
    moe = _cfg(tokens, tmp_path, dp=4, ep=2, model=MIXTRAL)
    seq = _cfg(tokens, tmp_path, tp=2, dp=2, parallel={"sequence_parallel": True}, run={"recompute": "full"}).replace(
        data={"micro_batch_size": 1}
    )
    tied = _cfg(tokens, tmp_path, pp=2, dp=2, model={"tie_embeddings": True}).replace(
        data={"micro_batch_size": 2}
    )  # the last stage's copy of the embedding: updated alike, counted once in the norm
    results = rank_pool.run(layouts_case, 4, args=(_both(moe) + _both(seq) + _both(tied),))
    _check_layouts(results, ["mixtral ep2 x dp4", "2x1x2 seqpar recompute", "1x2x2 tied embeddings"])


@pytest.mark.full
def test_distributed_optimizer_on_mpi(tokens, tmp_path):
    from test_train_equivalence import _mpi_available

    from shardwise.launch import launch

    if not _mpi_available():
        pytest.skip("needs mpi4py and mpiexec")
    cfgs = _both(_cfg(tokens, tmp_path, tp=2, dp=2)) + _both(_cfg(tokens, tmp_path, pp=2, dp=2))
    cfgs += _both(_cfg(tokens, tmp_path, dp=4, ep=2, model=MIXTRAL))
    _check_layouts(
        launch(layouts_case, 4, args=(cfgs,), backend="mpi"), ["2x1x2 mpi", "1x2x2 mpi", "mixtral ep2 x dp4 mpi"]
    )


def _run(tokens, out, layout: dict, distributed: bool, steps: int, resume=None):
    """12 sequences a step (dp = 1, 3 and 4 all divide it); (config, checkpoint root to save in)."""
    cfg = _cfg(tokens, out, batch=12, **layout).replace(
        optim={"distributed": distributed}, run={"steps": steps, "resume": resume}
    )
    return cfg, str(out / f"ckpt-{steps}")


def _check_resumes(ref: dict, runs: list[tuple[list[dict], str]]) -> None:
    """Each resumed run's losses (steps 3 and 4) and final weights equal the uninterrupted run's."""
    for results, what in runs:
        torch.testing.assert_close(
            torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"][2:]), rtol=0, atol=LOSS_TOL, msg=what
        )
        state = merged_state(results)
        assert set(state) == set(ref["state"]), what
        for name, w in ref["state"].items():
            torch.testing.assert_close(
                state[name], w, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
            )


def _reference(tokens, tmp_path) -> dict:
    return resumes_case(LocalCommunicator(), [_run(tokens, tmp_path / "ref", {}, False, 4)])[0]


@pytest.mark.full  # 10 s here: make test keeps the equivalence cases
def test_distributed_checkpoint_resumes_at_dp3_and_without_it(rank_pool, tokens, tmp_path):
    """Saved at step 2 with the distributed optimizer at dp=4, resumed to step 4 at dp=3 with
    it (uneven slices) and on one process without it: each equals an uninterrupted
    single-process run (losses of steps 3 and 4, the weights after them)."""
    a = tmp_path / "a"
    src = rank_pool.run(resumes_case, 4, args=([_run(tokens, a, {"dp": 4}, True, 2)],))[0][0]["checkpoint"]
    r3 = rank_pool.run(resumes_case, 3, args=([_run(tokens, a / "dp3", {"dp": 3}, True, 4, src)],))
    r1 = resumes_case(LocalCommunicator(), [_run(tokens, a / "one", {}, False, 4, src)])
    _check_resumes(
        _reference(tokens, tmp_path),
        [([r[0] for r in r3], "dp4 distributed -> dp3 distributed"), (r1, "dp4 distributed -> one process plain")],
    )


@pytest.mark.full
def test_distributed_checkpoint_resumes_across_tp_and_pp_and_from_plain(rank_pool, tokens, tmp_path):
    """tp=2 x dp=2 (distributed) -> tp=1 x pp=2 x dp=2 (distributed); dp=4 plain -> dp=4
    distributed: as above."""
    b, c = tmp_path / "b", tmp_path / "c"
    saves = [_run(tokens, b, {"tp": 2, "dp": 2}, True, 2), _run(tokens, c, {"dp": 4}, False, 2)]
    src = [r["checkpoint"] for r in rank_pool.run(resumes_case, 4, args=(saves,))[0]]
    resumes = [
        _run(tokens, b / "pp2", {"pp": 2, "dp": 2}, True, 4, src[0]),
        _run(tokens, c / "on", {"dp": 4}, True, 4, src[1]),
    ]
    r4 = rank_pool.run(resumes_case, 4, args=(resumes,))
    _check_resumes(
        _reference(tokens, tmp_path),
        [
            ([r[0] for r in r4], "tp2xdp2 distributed -> pp2xdp2 distributed"),
            ([r[1] for r in r4], "dp4 plain -> dp4 distributed"),
        ],
    )


def _assert_formula(r: dict, what: str) -> None:
    """The bytes held equal the formula's, to the elements uneven splits add (16 bytes per bucket);
    each part too."""
    total = sum(r["held"].values())
    want = r["formula"]["total"] * r["params"]
    slack = 16 * (r["params"] // 10_000 + 2)
    assert abs(total - want) <= slack, (
        f"{what}: held {r['held']} = {total} bytes, formula {r['formula']} x {r['params']} = {want}"
    )
    for k in ("weights", "grads", "optimizer"):
        assert abs(r["held"][k] - r["formula"][k] * r["params"]) <= slack, (what, k, r["held"], r["formula"])


def _memory_cases(world, cfgs):
    return [memory_case(world, cfg) for cfg in cfgs]


def _assert_planner(r: dict, cfg, what: str) -> None:
    """The planner's weights + gradients + optimizer state for this rank's layout (footprint.
    state_bytes, what `plan --train` and the memory pre-check add up) within 10% of the bytes
    the rank measured holding."""
    from shardwise.planner.footprint import state_bytes
    from shardwise.train import model_config

    par = cfg.parallel
    planned = sum(
        state_bytes(model_config(cfg), par.tp, width=2 if cfg.run.dtype == "bf16" else 4, dp=par.dp,
                    distributed_optimizer=cfg.optim.distributed)
    )  # fmt: skip
    held = sum(r["held"].values())
    assert abs(planned / held - 1) <= 0.10, f"{what}: planner {planned:.0f} bytes, measured {held} ({r['held']})"


def test_bf16_weights_with_fp32_master_and_memory_formula(rank_pool, tokens, tmp_path):
    """tp=2 x dp=2: bf16 weights with the distributed optimizer, and fp32 with it: the model
    holds bf16, and the state each rank holds (from its tensors, at the end of backward and
    after the dp reduction, the larger) equals the formula; fp32 weights are views of the
    optimizer's flat buffer (no separate master)."""
    fp32 = _cfg(tokens, tmp_path, tp=2, dp=2, optim={"distributed": True})
    bf16 = fp32.replace(run={"dtype": "bf16"})
    out = rank_pool.run(_memory_cases, 4, args=([fp32, bf16],))
    for r in out:
        _assert_formula(r[0], "fp32 distributed")
        _assert_formula(r[1], "bf16 distributed")
        _assert_planner(r[0], fp32, "fp32 distributed tp2 x dp2")
        _assert_planner(r[1], bf16, "bf16 distributed tp2 x dp2")
        assert r[1]["dtypes"] == ["torch.bfloat16"] and r[0]["dtypes"] == ["torch.float32"]
    assert out[0][1]["formula"]["total"] == 2 + 2 + 12 / 2  # bf16 weights, fp32 master and moments over dp
    assert out[0][0]["formula"]["total"] == 8 + 8 / 2  # fp32: the weights are the master (Megatron's 8 + 8/dp)
    assert all(r[0]["weights_are_views"] and not r[1]["weights_are_views"] for r in out)


@pytest.mark.full
def test_memory_formula_at_dp_1_2_4(rank_pool, tokens, tmp_path):
    for dp in (1, 2, 4):
        for dtype in ("fp32", "bf16"):
            for distributed in (False, True):
                cfg = _cfg(tokens, tmp_path, dp=dp, optim={"distributed": distributed}).replace(run={"dtype": dtype})
                results = (
                    rank_pool.run(_memory_cases, dp, args=([cfg],))
                    if dp > 1
                    else [_memory_cases(LocalCommunicator(), [cfg])]
                )
                for r in results:
                    _assert_formula(r[0], f"dp={dp} {dtype} distributed={distributed}")
                    _assert_planner(r[0], cfg, f"dp={dp} {dtype} distributed={distributed}")


@pytest.mark.full
def test_bf16_checkpoint_stores_the_fp32_master_and_resumes_in_fp32(rank_pool, tokens, tmp_path):
    """bf16 weights, distributed at dp=2: the checkpoint's weights are the fp32 master (not
    the bf16 copy); resumed in fp32 at one process (plain), the losses stay within 2e-2 of
    an uninterrupted bf16 run's."""
    import json

    first, root = _run(tokens, tmp_path / "bf", {"dp": 2}, True, 2)
    first = first.replace(run={"dtype": "bf16"})
    saved = rank_pool.run(resumes_case, 2, args=([(first, root)],))[0][0]
    manifest = json.loads((__import__("pathlib").Path(saved["checkpoint"]) / "manifest.json").read_text())
    dtypes = {k: v["dtype"] for k, v in manifest["tensors"].items() if k.startswith("param/")}
    assert set(dtypes.values()) == {"float32"}, dtypes
    whole = rank_pool.run(resumes_case, 2, args=([(first.replace(run={"steps": 4}), str(tmp_path / "whole"))],))[0][0]
    later, _ = _run(tokens, tmp_path / "bf" / "fp32", {}, False, 4, saved["checkpoint"])
    resumed = resumes_case(LocalCommunicator(), [(later, str(tmp_path / "after"))])[0]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][2:]), rtol=0, atol=2e-2)


@pytest.mark.full
def test_distributed_optimizer_matches_plain_tp2_pp2_dp2(tokens, tmp_path):
    """2x2x2: eight ranks on one launched gloo job (slow on two cores)."""
    from shardwise.launch import launch

    cfg = _cfg(tokens, tmp_path, tp=2, pp=2, dp=2)
    _check_layouts(launch(layouts_case, 8, args=(_both(cfg),)), ["2x2x2"])


@pytest.mark.full
def test_distributed_checkpoint_with_experts_resumes_at_ep1(rank_pool, tokens, tmp_path):
    """Mixtral saved with the distributed optimizer at ep=2 x dp=4 (each expert's state split
    over its edp=2 ranks, the dense part over dp=4), resumed at ep=1 x dp=2 with it: equals
    an uninterrupted run."""
    moe = {"model": MIXTRAL}
    ref = resumes_case(LocalCommunicator(), [_run(tokens, tmp_path / "ref", dict(moe), False, 4)])[0]
    e = tmp_path / "e"
    src = rank_pool.run(resumes_case, 4, args=([_run(tokens, e, {"dp": 4, "ep": 2, **moe}, True, 2)],))[0][0]
    resumed = rank_pool.run(
        resumes_case, 2, args=([_run(tokens, e / "ep1", {"dp": 2, **moe}, True, 4, src["checkpoint"])],)
    )
    _check_resumes(ref, [([r[0] for r in resumed], "ep2 x dp4 distributed -> ep1 x dp2 distributed")])
