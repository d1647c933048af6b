"""`shardwise verify` and `shardwise embed` as a user runs them: the real console script in a
subprocess, on tiny checkpoints that transformers wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hf_models import save_tiny
from processes import run_cli, run_cli_inline
from shardwise.launch.env import resolve_backend

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "tensor parallelism splits each layer across devices",
    "a cat sat on the mat",
]
TEXTS = ["the quick brown fox", "a cat sat on the mat by the dog", "tensor parallelism"]  # unequal lengths


def _json(out: subprocess.CompletedProcess) -> dict:
    assert out.stdout.count("\n") == 1, out.stdout + out.stderr  # one JSON object, one line
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama3 and gpt2 decoders, a llama3 with a NaN in layer 1, and a BERT with a tokenizer."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("ckpt")
    paths = {f: save_tiny(f, root) for f in ("llama3", "gpt2")}
    nan = shutil.copytree(paths["llama3"], root / "llama3_nan")
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    paths["llama3_nan"] = nan
    paths["bert"] = _save_bert(root / "bert")
    return paths


def _save_bert(path: Path) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    cfg = transformers.BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=48,
        intermediate_size=100,  # 8 heads and 100 at tp=3: split 3/3/2 heads, 36/32/32 columns
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # norms and biases start at 1 and 0; perturb them so they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def _reference_embeddings(path: Path, texts: list[str], normalize: bool) -> torch.Tensor:
    """transformers' BertModel, mean-pooled over the real tokens: (B, H)."""
    from tokenizers import Tokenizer

    rows = [e.ids for e in Tokenizer.from_file(str(path / "tokenizer.json")).encode_batch(texts)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])  # (B, T), right-padded
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # (B, T)
    model = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
    m = mask.unsqueeze(-1).float()  # (B, T, 1)
    mean = (hidden * m).sum(1) / m.sum(1)  # (B, H)
    return mean / mean.norm(dim=-1, keepdim=True) if normalize else mean


@pytest.mark.parametrize("family", ["llama3", "bert"])
def test_verify_json_passes_against_unsharded_and_transformers(ckpts, family):
    """At tp=3, which divides neither model's heads (llama3: 8 / 2 KV heads, bert: 8 heads)."""
    out = run_cli("verify", "--model", ckpts[family], "--tp", "3", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    r = _json(out)
    assert r["passed"] and r["first_diverging_layer"] is None
    assert r["tp"] == 3 and r["backend"] == resolve_backend("auto") and r["transformers_compared"] is True
    assert [x["layer"] for x in r["layers"]] == [0, 1]
    for x in [*r["layers"], r["final"]]:
        assert x["vs_unsharded"]["max_rel"] < 1e-5, x
    compared = [x for x in r["layers"] if x["vs_transformers"] is not None]
    # decoders: transformers' last hidden state has the final norm, so the last layer is not compared
    assert len(compared) == (2 if family == "bert" else 1)
    assert r["final"]["output"] == ("hidden" if family == "bert" else "logits")
    assert r["overall"]["vs_transformers"]["max_rel"] < 1e-5
    assert r["overall"]["vs_unsharded"]["max_abs"] >= max(x["vs_unsharded"]["max_abs"] for x in r["layers"])


def test_verify_human_output_table_and_pass_line(ckpts):
    out = run_cli("verify", "--model", ckpts["gpt2"], "--tp", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "sharded vs unsharded" in out.stdout and "sharded vs transformers" in out.stdout
    for name in ("layer 0", "layer 1", "logits", "overall"):
        assert any(line.startswith(name) for line in lines), name
    assert lines[-1].startswith("PASS: tp=2 matches within 0.0001")


def test_verify_zero_tolerance_fails_and_names_the_first_diverging_layer(ckpts):
    out = run_cli("verify", "--model", ckpts["llama3"], "--tp", "2", "--tolerance", "0", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    r = _json(out)
    assert r["passed"] is False and r["tolerance"] == 0.0
    over = [
        x["layer"]
        for x in r["layers"]
        if any(e is not None and e["max_rel"] > 0 for e in (x["vs_unsharded"], x["vs_transformers"]))
    ]
    assert over and r["first_diverging_layer"] == over[0]


def test_verify_corrupted_layer_is_the_first_diverging_one(ckpts):
    out = run_cli("verify", "--model", ckpts["llama3_nan"], "--tp", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "FAIL: tp=2 exceeds 0.0001 relative error; first diverging layer: 1"
    assert "non-finite" in out.stdout
    out = run_cli("verify", "--model", ckpts["llama3_nan"], "--tp", "2", "--json")
    r = _json(out)  # strict JSON: non-finite errors are null
    assert out.returncode == 1 and r["first_diverging_layer"] == 1 and r["passed"] is False
    assert r["layers"][0]["vs_unsharded"]["max_rel"] < 1e-5
    assert r["layers"][1]["vs_unsharded"]["max_rel"] is None


@pytest.mark.gate
def test_verify_refuses_a_tp_the_model_cannot_split(ckpts):
    out = run_cli_inline("verify", "--model", ckpts["llama3"], "--tp", "9")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr  # one line
    assert (
        "tp=9 is more than the model's num_attention_heads=8: every rank needs a query head; valid tp sizes: 1-8"
        in out.stderr
    )
    assert out.stdout == ""


@pytest.mark.parametrize("tp,normalize", [(1, False), (3, True)])  # tp=3: 8 heads split 3/3/2
def test_embed_json_matches_transformers_mean_pooled(ckpts, tp, normalize):
    out = run_cli(
        "embed", "--model", ckpts["bert"], "--tp", str(tp), *(["--normalize"] if normalize else []), "--json",
        *[a for t in TEXTS for a in ("--text", t)],
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    r = _json(out)
    assert r["tp"] == tp and r["dim"] == 48 and r["normalized"] is normalize
    assert r["backend"] == ("local" if tp == 1 else resolve_backend("auto"))
    emb = torch.tensor(r["embeddings"])  # (B, H)
    ref = _reference_embeddings(ckpts["bert"], TEXTS, normalize)
    assert emb.shape == ref.shape == (3, 48)
    assert (emb - ref).abs().max().item() <= 1e-4 * max(ref.abs().max().item(), 1.0)
    if normalize:
        torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3), atol=1e-5, rtol=0)


def test_embed_human_output_shows_values_and_cosines(ckpts):
    out = run_cli("embed", "--model", ckpts["bert"], "--tp", "1", "--text", TEXTS[0], "--text", TEXTS[1])
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2 + 2 and all("dim 48: [" in r for r in rows[:2])  # 2 embeddings, 2 cosine rows
    assert rows[0].count(",") == 8  # the first 8 values, then "..."
    assert "cosine similarity" in out.stdout and rows[2].split()[1] == "1.0000"


@pytest.mark.gate
def test_embed_refuses_a_decoder_and_a_missing_tokenizer(ckpts, tmp_path):
    out = run_cli_inline("embed", "--model", ckpts["llama3"], "--tp", "2", "--text", "hi")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "decoder; embed needs an encoder" in out.stderr
    bare = shutil.copytree(ckpts["bert"], tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    out = run_cli_inline("embed", "--model", bare, "--tp", "2", "--text", "hi")
    assert out.returncode == 2 and "has no tokenizer.json" in out.stderr
