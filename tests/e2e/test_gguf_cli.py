"""`--model FILE.gguf` through the commands: the shipped model converted to GGUF generates
at tp=2 the tokens its safetensors copy generates, with the tokenizer and stop id from the
file's metadata; info, plan and verify read it; bad input is refused in one line before
any rank starts; `serve --model FILE.gguf` answers with generate's tokens."""

from __future__ import annotations

import json

import pytest

from gguf_files import write_gguf
from processes import run_cli, run_cli_inline
from shardwise.engine.text import DEFAULT_MODEL

pytest.importorskip("gguf")
pytest.importorskip("transformers")

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def austen(tmp_path_factory):
    """The shipped model as F32 and Q8_0 GGUF files, with its byte-level BPE vocabulary."""
    root = tmp_path_factory.mktemp("gguf_cli")
    return {q: write_gguf(DEFAULT_MODEL, root / f"austen.{q}.gguf", q) for q in ("F32", "Q8_0")}


def _generate(model, *extra: str) -> dict:
    out = run_cli("generate", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "12", "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def generated(austen):
    """`generate --json` of the F32 file at tp=2."""
    return _generate(austen["F32"], "--tp", "2")


def test_generate_at_tp2_equals_the_safetensors_model(austen, generated):
    ours = generated
    ref = _generate(DEFAULT_MODEL, "--tp", "2")
    assert ours["tokens"] == ref["tokens"] and ours["text"] == ref["text"]
    assert len(ours["peak_load_anon_bytes_per_rank"]) == 2


def test_q8_0_generates_with_dtype_and_quantize(austen):
    for extra in (("--dtype", "bfloat16"), ("--quantize", "int8")):
        r = _generate(austen["Q8_0"], "--tp", "2", *extra)
        assert len(r["tokens"][0]) == 12 and isinstance(r["text"][0], str)
    as_stored = _generate(austen["Q8_0"], "--tp", "2")  # the file's own blocks: rank 0's bytes by format
    assert set(as_stored["bytes_by_format"]) == {"Q8_0", "F32"}, as_stored["bytes_by_format"]
    assert sum(as_stored["bytes_by_format"].values()) == as_stored["param_bytes_per_rank"][0]


def test_info_plan_and_verify_read_the_file(austen):
    out = run_cli_inline("info", "--model", austen["Q8_0"], "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "llama" in out.stdout
    out = run_cli_inline("plan", "--model", austen["Q8_0"], "--cluster", "dgx-a100-80gb", "--prompt-len", "64")
    assert out.returncode == 0, out.stderr
    out = run_cli("verify", "--model", austen["Q8_0"], "--tp", "2")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "transformers: not compared" not in out.stdout  # its own GGUF load is the reference
    # computed in the file's Q8_0 blocks: the sharded twin to 1e-4, transformers' fp32 to 5e-2
    assert "PASS: tp=2 matches within 0.0001 relative error (0.05 against transformers: weights in Q8_0" in out.stdout


@pytest.mark.gate
def test_bad_input_is_one_line_before_any_rank(tmp_path, austen):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(austen["Q8_0"].read_bytes()[:5000])
    missing = tmp_path / "missing.gguf"
    for args, want in (
        (("--model", cut), "truncated"),
        (("--model", missing), "does not exist"),
        (("--model", austen["Q8_0"], "--tp", "9"), "valid tp sizes"),
    ):
        out = run_cli_inline("generate", *args, "--max-new-tokens", "2")
        assert out.returncode != 0
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and want in lines[0], out.stderr


def test_serve_gguf_at_tp2_completes_like_generate(tmp_path, austen, generated):
    """`serve --model FILE.gguf --tp 2`: a greedy completion of the prompt is generate's text,
    token for token, with the tokenizer from the file."""
    from test_serve import Server

    server = Server(tmp_path, "--model", str(austen["F32"]), "--tp", "2")
    try:
        client = server.client()
        [card] = client.models.list().data
        r = client.completions.create(model=card.id, prompt=PROMPT, max_tokens=12, temperature=0)
    finally:
        server.stop()
    assert r.choices[0].text == generated["text"][0], (r.choices[0].text, generated["text"][0])
    assert r.usage.completion_tokens == len(generated["tokens"][0])
