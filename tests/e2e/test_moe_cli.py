"""The commands on a tiny Mixtral (8 experts) with --expert-parallel: generate (tp 2, and tp 2 x
pp 2) and serve (one request) give transformers' greedy tokens, verify passes, info shows which
rank holds which experts; a dense model with --expert-parallel is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from hf_models import TINY_MOE, save_tiny
from processes import run_cli, run_cli_inline

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 3, 77]
NEW = 8


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(checkpoint dir with a word-level tokenizer of its vocabulary, transformers' greedy tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = save_tiny("mixtral", tmp_path_factory.mktemp("moe_cli"))
    vocab = TINY_MOE["mixtral"][2]["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    model = transformers.MixtralForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return path, out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--tp", "2", "--pp", "2")], ids=["tp2", "tp2xpp2"])
def test_generate_expert_parallel_gives_transformers_tokens(mixtral, layout):
    path, want = mixtral
    ids = ",".join(map(str, PROMPT))
    out = run_cli(
        "generate", "--model", path, *layout, "--expert-parallel", "--prompt-ids", ids,
        "--max-new-tokens", str(NEW), "--ignore-eos", "--backend", "gloo", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["tokens"] == [want]
    assert len(result["param_bytes_per_rank"]) == 2 * (2 if "--pp" in layout else 1)


def test_verify_expert_parallel_passes(mixtral):
    path, _ = mixtral
    out = run_cli("verify", "--model", path, "--tp", "2", "--expert-parallel", "--backend", "gloo")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "PASS: tp=2, expert-parallel matches" in out.stdout
    assert "transformers: MixtralForCausalLM" in out.stdout  # compared against transformers too


def test_serve_expert_parallel_answers_with_transformers_tokens(mixtral, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("openai")
    from test_serve import Server

    path, want = mixtral
    s = Server(tmp_path, "--model", str(path), "--tp", "2", "--expert-parallel", "--backend", "gloo")
    try:
        assert httpx.get(f"{s.url}/health", timeout=10).json()["tp"] == 2
        r = s.client().completions.create(
            model=path.name, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text.split() == [f"w{t}" for t in want]
    finally:
        s.stop()


@pytest.mark.gate
def test_info_shows_the_experts_each_rank_holds(mixtral):
    path, _ = mixtral
    out = run_cli_inline("info", "--model", path, "--tp", "3", "--expert-parallel")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for held in ("rank 0: experts 0-2 (3 of 8)", "rank 1: experts 3-5 (3 of 8)", "rank 2: experts 6-7 (2 of 8)"):
        assert any(held in line for line in lines), (held, out.stdout)
    out = run_cli_inline("info", "--model", path, "--tp", "2", "--json")
    info = json.loads(out.stdout)
    assert [held[0]["experts"] for held in info["experts_by_rank"]] == [[0, 8], [0, 8]]  # every expert, sliced
    assert [held[0]["expert_width"] for held in info["experts_by_rank"]] == [20, 20]


@pytest.mark.gate
def test_expert_parallel_on_a_dense_model_is_one_line():
    out = run_cli_inline("generate", "--tp", "2", "--expert-parallel")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "has no experts" in lines[0], out.stderr


@pytest.mark.gate
def test_more_ranks_than_experts_is_one_line(tmp_path):
    path = save_tiny("mixtral", tmp_path, overrides={"num_local_experts": 2})  # 4 query heads, 2 experts
    for command in ("generate", "serve", "verify", "info"):
        out = run_cli_inline(command, "--model", path, "--tp", "3", "--expert-parallel")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (command, out.stderr)
        assert "tp=3 is more than num_experts=2 with --expert-parallel; valid tp sizes: 1-2" in lines[0], lines
