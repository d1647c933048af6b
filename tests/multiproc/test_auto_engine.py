"""The engine's loops on a model of the automatic plan (shardwise.engine.auto): transformers'
OlmoForCausalLM, sharded at tp = 1, 2 and 3 (4 heads: 2/1/1 at tp=3), and OPTForCausalLM at
tp=3 (learned positions: a left-padded row's positions must count from its first real token;
OLMo's RoPE would not notice), against transformers on the same checkpoint. One pooled case
per model and tp runs all three loops:

- generate (engine/generate.py) on 2 left-padded prompts of 7 and 4 tokens: greedy tokens
  equal model.generate(do_sample=False); seeded sampling gives every rank the same tokens;
- perplexity (engine/perplexity.py) over overlapping windows: transformers' NLL, 1e-4 relative;
- serve's steps (OneSequence): each prompt alone, prefill then one token a step, the same
  greedy tokens."""

from __future__ import annotations

import pytest

from auto_models import PROMPTS, hf_greedy, hf_nll, save_olmo, text_ids
from helpers import tp_group

transformers = pytest.importorskip("transformers")

NEW = 10
CONTEXT, STRIDE = 24, 10  # windows overlap: later windows score tokens with 14 before them
TEXT = 90


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """arch -> (checkpoint, transformers' greedy tokens, its mean NLL over the windows)."""
    root, cache = tmp_path_factory.mktemp("auto_engine"), {}

    def get(arch: str):
        if arch not in cache:
            path = save_olmo(root, arch)
            greedy = hf_greedy(path, PROMPTS, NEW)
            assert len({t for row in greedy for t in row}) > 4, "greedy tokens should vary (init scale too small?)"
            total, n = hf_nll(path, text_ids(TEXT), context=CONTEXT, stride=STRIDE)
            cache[arch] = (str(path), greedy, total / n)
        return cache[arch]

    return get


def _engine_case(world, path: str) -> dict:
    import torch

    from shardwise.engine import SamplingParams, generate
    from shardwise.engine.auto import AutoLM, OneSequence
    from shardwise.engine.perplexity import perplexity
    from shardwise.engine.slots import StepBatch
    from shardwise.hf import load_pretrained

    tp = tp_group(world)
    model, report = load_pretrained(path, comm=tp)
    lm = AutoLM(model)
    greedy = generate(lm, PROMPTS, comm=tp, max_new_tokens=NEW).tokens
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=None)  # unseeded: only the broadcast agrees
    sampled = generate(lm, PROMPTS, comm=tp, max_new_tokens=NEW, sampling=sampling).tokens
    ppl = perplexity(lm, text_ids(TEXT), context=CONTEXT, stride=STRIDE, batch=3)
    steps, served = OneSequence(lm), []
    for prompt in PROMPTS:  # as serve's scheduler steps one sequence: prompt at 0, then one token
        out, past, feed = [], 0, prompt
        for _ in range(NEW):
            logits = steps.forward(StepBatch.build([(0, past, feed)]))  # (1, V)
            past, feed = past + len(feed), [int(logits.argmax(-1))]
            out.append(feed[0])
        served.append(out)
    local_q = [m.q_proj.weight.shape[0] for m in model.modules() if hasattr(m, "q_proj")]  # this rank's heads
    return {
        "family": report.family,
        "greedy": greedy,
        "sampled": sampled,
        "nll": ppl.mean_nll,
        "served": served,
        "local_q": local_q,
        "cache_cls": type(lm.new_caches(1, 1)).__name__,
        "logits_finite": bool(torch.isfinite(logits).all()),
    }


CASES = [
    pytest.param("olmo", 1, marks=pytest.mark.full),
    pytest.param("olmo", 2, marks=pytest.mark.full),
    pytest.param("olmo", 3),
    pytest.param("opt", 3, marks=pytest.mark.full),
]


@pytest.mark.parametrize("arch,tp", CASES)
def test_engine_loops_match_transformers(rank_pool, reference, arch, tp):
    path, want, nll = reference(arch)
    results = rank_pool.run(_engine_case, tp, args=(path,))
    hd = 64 // 4
    for rank, r in enumerate(results):
        assert r["family"] == f"auto:{arch}" and r["cache_cls"] == "DynamicCache"
        assert r["local_q"] == [hd * h for h in ([2, 1, 1][rank : rank + 1] if tp == 3 else [4 // tp])] * 2
        assert r["greedy"] == want, f"rank {rank}: {r['greedy']} != transformers' {want}"
        assert r["served"] == want, f"rank {rank}: serve's steps {r['served']} != {want}"
        assert abs(r["nll"] - nll) <= 1e-4 * abs(nll), f"rank {rank}: NLL {r['nll']!r} vs transformers' {nll!r}"
        assert r["sampled"] == results[0]["sampled"], f"rank {rank} sampled other tokens than rank 0"
        assert r["logits_finite"]
