"""--quantize through the commands, on the built-in model: generate at tp=2 (against tp=1
with the same scheme) and tp=2 x pp=2, verify against the unsharded converted twin and
transformers, info's bytes, and a server answering the openai client with int8 weights."""

from __future__ import annotations

import json

import pytest

from processes import run_cli

openai = pytest.importorskip("openai")

GEN = ("generate", "--json", "--max-new-tokens", "16", "--prompt", "It is a truth universally acknowledged")


def _gen(*args: str) -> dict:
    out = run_cli(*GEN, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_int8_at_tp2_generates_the_tokens_of_int8_at_tp1_in_a_quarter_of_the_bytes():
    r = _gen("--tp", "2", "--quantize", "int8", "--compare-tp1")
    assert r["quantize"] == "int8" and r["matches_tp1"] is True, r["tokens"]
    fp32 = _gen("--tp", "2")
    for q, f in zip(r["param_bytes_per_rank"], fp32["param_bytes_per_rank"], strict=True):
        assert 0.25 < q / f < 0.27


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_tp2_pp2_generates_the_tokens_of_tp1(scheme):
    one = _gen("--tp", "1", "--quantize", scheme)
    staged = _gen("--tp", "2", "--pp", "2", "--quantize", scheme)
    assert staged["tokens"] == one["tokens"] and staged["pp"] == 2


@pytest.mark.parametrize("args", [["--tp", "2"], ["--tp", "2", "--pp", "2"], ["--tp", "4"]])
def test_verify_int8_against_its_unsharded_twin_and_transformers(args):
    out = run_cli("verify", *args, "--quantize", "int8", "--json")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["passed"] and r["quantize"] == "int8" and r["transformers_compared"] and r["tolerance"] == 0.2
    assert 0 < r["overall"]["vs_transformers"]["max_rel"] < 0.2


def test_info_shows_quantized_bytes_per_rank():
    out = run_cli("info", "--tp", "2", "--quantize", "int8", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    formats = {t["name"]: t["format"] for t in r["tensors"]}
    assert formats["lm_head.weight"] == "int8" and formats["embed.weight"] == "int8"
    assert formats["norm.weight"] == "float32"
    plain = json.loads(run_cli("info", "--tp", "2", "--json").stdout)
    assert 0.25 < r["bytes_per_rank"] / plain["bytes_per_rank"] < 0.27


def test_server_with_int8_weights_answers_the_openai_client(tmp_path):
    from test_serve import Server

    want = _gen("--tp", "2", "--quantize", "int8", "--ignore-eos")["text"][0]
    s = Server(tmp_path, "--tp", "2", "--quantize", "int8", "--max-batch-size", "4")
    try:
        prompt = "It is a truth universally acknowledged"
        kw = dict(model="default", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        r = s.client().completions.create(**kw)
        assert r.choices[0].text == want and r.usage.completion_tokens == 16
    finally:
        s.stop()
