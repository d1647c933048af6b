"""Mixture-of-experts training composes with pipeline parallelism: at pp=2 (1F1B, 2
micro-batches, the load-balancing loss on, clipping at every step) the per-step losses
(cross-entropy and aux parts), gradient norms, the unsharded weights after 3 steps and the
last step's gradients equal one process's on the same micro-batches (tests/cases/moe_pp.py).
The aux loss pools every MoE layer's statistics, on both stages: pipeline/runtime.py
carries the totals with the activations and gradients.

- pp=2 (tp=1, dp=1), world 2
- pp=2 x dp=2 with ep=2 (experts split over the dp ranks of each stage), world 4
- pp=2 interleaved (2 model chunks per rank, 4 layers), world 2
- tp=2 x pp=2 (tensor-parallel experts), world 4
- on MPI (one job): pp=2 x dp=2 with ep=2
"""

from __future__ import annotations

import json

import pytest
import torch

from cases.moe_pp import moe_pp_case
from shardwise.comm import LocalCommunicator
from shardwise.launch import launch
from train_helpers import TINY_MODEL, tiny_config, write_tiny_tokens

STEPS, M = 3, 2
# NOTE: gradients are compared relative to the largest; expert dispatch reorders fp32 sums
# (2e-5 of the largest seen at pp=2 x dp=2 x ep=2 on an AMD EPYC, 7e-6 elsewhere).
LOSS_TOL, PARAM_TOL, GRAD_TOL = 2e-5, 1e-4, 5e-5
CLIP = 0.5
MIXTRAL = {"num_experts": 4, "experts_per_token": 2, "expert_size": 48, "router_aux_loss_coef": 0.1}

# name: (dp, ep, schedule, virtual stages, layers)
CASES = {
    "pp2": (1, 1, "1f1b", 1, 2),
    "pp2-dp2-ep2": (2, 2, "1f1b", 1, 2),
    "pp2-interleaved-v2": (1, 1, "interleaved", 2, 4),  # 4 virtual stages, 2 on each rank
}
TP_CASE = (2, 1, 1, "1f1b", 1, 2)  # tp=2 x pp=2: tensor-parallel experts, world 4


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


def _config(tokens, out, dp: int, ep: int, pp: int, schedule: str = "1f1b", v: int = 1, layers: int = 2, tp: int = 1):
    return tiny_config(
        tokens,
        out,
        tp=tp,
        dp=dp,
        steps=STEPS,
        model={**TINY_MODEL, **MIXTRAL, "num_layers": layers},
        data={"global_batch_size": 8, "micro_batch_size": 8 // (dp * M)},
        optim={"grad_clip": CLIP},
        parallel={"ep": ep, "pp": pp, "schedule": schedule, "virtual_stages": v},
    )


_REFS: dict[str, dict] = {}


def _reference(tokens, out, dp: int, layers: int = 2) -> dict:
    key = json.dumps([dp, layers])
    if key not in _REFS:
        cfg = _config(tokens, out, 1, 1, 1, layers=layers).replace(data={"micro_batch_size": 8 // M})
        _REFS[key] = moe_pp_case(LocalCommunicator(), cfg, (dp, M))
    return _REFS[key]


@pytest.mark.parametrize("case", list(CASES))
def test_moe_pipeline_training_matches_one_process(rank_pool, tokens, tmp_path, case):
    dp, ep, schedule, v, layers = CASES[case]
    cfg = _config(tokens, tmp_path, dp, ep, pp=2, schedule=schedule, v=v, layers=layers)
    ref = _reference(tokens, tmp_path, dp, layers)
    _assert_matches(rank_pool.run(moe_pp_case, 2 * dp, args=(cfg,)), ref, case)


def test_moe_pipeline_training_with_tensor_parallel_experts(rank_pool, tokens, tmp_path):
    tp, dp, ep, schedule, v, layers = TP_CASE
    cfg = _config(tokens, tmp_path, dp, ep, pp=2, schedule=schedule, v=v, layers=layers, tp=tp)
    _assert_matches(rank_pool.run(moe_pp_case, 4, args=(cfg,)), _reference(tokens, tmp_path, dp, layers), "tp2-pp2")


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
    except (ImportError, RuntimeError):
        return False
    return True


@pytest.mark.full
@pytest.mark.skipif(not _mpi_available(), reason="needs mpi4py and mpiexec")
def test_moe_pipeline_training_on_mpi(tokens, tmp_path):
    cfg = _config(tokens, tmp_path, 2, 2, pp=2).replace(parallel={"backend": "mpi"})
    results = launch(moe_pp_case, 4, args=(cfg,), backend="mpi", timeout_s=240)
    _assert_matches(results, _reference(tokens, tmp_path, 2), "mpi pp2-dp2-ep2")


def _assert_matches(results: list[dict], ref: dict, case: str) -> None:
    assert min(ref["norms"]) > CLIP, f"every step should clip: norms {ref['norms']}"
    assert all(a is not None and a > 0 for a in ref["aux"]), "the load-balancing loss is on"
    assert {r["pp_rank"] for r in results} == {0, 1}
    for r in results:
        for key in ("losses", "ce", "aux"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ref[key]), rtol=0, atol=LOSS_TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    state, grads = {}, {}
    for r in results:
        if r["state"] is not None:
            state.update(r["state"])
            grads.update(r["grads"])
    assert state.keys() == ref["state"].keys() and grads.keys() == ref["grads"].keys()
    for name, full in ref["state"].items():
        torch.testing.assert_close(state[name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}")
    scale = max(g.abs().max().item() for g in ref["grads"].values())
    routers = [n for n in ref["grads"] if n.endswith("mlp.gate.weight") or ".gate.weight" in n]
    assert routers, "the routers have gradients"
    for name, g in ref["grads"].items():
        err = (grads[name] - g).abs().max().item()
        assert err <= GRAD_TOL * scale, f"{case} gradient {name}: error {err:.2e} (largest gradient {scale:.2e})"
