"""The fused decode kernels (shardwise.kernels.decode) against the plain path, sharded: at tp
1-4 (3: uneven heads) on the generate cache at batch 1 and 16 (rows of different lengths,
left-padded), and on the paged cache with sequences joining and leaving. Each rank runs both
paths on its own shard; the logits of every step agree within
1e-5 and pick the same tokens. The per-op kernels, that is: the native step that runs a whole
step in one call (kernels.step) is off here, and tested against this path in test_native_step.py. pp=2 is checked through the CLI in tests/e2e."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tp_group
from hf_models import save_tiny

NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny("llama3", tmp_path_factory.mktemp("fused")))


def _generate_logits(model, tp, prompts: list[list[int]], fused: bool) -> torch.Tensor:
    """Greedy decode of left-padded prompts on the generate cache -> every step's logits (steps, B, V)."""
    from shardwise.engine.generate import decode_step, prefill
    from shardwise.kernels import decode, step

    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :], mask[b, L - len(p) :] = torch.tensor(p), 1
    caches = model.new_caches(B, L + NEW)
    out = []
    with torch.no_grad(), decode.unfused() if not fused else step.off():  # the per-op kernels: no program
        logits = prefill(model, ids, mask, caches)
        for t in range(NEW):
            out.append(logits)  # (B, V): the LM head gathers the vocabulary
            tok = logits.argmax(-1, keepdim=True)  # (B, 1), the same on every rank
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
            logits = decode_step(model, tok, mask, caches, L + t)
    return torch.stack(out)


def _paged_logits(model, tp, fused: bool) -> list[torch.Tensor]:
    """A scripted continuous batch on the paged cache: 3 prompts, decode steps of 3, then 2 rows
    (one left), then a fourth sequence's prompt and 3 rows again -> each step's logits."""
    from shardwise.engine.paged import PagedCaches
    from shardwise.engine.slots import StepBatch
    from shardwise.kernels import decode, step

    g = torch.Generator().manual_seed(3)
    V = model.cfg.vocab_size

    def tok(n):
        return torch.randint(1, V, (n,), generator=g).tolist()

    bs, tables, nxt = 16, {}, [0]

    def batch(rows):
        for s, p, new in rows:
            t = tables.setdefault(s, [])
            while len(t) * bs < p + len(new):
                t.append(nxt[0])
                nxt[0] += 1
        width = max(len(tables[s]) for s, _, _ in rows)
        tab = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (s, _, _) in enumerate(rows):
            tab[i, : len(tables[s])] = torch.tensor(tables[s])
        return StepBatch.build(rows, tables=tab)

    past = {0: 20, 1: 5, 2: 33}
    script = [batch([(s, 0, tok(n)) for s, n in past.items()])]
    for t in range(6):
        script.append(batch([(s, past[s], tok(1)) for s in sorted(past)]))
        for s in past:
            past[s] += 1
        if t == 1:
            del past[1]
        if t == 3:
            script.append(batch([(3, 0, tok(17))]))
            past[3] = 17
    caches = PagedCaches(model, 64, bs)
    out = []
    with torch.no_grad(), decode.unfused() if not fused else step.off():
        for b in script:
            out.append(caches.forward(model, b))  # (B, V)
    return out


def _case(world, path):
    from shardwise.hf import load_pretrained

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    one = [torch.randint(1, V, (9,), generator=g).tolist()]
    sixteen = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (16,), generator=g)]
    res = {}
    for name, prompts in (("batch1", one), ("batch16", sixteen)):
        res[name] = (_generate_logits(model, tp, prompts, False), _generate_logits(model, tp, prompts, True))
    res["paged"] = (_paged_logits(model, tp, False), _paged_logits(model, tp, True))
    return res


@pytest.mark.parametrize(
    "tp", [1, 2, pytest.param(3, marks=pytest.mark.full), pytest.param(4, marks=pytest.mark.full)]
)  # tp 3 and 4 in `make test-more`: the gate's tp=2 runs the same sharded code
def test_fused_decode_equals_the_plain_path_at_every_tp(rank_pool, tiny, tp):
    for r in rank_pool.run(_case, tp, args=(tiny,)):
        for name in ("batch1", "batch16"):
            plain, fused = r[name]
            torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n} at tp={tp}: {m}")
            assert torch.equal(fused.argmax(-1), plain.argmax(-1)), name
        for plain, fused in zip(*r["paged"], strict=True):
            torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5, msg=f"paged at tp={tp}")
            assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.full
def test_fused_decode_equals_the_plain_path_at_tp2_pp2():
    """The pipeline engine's stages run the same fused step: SHARDWISE_FUSED_DECODE=0 (plain)
    and the default give the same greedy tokens at tp=2 x pp=2, with a padded batch of 3."""
    from processes import run_cli

    args = ("generate", "--tp", "2", "--pp", "2", "--max-new-tokens", "12", "--ignore-eos", "--json")
    args += ("--prompt", "the quick brown fox", "--prompt", "a", "--prompt", "once upon a time there was")
    runs = [run_cli(*args, env={"SHARDWISE_FUSED_DECODE": flag}) for flag in ("0", "1")]
    for out in runs:
        assert out.returncode == 0, out.stderr
    plain, fused = (json.loads(out.stdout)["tokens"] for out in runs)
    assert len(plain) == 3 and all(len(t) == 12 for t in plain)
    assert fused == plain
