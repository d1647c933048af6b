"""tp x pp x dp training matches single-process training of the same model and data.

For each layout (tp x pp x dp = 1x2x1, 1x4x1, 2x2x1, 1x2x2, 2x2x2) one pooled job runs
its variants, each calling setup() again. At 1x2x1 and 1x4x1: gpipe and 1f1b at m = 1, p
and 2p+1 micro-batches, interleaved (virtual_stages=2) at m = p and 2p where the layers
allow (2p+1 is refused, naming the numbers), uneven layer splits, and tied embeddings
with each schedule. Where tp or dp is added: each schedule, each m, a split and tied
embeddings once. Each variant trains 3 steps and is compared with the same config
trained in this process (LocalCommunicator, tp=pp=dp=1, the same m):

- the loss and the logged gradient norm of every step (the norm counts tied copies and
  tp-replicated rows once);
- every parameter's first-step gradient (dp-averaged, tied copies summed, clipped: what
  optimizer.step sees), unsharded over tp and merged over the stages;
- every weight after the 3 steps; each rank holds exactly its stage's layers;
- tied embeddings: the first and last stage's copies are bitwise equal; dp replicas too;
- parameter bytes per rank: total decoder-layer bytes / (tp * pp), plus the embedding
  (first stage) or final norm and head (last stage) / tp, within what tp does not divide.

The MPI test runs a few variants under mpiexec, so the pipeline's sends and receives
go through MPI point-to-point.
"""

from __future__ import annotations

import math

import pytest
import torch

from cases.pipeline import train_case, train_many
from shardwise.comm import LocalCommunicator, ParallelDims
from shardwise.launch import launch
from shardwise.models.decoder import DecoderLM
from shardwise.models.meta import on_meta
from shardwise.train import ConfigError, TrainConfig
from train_helpers import tiny_config, write_tiny_tokens

STEPS = 3
MICRO = 2
"""Sequences per micro-batch on each dp rank: the global batch is dp * m * MICRO."""
LOSS_TOL = 1e-5
NORM_RTOL = 1e-5
GRAD_TOL = 1e-6  # the largest first-step gradient entry is about 0.07
PARAM_TOL = 1e-4
"""After 3 AdamW steps. A step moves each weight by about lr (1e-3 to 3e-3 here) whatever its
gradient's size, and a gradient near AdamW's eps (1e-8) turns rounding noise of 1e-10 (the
reduction order differs across tp and dp) into differences of about 1e-5; a wrong gradient
moves weights by lr."""

LAYERS = 4
"""Decoder layers: over pp=2 they split into 2 chunks per rank (interleaved)."""
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]
SPLITS = {2: (4, [3, 1]), 4: (5, [1, 1, 1, 2])}
"""pp -> (layers, an uneven pp_layers); 5 layers over pp=4 are also uneven by default ([2, 1, 1, 1])."""


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("tok") / "tokens.safetensors")


@pytest.fixture(scope="module")
def reference():
    """The single-process run of a config (cached: several layouts share one)."""
    cache: dict[str, dict] = {}

    def run(cfg: TrainConfig) -> dict:
        single = cfg.replace(
            parallel={"tp": 1, "pp": 1, "dp": 1, "schedule": "1f1b", "virtual_stages": 1, "pp_layers": None}
        )
        key = repr(single)
        if key not in cache:
            cache[key] = train_case(LocalCommunicator(), single)
        return cache[key]

    return run


def _cfg(tokens, out, tp, pp, dp, layers, schedule, m, *, v=1, split=None, tied=False) -> TrainConfig:
    return tiny_config(
        tokens,
        out,
        tp=tp,
        dp=dp,
        steps=STEPS,
        model={"num_layers": layers, "tie_embeddings": tied},
        data={"global_batch_size": dp * m * MICRO, "microbatches": m},
        parallel={"pp": pp, "schedule": schedule, "virtual_stages": v, "pp_layers": split},
    )


