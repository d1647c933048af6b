"""Rank functions of the native decode step's failure test, fn(world, ...): a rank that never
comes to a step's all-reduce while its peer runs the step natively. Run by launch."""

from __future__ import annotations

import time

import torch

__all__ = ["late_peer_in_native_step"]


def late_peer_in_native_step(world, path: str) -> None:
    """Both ranks prefill and take one decode step (rank 0 checks the native program ran); then
    rank 1 sleeps outside any collective while rank 0 takes the next step."""
    from shardwise.comm.dims import tp_only
    from shardwise.engine.generate import decode_step, prefill
    from shardwise.hf import load_pretrained

    tp = tp_only(world)
    model, _ = load_pretrained(path, comm=tp, quantize="q8_0")
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    mask = torch.ones(1, 5, dtype=torch.long)
    caches = model.new_caches(1, 8)
    with torch.no_grad():
        logits = prefill(model, ids, mask, caches)
        mask = torch.ones(1, 6, dtype=torch.long)
        logits = decode_step(model, logits.argmax(-1, keepdim=True), mask, caches, 5)
        progs = [e for e in model.__dict__.get("_step_programs", {}).values() if e]
        if not progs:
            raise AssertionError(f"the native step never ran: {model.__dict__.get('_step_refused')}")
        if tp.rank == 1:
            time.sleep(120)  # stuck outside any collective
        decode_step(model, logits.argmax(-1, keepdim=True), torch.ones(1, 7, dtype=torch.long), caches, 6)
