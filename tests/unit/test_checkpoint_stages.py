"""Checkpoints and pipeline stages on one process: a manifest from before pipelines still
loads (as pp = 1, RNG restored), the offline resharder lays a checkpoint out for tp x pp x dp
(files per stage, the tied copy written once) and what it writes loads and exports exactly
as the source does; `checkpoint info` shows the split; bad splits fail with one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from processes import run_cli_inline
from shardwise.checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from shardwise.checkpoint.export import export_hf
from shardwise.checkpoint.load import check_compatible
from shardwise.checkpoint.offline import reshard_checkpoint
from shardwise.comm import LocalCommunicator
from shardwise.layers import ShardError
from shardwise.train import rank_specs, setup, train_step
from train_helpers import tiny_config, write_tiny_tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-layer tied model (tp=1) after 2 steps, saved."""
    tmp = tmp_path_factory.mktemp("ckpt-pp")
    tokens = write_tiny_tokens(tmp / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp / "run", model={"num_layers": 4, "tie_embeddings": True})
    tr = setup(LocalCommunicator(), cfg)
    for _ in range(2):
        train_step(tr)
    return tr, save_checkpoint(tr, tmp / "ckpts"), tmp


def _state(tr) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: (p.detach(), *tr.optimizer.state[p].values()) for n, p in tr.model.named_parameters()}


def _loaded(tr, source) -> dict[str, tuple[torch.Tensor, ...]]:
    other = setup(LocalCommunicator(), tr.cfg)
    load_checkpoint(other, str(source))
    return _state(other)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensors in a.items():
        assert all(torch.equal(x, y) for x, y in zip(tensors, b[name], strict=True)), name


