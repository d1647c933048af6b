"""Checkpoints across pipeline stages: train a 4-layer model at tp=2 x pp=2 for 3 steps and
save; resume at 1x1x1, 4x1x1, 1x4x1, 1x2x2 and 2x2x1 itself (tp x pp x dp), train 3 more,
and match an uninterrupted single-process run's losses and final weights; the same with a
tied embedding (the last stage's copy loads stage 0's values and AdamW moments); and
export-hf of the pipeline checkpoint matches the export of the reference run's own
checkpoint at the same step. One saved checkpoint serves every resume, and the resumes at
world size 4 run in one case (in make test-more)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import Checkpointer, CheckpointReader
from shardwise.checkpoint.export import export_hf
from shardwise.checkpoint.load import check_compatible
from shardwise.comm import LocalCommunicator, ParallelDims
from shardwise.train import model_config, rank_specs, setup, train
from train_helpers import tiny_config, write_tiny_tokens

LOSS_TOL, PARAM_TOL = 2e-5, 1e-4
SAVE_AT, STEPS = 3, 6
RESUMES = [(4, 1, 1), (1, 4, 1), (1, 2, 2), (2, 2, 1)]
"""tp x pp x dp layouts resumed at world size 4 (1x1x1 runs in this process)."""


@pytest.fixture(scope="module")
def run(rank_pool, tmp_path_factory):
    """Uninterrupted references (saving at step 3), and 2x2x1 runs saved at step 3: untied and tied."""
    tmp = tmp_path_factory.mktemp("pp-resume")
    tokens = write_tiny_tokens(tmp / "tokens.safetensors")
    out = {"tmp": tmp}
    for tied in (False, True):
        cfg = tiny_config(tokens, tmp / f"ref-{tied}", steps=STEPS, model={"num_layers": 4, "tie_embeddings": tied})
        ref_cfg = cfg.replace(run={"save_every": SAVE_AT, "keep_last": 2})
        out[tied] = {"cfg": cfg, "ref": train(LocalCommunicator(), ref_cfg, Checkpointer(), return_state=True)}
    firsts = [
        out[tied]["cfg"].replace(parallel={"tp": 2, "pp": 2}, run={"steps": SAVE_AT, "out_dir": str(tmp / f"pp{tied}")})
        for tied in (False, True)
    ]
    for tied, half in zip((False, True), rank_pool.run(_train_each, 4, args=(firsts,))[0], strict=True):
        out[tied]["half"] = half
    return out


def _train_each(world, cfgs):
    return [train(world, cfg, Checkpointer()) for cfg in cfgs]


def _check(history, state, run, tied: bool, what: str) -> None:
    ref = run[tied]["ref"]
    assert [s for s, _ in history] == list(range(1, STEPS + 1)), f"{what}: history carries the first steps over"
    torch.testing.assert_close(
        torch.tensor([loss for _, loss in history]),
        torch.tensor([loss for _, loss in ref.history]),
        rtol=0,
        atol=LOSS_TOL,
        msg=lambda m: f"{what} losses: {m}",
    )
    assert state.keys() == ref.state.keys(), what
    for name, full in ref.state.items():
        torch.testing.assert_close(
            state[name], full, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def test_pipeline_checkpoint_holds_every_tensor_once(run):
    """Each (tp, pp) rank of dp replica 0 wrote its stage's rows; the manifest records the split."""
    for tied in (False, True):
        half = run[tied]["half"]
        torch.testing.assert_close(
            torch.tensor([loss for _, loss in half.history]),
            torch.tensor([loss for _, loss in run[tied]["ref"].history[:SAVE_AT]]),
            rtol=0,
            atol=LOSS_TOL,
        )
        reader = CheckpointReader(half.checkpoint)
        m = reader.manifest
        assert m.layout == {"tp": 2, "pp": 2, "dp": 1}
        assert m.pipeline == {"pp": 2, "virtual_stages": 1, "layers": [2, 2]}
        model_cfg = model_config(run[tied]["cfg"])
        names = list(rank_specs(model_cfg, 1, 0))
        check_compatible(reader, model_cfg, names)  # every tensor present, its rows covered exactly once
        reader.verify()
        embed_files = {c.file for c in m.tensors["param/embed.weight"].chunks}
        assert embed_files == {"rank-00000.safetensors", "rank-00001.safetensors"}, "stage 0 owns the tied weight"
        head_files = {c.file for c in m.tensors["param/norm.weight"].chunks}
        assert head_files == {"rank-00002.safetensors"}
        groups = [n for g in m.optimizer["param_groups"] for n in g["params"]]
        assert sorted(groups) == sorted(names)


