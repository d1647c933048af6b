"""The server's engine loop over the paged KV cache at tp 1, 2 and 3 (3: uneven, 8 query / 2 KV
heads): every rank runs the scheduler over its own pool of the same blocks, as rank 0 decides
and the others follow in the server. Sequences share a prompt prefix and the pool is too small
for all of them at once, so blocks are shared, preempted and reused; the greedy tokens equal
transformers' generate of each prompt alone."""

from __future__ import annotations

import pytest
import torch

from helpers import tp_group
from hf_models import TINY, save_tiny

transformers = pytest.importorskip("transformers")
NEW = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = save_tiny("llama3", tmp_path_factory.mktemp("paged"))
    model = getattr(transformers, TINY["llama3"][1]).from_pretrained(path).eval()
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, model.config.vocab_size, (37,), generator=g).tolist()  # 2 full blocks, and 5
    prompts = [shared + torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 1, 20)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            want.append(out[0, len(p) :].tolist())
    return str(path), prompts, want


def _serve_case(world, path, prompts, num_blocks):
    from shardwise.engine.paged import BlockTables, PagedCaches
    from shardwise.engine.sampling import SamplingParams
    from shardwise.hf import load_pretrained
    from shardwise.serve.metrics import Metrics
    from shardwise.serve.scheduler import Scheduler, Sequence

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp)
    metrics = Metrics(tp=tp.size, slots=4)
    tables = BlockTables(num_blocks)
    caches = PagedCaches(model, num_blocks)
    sched = Scheduler(num_slots=4, max_queue=8, metrics=metrics, blocks=tables)
    outs = [[] for _ in prompts]
    sched.submit(Sequence(list(prompts[0]), NEW, SamplingParams(), frozenset(), outs[0].append))
    for _ in range(3):  # the first prompt is cached before the others come
        sched.finish_step(caches.forward(model, sched.next_batch()))
    for p, out in zip(prompts[1:], outs[1:], strict=True):
        sched.submit(Sequence(list(p), NEW, SamplingParams(), frozenset(), out.append))
    for _ in range(300):
        batch = sched.next_batch()
        if batch is None:
            break
        sched.finish_step(caches.forward(model, batch))
    return {
        "tokens": [[o.token for o in out if o.token is not None] for out in outs],
        "free": tables.pool.num_free,
        "preemptions": metrics.preemptions,
        "hits": metrics.prefix_hit_tokens,
        "kv_heads": caches.layers[0].k.shape[2],
    }


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.full), pytest.param(2, marks=pytest.mark.full), 3])
def test_paged_serving_at_tp_equals_transformers(rank_pool, reference, tp):
    path, prompts, want = reference
    # the four sequences grow to 50-69 positions, 4-5 blocks of 16 each, 2 of them shared: 11 blocks
    # in all; a pool of 9 must preempt
    results = rank_pool.run(_serve_case, tp, args=(path, prompts, 9))
    for r in results:
        assert r["tokens"] == want
        assert r["free"] == 9 and r["preemptions"] > 0 and r["hits"] >= 3 * 32
    kv_heads = {1: [2], 2: [1, 1], 3: [1, 2, 1]}[tp]  # tp 3: query heads 3+3+2, the middle rank spans both KV groups
    assert [r["kv_heads"] for r in results] == kv_heads