def _variants(tokens, out, tp, pp, dp) -> dict[str, TrainConfig]:
    """Where the pipeline alone varies (tp = dp = 1): every schedule at m = 1, p, 2p+1
    (interleaved: p and 2p), tied embeddings with each schedule, an uneven split (also
    tied). Where tp or dp is added: each schedule, m = 1, p, 2p+1, a split and tied once."""
    make = lambda *a, **k: _cfg(tokens, out, tp, pp, dp, *a, **k)  # noqa: E731
    p, (split_layers, split) = pp, SPLITS[pp]
    if tp > 1 or dp > 1:
        return {
            "gpipe m=1": make(LAYERS, "gpipe", 1),
            f"1f1b m={2 * p + 1} tied": make(LAYERS, "1f1b", 2 * p + 1, tied=True),
            f"interleaved m={p} tied": make(LAYERS, "interleaved", p, v=2, tied=True),
            f"interleaved m={2 * p}": make(LAYERS, "interleaved", 2 * p, v=2),
            f"1f1b m={p} split={split}": make(split_layers, "1f1b", p, split=split),
        }
    cases = {f"{s} m={m}": make(LAYERS, s, m) for s in ("gpipe", "1f1b") for m in (1, p, 2 * p + 1)}
    if 2 * p <= LAYERS:  # two chunks of at least one layer per rank
        cases |= {f"interleaved m={m}": make(LAYERS, "interleaved", m, v=2) for m in (p, 2 * p)}
        cases[f"interleaved m={p} tied"] = make(LAYERS, "interleaved", p, v=2, tied=True)
    cases[f"gpipe m={2 * p + 1} tied"] = make(LAYERS, "gpipe", 2 * p + 1, tied=True)
    cases[f"1f1b m={p} split={split}"] = make(split_layers, "1f1b", p, split=split)
    cases[f"1f1b m={2 * p + 1} split={split} tied"] = make(split_layers, "1f1b", 2 * p + 1, split=split, tied=True)
    if split_layers % p:
        cases[f"1f1b m={p} {split_layers} layers balanced"] = make(split_layers, "1f1b", p)
    return cases


def _close(got, want, tol, what):
    torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=lambda m: f"{what}: {m}")


def _param_bytes(cfg: TrainConfig, pp_rank: int) -> tuple[float, float]:
    """(expected, tolerance) parameter bytes of a rank of pp stage `pp_rank`, from the
    model's shapes: decoder-layer bytes / (tp * pp), plus the embedding on the first
    stage and the final norm and head (the tied embedding's copy) on the last, / tp.
    Tolerance: what tp does not divide, i.e. (1 - 1/tp) of the norm weights every tp rank
    holds whole, and the vocabulary's padding rows (padded to a multiple of tp)."""
    tp, pp, mc = cfg.parallel.tp, cfg.parallel.pp, cfg.model.model_config()
    with on_meta():
        model = DecoderLM(mc)
    size = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    layer_bytes = sum(v for n, v in size.items() if n.startswith("layers."))
    table = mc.vocab_size * mc.hidden_size * 4
    first, last = pp_rank == 0, pp_rank == pp - 1
    expected = layer_bytes / (tp * pp) + (first + last) * table / tp + last * size["norm.weight"] / tp
    norms = sum(v for n, v in size.items() if n.startswith("layers.0.") and n.endswith("norm.weight"))
    whole = norms * mc.num_layers / pp + last * size["norm.weight"]
    padding = (first + last) * (math.ceil(mc.vocab_size / tp) - mc.vocab_size / tp) * mc.hidden_size * 4
    return expected, whole * (1 - 1 / tp) + padding


def _check(results: list[dict], ref: dict, cfg: TrainConfig, what: str) -> None:
    par = cfg.parallel
    dims = ParallelDims(world_size=par.world_size, tp=par.tp, dp=par.dp, pp=par.pp)
    layout = cfg.check_stages(cfg.model.num_layers)
    tied = cfg.model.tie_embeddings
    for rank, r in enumerate(results):
        s = dims.coords(rank)["pp"]
        assert r["pp_rank"] == s and r["layers"] == layout.layers_of(s), (what, rank, r["layers"])
        _close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), LOSS_TOL, f"{what} losses, rank {rank}")
        assert r["norms"] == pytest.approx(ref["norms"], rel=NORM_RTOL), (what, rank, r["norms"], ref["norms"])
        assert r["tied_equal"] is (True if tied and s in (0, par.pp - 1) else None), (what, rank)
        assert r["replicas_equal"] is (True if par.dp > 1 else None), (what, rank)
        if len(set(layout.layers)) == 1:  # an even split: each rank holds num_layers / pp layers
            expected, tol = _param_bytes(cfg, s)
            assert abs(r["bytes"] - expected) <= tol, (what, rank, r["bytes"], expected, tol)
    # every stage boundary carries an activation and a gradient per micro-batch
    for d in range(par.dp):
        for t in range(par.tp):
            sends = sum(results[dims.rank_of(tp=t, dp=d, pp=s)]["sends"] for s in range(par.pp))
            assert sends == STEPS * 2 * cfg.data.microbatches * (layout.stages - 1), (what, sends)
    # merge the stages (tp rank 0, dp rank 0 of each); a tied embedding comes from both ends
    names: list[str] = []
    for s in range(par.pp):
        r = results[dims.rank_of(pp=s)]
        for name, full in r["state"].items():
            _close(full, ref["state"][name], PARAM_TOL, f"{what}: {name} after {STEPS} steps (stage {s})")
            _close(r["grads"][name], ref["grads"][name], GRAD_TOL, f"{what}: {name}'s gradient (stage {s})")
        names += r["state"]
    copies = ["embed.weight"] if tied else []
    assert sorted(names) == sorted(list(ref["state"]) + copies), (what, sorted(set(names) ^ set(ref["state"])))