def test_resume_at_1x1x1_matches_uninterrupted_run(run):
    for tied in (False, True):
        where = {
            "resume": run[tied]["half"].checkpoint,
            "out_dir": str(run["tmp"] / f"r1-{tied}"),
            "save_at_end": False,
        }
        cfg = run[tied]["cfg"].replace(run=where)
        result = train(LocalCommunicator(), cfg, Checkpointer(), return_state=True)
        _check(result.history, result.state, run, tied, f"2x2x1 -> 1x1x1 (tied={tied})")


def _resume_each(world, jobs):
    """Each (label, cfg) resumed and trained; from the tp = dp = 0 rank of each stage: history
    and that stage's unsharded weights. Then the tied copy right after loading (1x4x1)."""
    out = {}
    for label, cfg in jobs:
        par = cfg.parallel
        coords = ParallelDims(world.size, tp=par.tp, pp=par.pp, dp=par.dp).coords(world.rank)
        result = train(world, cfg, Checkpointer(), return_state=True)
        if coords["tp"] == 0 and coords["dp"] == 0:
            out[label] = (coords["pp"], result.history, result.state)
    tied_cfg = next(cfg for label, cfg in jobs if label.endswith("tied"))
    tr = setup(world, tied_cfg, checkpointer=Checkpointer())
    p = tr.model.embed.weight if tr.model.embed is not None else None
    out["copy"] = None if p is None else (tr.mesh.pp_rank, p.detach(), *tr.optimizer.state[p].values())
    return out


@pytest.mark.full  # make test-more; the gate keeps the resume at 1x1x1
def test_resume_at_other_layouts_matches_uninterrupted_run(rank_pool, run):
    """4x1x1, 1x4x1, 1x2x2 and 2x2x1 from the 2x2x1 checkpoint, and a tied model at 1x4x1: one case."""
    jobs = []
    for tied, layouts in ((False, RESUMES), (True, [(1, 4, 1)])):
        for tp, pp, dp in layouts:
            label = f"2x2x1 -> {tp}x{pp}x{dp}" + (" tied" if tied else "")
            where = {"resume": run[tied]["half"].checkpoint, "out_dir": str(run["tmp"] / label), "save_at_end": False}
            jobs.append((label, run[tied]["cfg"].replace(parallel={"tp": tp, "pp": pp, "dp": dp}, run=where)))
    per_rank = rank_pool.run(_resume_each, 4, args=(jobs,), timeout_s=170)
    for label, cfg in jobs:
        tied = label.endswith("tied")
        stages = sorted((got[label] for got in per_rank if label in got), key=lambda x: x[0])
        assert [stage for stage, *_ in stages] == list(range(cfg.parallel.pp))
        state = {}
        for _stage, _history, stage_state in stages:
            for name, tensor in stage_state.items():
                if name in state:  # the tied embedding's copy on the last stage: identical to stage 0's
                    assert torch.equal(state[name], tensor), f"{label}: the two copies of {name} differ"
                state[name] = tensor
        _check(stages[-1][1], state, run, tied, label)  # every stage reports the same losses
    copies = sorted(got["copy"] for got in per_rank if got["copy"] is not None)
    (first, *a), (last, *b) = copies[0], copies[-1]
    assert (first, last) == (0, 3) and len(a) == 4  # weight, step, exp_avg, exp_avg_sq
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "the tied copy loads stage 0's state exactly"


def test_export_of_the_pipeline_checkpoint_matches_the_reference(run, tmp_path):
    """export-hf reads the 2x2x1 checkpoint's stages; it matches the export of the reference
    run's step-3 checkpoint (saved at pp=1) within the runs' agreement, and transformers loads it."""
    for tied in (False, True):
        ref_ckpt = CheckpointReader(run["tmp"] / f"ref-{tied}" / "checkpoints" / f"step-{SAVE_AT:08d}")
        assert ref_ckpt.manifest.step == SAVE_AT and ref_ckpt.manifest.layout["pp"] == 1
        a = export_hf(run[tied]["half"].checkpoint, tmp_path / f"pp-{tied}")
        b = export_hf(ref_ckpt.dir, tmp_path / f"ref-{tied}")
        got, want = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert got.keys() == want.keys() and ("lm_head.weight" in got) != tied
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, n=name: n)
        assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 4
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pp-True").eval()
    assert torch.equal(model.model.embed_tokens.weight, got["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied in transformers too"