def test_manifest_records_pp_and_the_split(saved):
    _, ckpt, _ = saved
    raw = json.loads((ckpt / "manifest.json").read_text())
    assert raw["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert raw["pipeline"] == {"pp": 1, "virtual_stages": 1, "layers": [4]}
    assert list(raw)[:6] == ["format", "format_version", "step", "model", "plan", "layout"]


def test_a_manifest_from_before_pipelines_loads_as_pp1(saved, tmp_path):
    tr, ckpt, _ = saved
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    raw = json.loads((old / "manifest.json").read_text())
    raw["layout"] = {"tp": 1, "dp": 1}
    del raw["pipeline"]
    (old / "manifest.json").write_text(json.dumps(raw))
    reader = CheckpointReader(old)
    assert reader.manifest.layout == {"tp": 1, "pp": 1, "dp": 1} and reader.manifest.pipeline is None
    assert reader.manifest.stage_layout().layers == (4,)
    other = setup(LocalCommunicator(), tr.cfg)
    load_checkpoint(other, str(old))
    _assert_same(_state(other), _state(tr))
    assert torch.equal(other.rng.state()["tp"], tr.rng.state()["tp"]), "same layout: RNG restored, not re-seeded"


def test_reshard_to_pipeline_stages_writes_each_stage_and_loads_the_same(saved, tmp_path):
    tr, ckpt, _ = saved
    stats = reshard_checkpoint(ckpt, tmp_path / "pp", tp=2, pp=2, pp_layers=[3, 1])
    names = list(rank_specs(tr.model_cfg, 1, 0))
    assert (stats.tp_to, stats.pp_to, stats.files, stats.tensors) == (2, 2, 4, 3 * len(names))
    reader = CheckpointReader(tmp_path / "pp")
    m = reader.manifest
    assert m.layout == {"tp": 2, "pp": 2, "dp": 1} and m.pipeline == {"pp": 2, "virtual_stages": 1, "layers": [3, 1]}
    check_compatible(reader, tr.model_cfg, names)  # every tensor present, its rows covered exactly once
    files = {}  # parameter -> the files holding its chunks
    for tname, entry in m.tensors.items():
        files.setdefault(tname.split("/", 1)[1], set()).update(c.file for c in entry.chunks)
    # at dp = 1 world rank = pp_rank * tp + tp_rank: stage 0 writes files 0-1, stage 1 files 2-3
    last = {n for n, f in files.items() if f & {"rank-00002.safetensors", "rank-00003.safetensors"}}
    assert last == {n for n in names if n.startswith("layers.3.")} | {"norm.weight"}, (
        "the last stage writes layer 3 and the final norm; the tied embedding (its head's) is stage 0's"
    )
    assert files["embed.weight"] == {"rank-00000.safetensors", "rank-00001.safetensors"}
    _assert_same(_loaded(tr, tmp_path / "pp"), _state(tr))


def test_reshard_with_virtual_stages_and_back(saved, tmp_path):
    tr, ckpt, _ = saved
    reshard_checkpoint(ckpt, tmp_path / "v", tp=1, pp=2, virtual_stages=2)
    assert CheckpointReader(tmp_path / "v").manifest.pipeline == {"pp": 2, "virtual_stages": 2, "layers": [1, 1, 1, 1]}
    stats = reshard_checkpoint(tmp_path / "v", tmp_path / "back", tp=1)
    assert (stats.pp_from, stats.pp_to) == (2, 1)
    _assert_same(_loaded(tr, tmp_path / "back"), _state(tr))


def test_export_of_a_pipeline_checkpoint_equals_the_export_at_pp1(saved, tmp_path):
    _, ckpt, _ = saved
    reshard_checkpoint(ckpt, tmp_path / "pp", tp=2, pp=4)
    a, b = export_hf(ckpt, tmp_path / "hf1"), export_hf(tmp_path / "pp", tmp_path / "hf4")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((b / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(b / "model.safetensors")


BAD = [
    ({"tp": 1, "pp": 8}, "pp=8 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"),
    ({"tp": 1, "pp": 2, "pp_layers": [2, 1]}, r"pp_layers=\[2, 1\] adds up to 3 layers, but the model has 4"),
    ({"tp": 1, "pp": 2, "pp_layers": [4]}, r"pp_layers=\[4\] has 1 entries; pp=2 needs 2"),
    ({"tp": 5}, "tp=5 is more than the model.s num_attention_heads=4: .*valid tp sizes: 1-4"),
    ({"tp": 1, "dp": 0}, "dp must be a positive int, got 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_reshard_layouts_fail_before_writing(saved, tmp_path, kwargs, message):
    _, ckpt, _ = saved
    with pytest.raises((CheckpointError, ShardError), match=message) as e:
        reshard_checkpoint(ckpt, tmp_path / "x", **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x").exists() and not (tmp_path / ".tmp-x").exists()


def test_cli_info_shows_the_split_and_reshard_refuses_in_one_line(saved, tmp_path):
    _, ckpt, _ = saved
    out = run_cli_inline("checkpoint", "reshard", str(ckpt), str(tmp_path / "pp"), "--tp", "2", "--pp", "2")
    assert out.returncode == 0, out.stderr
    assert "-> " in out.stdout and "(tp=2 x pp=2)" in out.stdout and "stage 1: layers 2-3" in out.stdout
    out = run_cli_inline("checkpoint", "info", str(tmp_path / "pp"), "--verify")
    assert out.returncode == 0, out.stderr
    assert "step 2, saved at tp=2 x pp=2 x dp=1" in out.stdout
    assert "pipeline: pp=2, layers per stage [2, 2]; stage 0: layers 0-1 + embed; stage 1: layers 2-3" in out.stdout
    info = json.loads(run_cli_inline("checkpoint", "info", str(tmp_path / "pp"), "--json").stdout)
    assert info["layout"] == {"tp": 2, "pp": 2, "dp": 1} and info["pipeline"]["layers"] == [2, 2]
    for extra, message in ((["--pp", "5"], "pp=5 is more than the model's 4 layers"),
                           (["--pp", "2", "--pp-layers", "1,1"], "pp_layers=[1, 1] adds up to 2 layers")):  # fmt: skip
        out = run_cli_inline("checkpoint", "reshard", str(ckpt), str(tmp_path / "bad"), "--tp", "1", *extra)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
