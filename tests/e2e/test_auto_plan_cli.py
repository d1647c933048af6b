"""generate, eval-ppl and serve on a model of the automatic plan (OLMo: no shardwise model
code), as a user runs them, against transformers on the same checkpoint; and the options
that cannot apply to it, refused in one line before any rank starts, as verify refuses them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from auto_models import PROMPTS, hf_greedy, hf_nll, save_olmo, text_ids
from processes import run_cli, run_cli_inline

transformers = pytest.importorskip("transformers")

NEW = 10


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    """(checkpoint, transformers' greedy tokens of PROMPTS as one left-padded batch)."""
    path = save_olmo(tmp_path_factory.mktemp("auto_cli"))
    want = hf_greedy(path, PROMPTS, NEW)
    assert len({t for row in want for t in row}) > 4, "greedy tokens should vary (init scale too small?)"
    return path, want


def _refusal(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error: "), out.stderr
    return lines[0]


@pytest.mark.gate
def test_what_cannot_apply_is_refused_in_one_line_as_verify_does(olmo, tmp_path):
    """--pp and a tp the heads cannot take: the same line from verify and each command; serve's
    paged-engine options name themselves. run_cli_inline fails the test if a rank starts."""
    path, _ = olmo
    text = tmp_path / "text.txt"
    text.write_text("w1 w2 w3 w4")
    commands = {
        "verify": [],
        "generate": ["--prompt-ids", "1,2,3"],
        "eval-ppl": ["--text", text],
        "serve": ["--port", "0"],
    }
    for layout, message in (
        (["--tp", "2", "--pp", "2"], "--pp 2: pipeline stages need a decoder family, not the automatic plan"),
        (["--tp", "5"], "tp=5 is more than num_attention_heads=4; valid tp sizes: 1-4"),
    ):
        lines = {
            cmd: _refusal(run_cli_inline(cmd, "--model", path, *layout, *extra)) for cmd, extra in commands.items()
        }
        assert len(set(lines.values())) == 1 and message in lines["verify"], lines
    for option, named in (
        (["--kv-cache-memory", "1GiB"], "--kv-cache-memory 1GiB: the automatic plan serves one request at a time"),
        (["--max-batch-size", "4"], "--max-batch-size 4: the automatic plan serves one request at a time"),
    ):
        assert named in _refusal(run_cli_inline("serve", "--model", path, "--tp", "2", *option))


def _generate(path, tp: int, *extra: str) -> dict:
    args = ["generate", "--model", path, "--tp", str(tp), "--max-new-tokens", str(NEW), "--json", *extra]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("tp", [1, 2, 3])  # tp=3: 4 heads split 2/1/1
def test_generate_greedy_equals_transformers_generate(olmo, tp):
    path, want = olmo
    r = _generate(path, tp)
    assert r["family"] == "auto:olmo" and r["tp"] == tp and r["dtype"] == "float32"
    assert r["tokens"] == want and r["finish_reasons"] == ["length", "length"]
    calls = r["collectives_per_token"]
    assert ("all_reduce/tp" in calls) == (tp > 1), calls  # the sharded layers' own collectives


def test_generate_quantized_runs_the_same_at_tp1_and_tp2(olmo):
    """--quantize converts the automatic plan's layers as verify's do (load_pretrained); on this
    model the Q8_0 weights give the same greedy tokens at both layouts."""
    path, want = olmo
    one, two = (_generate(path, tp, "--quantize", "q8_0") for tp in (1, 2))
    assert one["quantize"] == two["quantize"] == "q8_0"
    assert two["tokens"] == one["tokens"] and all(len(t) == NEW for t in two["tokens"])
    assert sum(two["param_bytes_per_rank"]) < sum(_generate(path, 2)["param_bytes_per_rank"])


def test_verify_quantized_holds_a_model_whose_every_parameter_was_converted(olmo):
    """OLMo's norms have no weights: quantized, the model holds no parameter at all, and verify
    still compares it (its dtype is the asked-for one)."""
    path, _ = olmo
    out = run_cli("verify", "--model", path, "--tp", "2", "--quantize", "fp16")
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout
    assert "--quantize fp16 (the unsharded twin too)" in out.stdout and "PASS: tp=2" in out.stdout


def test_eval_ppl_at_tp2_equals_transformers(olmo, tmp_path):
    path, _ = olmo
    ids = text_ids(150)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i - 1}" for i in ids))  # the tokenizer's words: w{k} is id k + 1
    context, stride = 40, 16
    out = run_cli(
        "eval-ppl", "--model", path, "--tp", "2", "--text", text, "--context", context, "--stride", stride, "--json"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    total, n = hf_nll(path, ids, context=context, stride=stride)
    assert r["family"] == "auto:olmo" and r["text_tokens"] == len(ids) and r["tokens_scored"] == n == len(ids) - 1
    assert abs(r["nll"] - total / n) <= 1e-4 * abs(total / n), (r["nll"], total / n)


def test_serve_at_tp2_answers_with_transformers_greedy_tokens(olmo, tmp_path):
    from test_serve import Server
    from tokenizers import Tokenizer

    path, _ = olmo
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    want = [tok.decode(hf_greedy(path, [p], NEW)[0]) for p in PROMPTS]  # each prompt alone, as served
    s = Server(tmp_path, "--model", str(path), "--tp", "2")
    try:
        client = s.client()

        def complete(p: list[int], stream: bool = False) -> tuple[str, str | None]:
            kw = dict(model="olmo", prompt=p, max_tokens=NEW, temperature=0)
            if not stream:
                r = client.completions.create(**kw)
                return r.choices[0].text, r.choices[0].finish_reason
            chunks = list(client.completions.create(**kw, stream=True))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason

        assert complete(PROMPTS[0]) == (want[0], "length")
        assert complete(PROMPTS[1], stream=True) == (want[1], "length")
        with ThreadPoolExecutor(4) as pool:  # queued, then served one at a time
            got = list(pool.map(lambda i: complete(PROMPTS[i % 2], stream=i % 3 == 0)[0], range(4)))
        assert got == [want[i % 2] for i in range(4)]
    finally:
        s.stop()
    log = s.log.read_text()
    assert "automatic plan (auto:olmo): one request at a time" in log and "tp=2" in log, log[-2000:]
