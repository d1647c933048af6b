"""Decode runs the decode-path tests compare (tests/multiproc/test_fused_decode.py,
test_native_step.py): greedy steps of left-padded prompts on the generate cache, and a
scripted continuous batch on the paged cache with sequences joining and leaving. Each takes
`ctx`, a context manager factory that picks the path under test (`decode.unfused`,
`step.off`, or nothing)."""

from __future__ import annotations

import contextlib

import torch

NEW = 6
"""Decode steps of a generate run."""


def generate_logits(model, prompts: list[list[int]], ctx=contextlib.nullcontext) -> torch.Tensor:
    """Greedy decode of left-padded prompts on the generate cache -> every step's logits (steps, B, V)."""
    from shardwise.engine.generate import decode_step, prefill

    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :], mask[b, L - len(p) :] = torch.tensor(p), 1
    caches = model.new_caches(B, L + NEW)
    out = []
    with torch.no_grad(), ctx():
        logits = prefill(model, ids, mask, caches)
        for t in range(NEW):
            out.append(logits)  # (B, V): the LM head gathers the vocabulary
            tok = logits.argmax(-1, keepdim=True)  # (B, 1), the same on every rank
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
            logits = decode_step(model, tok, mask, caches, L + t)
    return torch.stack(out)


def paged_logits(model, ctx=contextlib.nullcontext) -> list[torch.Tensor]:
    """A scripted continuous batch on the paged cache: 3 prompts, decode steps of 3 rows, then 2
    (one left), then a fourth sequence's prompt and 3 rows again -> each step's logits (B, V)."""
    from shardwise.engine.paged import PagedCaches
    from shardwise.engine.slots import StepBatch

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
    with torch.no_grad(), ctx():
        for b in script:
            out.append(caches.forward(model, b))  # (B, V)
    return out
