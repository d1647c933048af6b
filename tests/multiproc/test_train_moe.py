"""Mixture-of-experts training with expert parallelism across dp ranks matches single-process
training of the same model and data: per-step losses (cross-entropy and the router's
load-balancing loss, both on), gradient norms (clipping active at every step), the unsharded
weights after 3 steps and every gradient of a fourth step (tests/cases/moe_train.py).

- a tiny Mixtral, 5 experts over ep=2 (3/2, uneven) at tp=1: world 2, dp=2
- a tiny Mixtral, 4 experts over ep=2, every expert's width split over tp=2: world 4
- a tiny Qwen2-MoE (shared expert with its gate), 4 experts over ep=2 at tp=2: world 4
- on MPI (one job, world 4): ep=2 at tp=2, and ep=2 at tp=1 x dp=4 (two replicas of each
  expert: expert gradients averaged over the edp group)

The layer alone (ExpertParallelMoE against MoE, outputs and gradients) at world sizes 1-4.
Tensor-parallel experts (ep=1) with the load-balancing loss over dp=2.

Checkpoints: saved at (tp=1, ep=2), resumed at (tp=2, ep=1), and the reverse, and saved at
tp=1 x dp=4 with ep=2 (two replicas, one writes), resumed at tp=2 x dp=2 with ep=2 (in make
test-more), with the optimizer state, equal an uninterrupted run. Each step has one
micro-step, so the load-balancing loss pools the same tokens as the single process's (see
train/step.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cases.moe_train import ep_layer_case, moe_resume_case, moe_train_case
from shardwise.comm import LocalCommunicator
from shardwise.launch import launch
from train_helpers import TINY_MODEL, tiny_config, write_tiny_tokens

STEPS = 3
LOSS_TOL, PARAM_TOL, GRAD_TOL = 2e-5, 1e-4, 1e-5
CLIP = 0.5  # below the tiny models' gradient norms: every step clips
MIXTRAL = {"num_experts": 4, "experts_per_token": 2, "expert_size": 48, "router_aux_loss_coef": 0.1}
QWEN2_MOE = MIXTRAL | {"shared_expert_size": 40, "norm_topk_prob": False}

# name: (tp, dp, ep, model overrides)
CASES = {
    "mixtral-uneven-ep2-tp1": (1, 2, 2, MIXTRAL | {"num_experts": 5}),
    "mixtral-ep2-tp2": (2, 2, 2, MIXTRAL),
    "qwen2moe-shared-ep2-tp2": (2, 2, 2, QWEN2_MOE),
    "mixtral-ep1-tp2-dp2": (2, 2, 1, MIXTRAL),  # tensor-parallel experts, the aux loss over dp
}
MPI_CASES = {"mixtral-ep2-tp2": (2, 2, 2, MIXTRAL), "mixtral-ep2-tp1-dp4": (1, 4, 2, MIXTRAL)}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


def _config(tokens, out, tp: int, dp: int, ep: int, model: dict, steps: int = STEPS):
    """8 sequences per step in one micro-step per dp rank."""
    return tiny_config(
        tokens,
        out,
        tp=tp,
        dp=dp,
        steps=steps,
        model={**TINY_MODEL, **model},
        data={"global_batch_size": 8, "micro_batch_size": 8 // dp},
        optim={"grad_clip": CLIP},
        parallel={"ep": ep},
    )


_REFS: dict[str, dict] = {}


def _reference(cfg) -> dict:
    key = json.dumps(cfg.model.__dict__, sort_keys=True)
    if key not in _REFS:
        single = cfg.replace(parallel={"tp": 1, "dp": 1, "ep": 1}, data={"micro_batch_size": 8})
        _REFS[key] = moe_train_case(LocalCommunicator(), single)
    return _REFS[key]


def _assert_matches(got: dict, ref: dict, cfg, what: str) -> None:
    assert min(ref["norms"]) > CLIP, f"every step should clip: norms {ref['norms']}"
    assert all(a is not None and a > 0 for a in ref["aux"]), "the load-balancing loss is on"
    close = dict(rtol=0, atol=LOSS_TOL, msg=lambda m: f"{what}: {m}")
    for key in ("losses", "ce", "aux"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), **close)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), what
    for name, full in ref["state"].items():
        torch.testing.assert_close(
            got["state"][name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
    scale = max(g.abs().max().item() for g in ref["grads"].values())
    experts = [n for n in ref["grads"] if ".experts." in n]
    assert experts and all(ref["grads"][n].abs().max() > 1e-3 * scale for n in experts), "the experts learn"
    for name, g in ref["grads"].items():
        err = (got["grads"][name] - g).abs().max().item()
        assert err <= GRAD_TOL * scale, f"{what} gradient {name}: error {err:.2e} (largest gradient {scale:.2e})"
    assert got["all_to_all"]["tp"] == got["all_to_all"]["dp"] == 0
    if cfg.parallel.ep == 1:
        assert got["all_to_all"]["ep"] == 0 and got["sync"] == "BucketedSync"
        return
    assert got["moe_layers"] == ref["moe_layers"] > 0
    assert got["all_to_all"]["ep"] == 6 * got["moe_layers"], (
        "4 all_to_alls forward and 2 backward per MoE layer, over ep"
    )
    assert got["sync"] == "ExpertParallelSync"


# world size: (tp, num_experts, shared expert); ep = world / tp
LAYER_CASES = {1: (1, 4, False), 2: (1, 5, True), 3: (1, 5, False), 4: (2, 5, True)}


@pytest.mark.parametrize("world_size", list(LAYER_CASES))
def test_expert_parallel_layer_matches_moe(rank_pool, world_size):
    """The layer alone, outputs and gradients, batch 2, every rank different tokens; uneven
    experts at ep 2 and 3, widths split over tp at world 4."""
    tp, E, shared = LAYER_CASES[world_size]
    results = rank_pool.run(ep_layer_case, world_size, args=(tp, E, shared))
    ep = world_size // tp
    held = sorted({tuple(r["held"]) for r in results})
    assert sum(n for _, n in held) == E and len(held) == ep, held
    for r in results:
        for key in ("y", "x_grad", "up_grad", "down_grad", "router_grad"):
            assert r[key] <= 1e-5 * max(r["scale"], 1.0), (key, r)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_training_matches_one_process(rank_pool, tokens, tmp_path, case):
    tp, dp, ep, model = CASES[case]
    cfg = _config(tokens, tmp_path, tp, dp, ep, model)
    results = rank_pool.run(moe_train_case, tp * dp, args=(cfg,))
    _assert_matches(results[0], _reference(cfg), cfg, case)


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        from shardwise.launch.mpi import find_mpiexec

        find_mpiexec()
    except (ImportError, RuntimeError):
        return False
    return True


def _mpi_cases(world, cfgs: dict) -> dict:
    return {name: moe_train_case(world, cfg) for name, cfg in cfgs.items()}


@pytest.mark.full
@pytest.mark.skipif(not _mpi_available(), reason="needs mpi4py and mpiexec")
def test_expert_parallel_training_on_mpi(tokens, tmp_path):
    cfgs = {name: _config(tokens, tmp_path, tp, dp, ep, model) for name, (tp, dp, ep, model) in MPI_CASES.items()}
    cfgs = {name: cfg.replace(parallel={"backend": "mpi"}) for name, cfg in cfgs.items()}
    results = launch(_mpi_cases, 4, args=(cfgs,), backend="mpi", timeout_s=240)
    assert results[0][next(iter(cfgs))]["sync"] == "ExpertParallelSync"
    for name, cfg in cfgs.items():
        _assert_matches(results[0][name], _reference(cfg), cfg, f"mpi {name}")


@pytest.mark.parametrize(
    "first,second",
    [  # the world-4 resume in make test-more; the world-2 pair covers the gate
        ((1, 2, 2), (2, 1, 1)),
        ((2, 1, 1), (1, 2, 2)),
        pytest.param((1, 4, 2), (2, 2, 2), marks=pytest.mark.full),
    ],
    ids=["ep2-to-tp2", "tp2-to-ep2", "dp4-ep2-to-tp2-ep2"],
)
def test_checkpoint_between_tp_and_ep_resumes_exactly(rank_pool, tokens, tmp_path, first, second):
    model = MIXTRAL | {"num_experts": 5}
    steps = 4

    def at(layout, n, resume=None):
        tp, dp, ep = layout
        return _config(tokens, tmp_path / "run", tp, dp, ep, model, steps=n).replace(run={"resume": resume})

    ref = moe_resume_case(LocalCommunicator(), at((1, 1, 1), steps), str(tmp_path / "ref"))
    a = rank_pool.run(moe_resume_case, first[0] * first[1], args=(at(first, 2), str(tmp_path / "a")))[0]
    manifest = json.loads((Path(a["checkpoint"]) / "manifest.json").read_text())
    down = manifest["tensors"]["param/layers.0.mlp.experts.down"]
    if first[2] > 1:  # experts 0-2 and 3-4: rows of whole experts (hidden rows each)
        H = TINY_MODEL["hidden_size"]
        assert manifest["layout"]["ep"] == 2 and down["dim"] == 0
        assert [(c["start"], c["length"]) for c in down["chunks"]] == [(0, 3 * H), (3 * H, 2 * H)]
        assert "ep=2" in manifest["plan"]["layers.0.mlp"]
    world = second[0] * second[1]
    b = rank_pool.run(moe_resume_case, world, args=(at(second, steps, a["checkpoint"]), str(tmp_path / "b")))[0]
    torch.testing.assert_close(
        torch.tensor(a["losses"] + b["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=LOSS_TOL
    )
    for name, full in ref["state"].items():
        torch.testing.assert_close(
            b["state"][name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("family,tp", [("mixtral", 2), ("qwen2_moe", 1)])
def test_pretrained_moe_trains_with_ep_as_in_one_process(rank_pool, tmp_path, family, tp):
    """A Hugging Face checkpoint loads with tensor-parallel experts and is cut down to each ep
    rank's experts (ExpertParallelMoE.from_tensor_parallel); Qwen2-MoE has a dense layer."""
    from hf_models import TINY_MOE, save_tiny
    from shardwise.train import TrainConfig, write_token_file

    path = save_tiny(family, tmp_path, overrides={"router_aux_loss_coef": 0.1})
    vocab = TINY_MOE[family][2]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    tokens = write_token_file(
        tmp_path / "t.safetensors", torch.randint(0, vocab, (4000,), generator=g), vocab_size=vocab
    )

    def config(tp: int, dp: int, ep: int) -> TrainConfig:
        return TrainConfig.from_dict(
            {
                "model": {"pretrained": str(path)},
                "data": {"tokens": str(tokens), "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 8 // dp},
                "optim": {"lr": 3e-3, "grad_clip": CLIP},
                "parallel": {"tp": tp, "dp": dp, "ep": ep},
                "run": {"steps": STEPS, "progress": False, "plot": False, "out_dir": str(tmp_path / "run")},
            }
        )

    ref = moe_train_case(LocalCommunicator(), config(1, 1, 1))
    cfg = config(tp, 2, 2)
    got = rank_pool.run(moe_train_case, tp * 2, args=(cfg,))[0]
    _assert_matches(got, ref, cfg, f"pretrained {family}")