def _refusals(tokens, out, tp, pp, dp) -> None:
    """Interleaved at m = 2p+1 (not a multiple of p), or with more chunks than layers: one line."""
    with pytest.raises(ConfigError, match=rf"\(m={2 * pp + 1}\) to be a multiple of pp={pp}; valid data.microbatches"):
        _cfg(tokens, out, tp, pp, dp, LAYERS, "interleaved", 2 * pp + 1, v=2)
    if 2 * pp > LAYERS:
        with pytest.raises(ConfigError, match=rf"= {2 * pp} stages is more than the model's {LAYERS} layers"):
            _cfg(tokens, out, tp, pp, dp, LAYERS, "interleaved", pp, v=2)


def _marks(tp: int, pp: int, dp: int) -> list:
    if (tp, pp, dp) == (1, 2, 1):  # make test-fast and make test-more; 2x2x1 covers the gate
        return [pytest.mark.smoke, pytest.mark.full]
    if tp * pp * dp > 4 or (tp, pp, dp) in ((1, 4, 1), (1, 2, 2)):  # 8 ranks on 2 cores; 1x4x1: 11 s here, 2x2x1
        return [pytest.mark.full]  # covers it; 1x2x2 (11 s): dp x pp runs in the full tier and in test_train_distopt
    return []


@pytest.mark.parametrize(
    "tp,pp,dp",
    [pytest.param(*k, marks=_marks(*k), id="x".join(map(str, k))) for k in LAYOUTS],
)
def test_pipeline_training_matches_single_process(rank_pool, tokens, reference, tmp_path, tp, pp, dp):
    _refusals(tokens, tmp_path, tp, pp, dp)
    variants = _variants(tokens, tmp_path, tp, pp, dp)
    results = rank_pool.run(train_many, tp * pp * dp, args=(list(variants.values()),))
    for i, (name, cfg) in enumerate(variants.items()):
        _check([r[i] for r in results], reference(cfg), cfg, f"{tp}x{pp}x{dp} {name}")


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
def test_pipeline_training_on_mpi_matches_single_process(tokens, reference, tmp_path):
    """One 4-rank job under mpiexec: 2x2x1 (1f1b tied, interleaved) and 1x4x1 (gpipe, and
    1f1b at m = 2p+1 through the three middle boundaries). Activations and gradients
    between stages travel by MPI send/recv on the pp communicator."""
    variants = {
        "2x2x1 1f1b m=5 tied": _cfg(tokens, tmp_path, 2, 2, 1, 4, "1f1b", 5, tied=True),
        "2x2x1 interleaved m=4": _cfg(tokens, tmp_path, 2, 2, 1, 4, "interleaved", 4, v=2),
        "1x4x1 gpipe m=4": _cfg(tokens, tmp_path, 1, 4, 1, 4, "gpipe", 4),
        "1x4x1 1f1b m=9 tied, 5 layers [2, 1, 1, 1]": _cfg(tokens, tmp_path, 1, 4, 1, 5, "1f1b", 9, tied=True),
    }
    results = launch(train_many, 4, args=(list(variants.values()),), backend="mpi", timeout_s=120)
    assert all(r[0]["backend"] == "mpi" for r in results)
    for i, (name, cfg) in enumerate(variants.items()):
        _check([r[i] for r in results], reference(cfg), cfg, f"mpi {name}")
