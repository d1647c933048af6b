"""Checkpoints on one process: the files written (JSON and safetensors only, never pickle),
the commit protocol (latest, pruning, no overwrite, stale temporaries), and a clear
CheckpointError naming the file or key for each kind of damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from shardwise.comm import LocalCommunicator
from shardwise.train import setup, train_step
from train_helpers import ROOT, TOKENIZER, tiny_config, write_tiny_tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tp=1 trainer after 2 steps, and its checkpoint root (steps 1 and 2 committed)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    tokens = write_tiny_tokens(tmp / "tokens.safetensors")
    cfg = tiny_config(tokens, tmp / "run", model={"tokenizer": str(TOKENIZER), "eos_token_id": 1})
    tr = setup(LocalCommunicator(), cfg)
    for _ in range(2):
        train_step(tr)
        save_checkpoint(tr, tmp / "ckpts", keep_last=5)
    return tr, tmp / "ckpts"


def _fresh(tr):
    return setup(LocalCommunicator(), tr.cfg)


def test_round_trip_restores_weights_optimizer_rng_and_history(saved):
    tr, root = saved
    other = _fresh(tr)
    load_checkpoint(other, str(root))
    assert other.step == 2 and other.history == tr.history
    for (name, a), b in zip(tr.model.named_parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tr.optimizer.state[a][key], other.optimizer.state[b][key])
    assert torch.equal(other.rng.state()["tp"], tr.rng.state()["tp"])
    assert train_step(other).loss == pytest.approx(train_step(_resumed_copy(tr, root)).loss, abs=0)


def _resumed_copy(tr, root):
    t = _fresh(tr)
    load_checkpoint(t, str(root))
    return t


def test_files_are_json_and_safetensors_only(saved):
    _, root = saved
    ckpt = CheckpointReader(root).dir
    assert (root / "latest").read_text().strip() == ckpt.name == "step-00000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "rank-00000.safetensors", "tokenizer.json"]
    for p in ckpt.iterdir():
        head = p.read_bytes()[:16]
        assert not head.startswith(b"\x80"), f"{p.name} looks like a pickle"
    m = json.loads((ckpt / "manifest.json").read_text())
    assert m["format"] == "shardwise-checkpoint" and m["format_version"] == 1 and m["step"] == 2
    entry = m["tensors"]["param/layers.0.attn.qkv.weight"]
    assert entry["global_shape"] == [128, 64] and entry["dim"] == 0 and entry["chunks"][0]["start"] == 0
    assert m["tensors"]["param/embed.weight"]["global_shape"] == [515, 64]  # unpadded
    assert set(m["files"]["rank-00000.safetensors"]) == {"bytes", "sha256"}
    assert m["optimizer"]["type"] == "AdamW" and m["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert m["rng"]["keys"] == ["rng/default", "rng/tp"] and m["extra"]["eos_token_id"] == 1


def test_no_pickle_in_the_training_and_checkpoint_code():
    for pkg in ("train", "checkpoint"):
        for path in (ROOT / "src" / "shardwise" / pkg).glob("*.py"):
            text = path.read_text()
            for banned in ("import pickle", "torch.save(", "torch.load(", "pickle.load"):
                assert banned not in text, f"{path.name} uses {banned}"


def test_commit_protocol(saved, tmp_path):
    tr, root = saved
    with pytest.raises(CheckpointError, match="already exists and is the latest checkpoint; it is never overwritten"):
        save_checkpoint(tr, root, keep_last=5)
    work = tmp_path / "ckpts"
    shutil.copytree(root, work)
    (work / ".tmp-step-00000003").mkdir()  # a save killed before its commit
    (work / ".tmp-step-00000003" / "rank-00000.safetensors").write_bytes(b"partial")
    assert CheckpointReader(work).dir.name == "step-00000002"
    # step 3 committed by a save killed before it moved `latest`: stale, so it is replaced
    shutil.copytree(work / "step-00000002", work / "step-00000003")
    tr.step = 3
    try:
        save_checkpoint(tr, work, keep_last=2)
    finally:
        tr.step = 2
    assert sorted(p.name for p in work.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert CheckpointReader(work).manifest.step == 3


def _damaged(root: Path, tmp_path: Path, how) -> Path:
    ckpt = tmp_path / "c"
    shutil.copytree(CheckpointReader(root).dir, ckpt)
    how(ckpt)
    return ckpt


def _edit_manifest(fn):
    def edit(ckpt: Path) -> None:
        m = json.loads((ckpt / "manifest.json").read_text())
        fn(m)
        (ckpt / "manifest.json").write_text(json.dumps(m))

    return edit


def _flip_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / "rank-00000.safetensors").read_bytes())
    data[-100] ^= 0xFF
    (ckpt / "rank-00000.safetensors").write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    f = ckpt / "rank-00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _rename_key(m: dict) -> None:
    m["tensors"]["param/norm.weight"]["chunks"][0]["key"] = "param/norm.weight@999"


def _unexpected(m: dict) -> None:
    m["tensors"]["param/extra.weight"] = m["tensors"]["param/norm.weight"]


DAMAGE = [
    (lambda c: (c / "rank-00000.safetensors").unlink(), r"rank-00000.safetensors: missing file of checkpoint step 2"),
    (_truncate, r"rank-00000.safetensors: truncated or altered: \d+ bytes, the manifest records \d+"),
    (_flip_byte, r"rank-00000.safetensors: SHA-256 mismatch: the file is corrupted"),
    (lambda c: (c / "manifest.json").write_text('{"format": '), r"manifest.json: corrupt manifest, not valid JSON"),
    (lambda c: (c / "manifest.json").unlink(), "is neither a checkpoint"),
    (_edit_manifest(lambda m: m["model"].update(hidden_size=128)), "different architecture: hidden_size=128 in the checkpoint, 64 expected"),
    (_edit_manifest(lambda m: m.update(format_version=99)), "format_version 99 is not supported"),
    (_edit_manifest(lambda m: m["tensors"].pop("exp_avg/layers.1.mlp.down.weight")), "missing tensor 'exp_avg/layers.1.mlp.down.weight'"),
    (_edit_manifest(_unexpected), "unexpected tensor 'param/extra.weight', not part of this model"),
    (_edit_manifest(_rename_key), r"rank-00000.safetensors: missing tensor 'param/norm.weight@999'"),
    (_edit_manifest(lambda m: m["tensors"]["param/embed.weight"]["chunks"][0].update(length=500)), r"param/embed.weight: chunks cover rows \[0, 500\) but the tensor has 515 rows"),
]  # fmt: skip


@pytest.mark.parametrize("how,message", DAMAGE, ids=[m[:40] for _, m in DAMAGE])
def test_damaged_checkpoints_raise_clear_errors(saved, tmp_path, how, message):
    tr, root = saved
    ckpt = _damaged(root, tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_fresh(tr), str(ckpt))


def test_latest_pointing_nowhere_is_an_error(saved, tmp_path):
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match="names 'step-00000009', which is not a committed checkpoint"):
        CheckpointReader(tmp_path)
