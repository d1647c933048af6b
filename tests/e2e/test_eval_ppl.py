"""`shardwise eval-ppl` end to end: the engine against transformers' perplexity at tp=1, the
command at tp 2, 4 and 2 x pp 2 against tp=1, and bad input refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processes import run_cli, run_cli_inline
from shardwise.comm import LocalCommunicator
from shardwise.engine.perplexity import perplexity, windows
from shardwise.engine.text import DEFAULT_MODEL, load_tokenizer

HELDOUT = Path(__file__).resolve().parents[2] / "data" / "austen" / "heldout.txt"
N, CONTEXT, STRIDE = 400, 64, 48  # overlapping windows, the last one short; kept small for speed
REL = 1e-5


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return load_tokenizer(DEFAULT_MODEL).encode(HELDOUT.read_text(encoding="utf-8")).ids[:N]


@pytest.fixture(scope="module")
def tp1(ids) -> float:
    """Mean NLL of the engine at tp=1, in this process."""
    from shardwise.hf import load_pretrained

    model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    return perplexity(model, ids, context=CONTEXT, stride=STRIDE, batch=3).mean_nll


def _transformers_nll(ids: list[int], context: int, stride: int) -> float:
    """Hugging Face's sliding-window recipe, with transformers' own loss: labels -100 outside
    each window's new tokens, the model's mean loss times the tokens it scored."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    x = torch.tensor(ids)[None]  # (1, N)
    total, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + context, len(ids))
            labels = x[:, begin:end].clone()
            labels[:, : -(end - prev_end)] = -100
            scored = (labels[:, 1:] != -100).sum().item()  # the model shifts labels by one
            total += model(x[:, begin:end], labels=labels).loss.item() * scored
            count += scored
            prev_end = end
            if end == len(ids):
                break
    assert count == sum(w.end - w.first for w in windows(len(ids), context, stride))
    return total / count


@pytest.mark.parametrize(("context", "stride"), [(CONTEXT, STRIDE), (CONTEXT, CONTEXT)])
def test_engine_at_tp1_equals_transformers(ids, tp1, context, stride):
    from shardwise.hf import load_pretrained

    ours = tp1
    if (context, stride) != (CONTEXT, STRIDE):
        model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
        ours = perplexity(model, ids, context=context, stride=stride, batch=4).mean_nll
    assert ours == pytest.approx(_transformers_nll(ids, context, stride), rel=REL)


def _cli(*layout: str) -> dict:
    args = ["--text", HELDOUT, "--max-tokens", N, "--context", CONTEXT, "--stride", STRIDE, "--json"]
    out = run_cli("eval-ppl", *layout, *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.full  # make test runs eval-ppl's engine against transformers and the command's refusals
def test_tp2_equals_tp1(tp1):
    r = _cli("--tp", "2")
    assert (r["tp"], r["pp"], r["text_tokens"], r["context"], r["stride"]) == (2, 1, N, CONTEXT, STRIDE)
    assert r["tokens_scored"] == N - 1 and r["windows"] == len(windows(N, CONTEXT, STRIDE))
    assert r["nll"] == pytest.approx(tp1, rel=REL) and r["ppl"] == pytest.approx(torch.tensor(tp1).exp().item())
    assert r["wall_s"] > 0 and r["dtype"] == "float32"


@pytest.mark.parametrize("layout", [("--tp", "4"), ("--tp", "2", "--pp", "2")], ids=["tp4", "tp2-pp2"])
def test_other_layouts_equal_tp1(tp1, layout):
    r = _cli(*layout)
    assert r["tp"] * r["pp"] == 4 and r["tokens_scored"] == N - 1
    assert r["nll"] == pytest.approx(tp1, rel=REL)


def test_human_output_at_tp1_default_windows():
    out = run_cli("eval-ppl", "--tp", "1", "--text", HELDOUT, "--max-tokens", "600")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"eval-ppl: {HELDOUT}, default model, tp=1 (")
    assert lines[1] == "600 tokens, 3 windows of 256 tokens (stride 256): 597 scored"  # disjoint by default
    assert lines[2].startswith("mean NLL ") and " nats/token, perplexity " in lines[2]


def test_bad_input_refused_in_one_line_before_ranks_start(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a")
    missing = tmp_path / "missing.txt"
    cases = [
        (["--text", missing], f"--text {missing}: no such file"),
        (["--text", short], "the text is 1 token(s) long; perplexity needs at least 2"),
        (
            ["--text", HELDOUT, "--context", "64", "--stride", "65"],
            "stride must be between 1 and the context (64), got 65",
        ),
        (["--text", HELDOUT, "--context", "600"], "context 600 is more than the model's 512 positions"),
        (["--text", HELDOUT, "--max-tokens", "1"], "--max-tokens must be >= 2, got 1"),
    ]
    for args, message in cases:
        out = run_cli_inline("eval-ppl", "--tp", "2", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().splitlines() == [f"shardwise: error: {message}"], (args, out.stderr)
