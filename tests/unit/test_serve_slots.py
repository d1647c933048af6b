"""Slot caches: sequences that join and leave a running batch, each at its own length,
get the same greedy tokens as generate() gives each prompt alone (tp=1, in process)."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.engine import generate
from shardwise.engine.slots import SlotCaches, StepBatch
from shardwise.engine.text import DEFAULT_MODEL


@pytest.fixture(scope="module")
def model():
    from shardwise.hf import load_pretrained

    return load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())[0]


def _offline(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], comm=LocalCommunicator(), max_new_tokens=n).tokens[0]


def test_staggered_sequences_match_generate_alone(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 17, 1, 9, 30)]
    wanted = [6, 3, 8, 5, 4]
    joins = [0, 0, 2, 3, 5]  # the step at which each sequence joins
    caches = SlotCaches(model, num_slots=3, max_len=64)
    free, state, out = [0, 1, 2], {}, {i: [] for i in range(len(prompts))}
    step = 0
    while step < 100 and any(len(out[i]) < wanted[i] for i in out):
        for i, p in enumerate(prompts):  # join when due and a slot is free
            if joins[i] <= step and i not in state and len(out[i]) < wanted[i] and free:
                state[i] = {"slot": free.pop(0), "past": 0, "next": p}
        rows = [(s["slot"], s["past"], s["next"]) for s in state.values()]
        logits = caches.forward(model, StepBatch.build(rows))  # (B, V)
        for (i, s), tok in zip(list(state.items()), logits.argmax(-1).tolist(), strict=True):
            out[i].append(tok)
            s["past"] += len(s["next"])
            s["next"] = [tok]
            if len(out[i]) == wanted[i]:  # leave: the slot is reused by the next sequence
                free.append(state.pop(i)["slot"])
        step += 1
    for i, p in enumerate(prompts):
        assert out[i] == _offline(model, p, wanted[i]), f"sequence {i}"


def test_bad_batches_are_refused(model):
    caches = SlotCaches(model, num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="outside"):
        caches.forward(model, StepBatch.build([(2, 0, [1])]))
    with pytest.raises(ValueError, match="twice"):
        caches.forward(model, StepBatch.build([(0, 0, [1]), (0, 0, [2])]))
    with pytest.raises(ValueError, match="exceed the 8 cached positions"):
        caches.forward(model, StepBatch.build([(0, 5, [1, 2, 3, 4])]))
    with pytest.raises(ValueError, match="at least one"):
        StepBatch.build([(0, 0, [])])
