"""The native decode step (shardwise.kernels.step: every layer of a step in one call, the tp
all-reduces included) against the per-op fused path it replaces, sharded: at tp 1-4 (3:
uneven heads) on the generate cache at batch 1 and 16 (rows of different lengths,
left-padded) and on the paged cache with sequences joining and leaving, on Q8_0 and Q4_0
weights (bitwise equal: same kernels, same order) and fp32 ones (within 1e-4: the program's
fp32 kernel sums in another order than MKL). The all-reduces are counted alike. A second run with no spin at all hands every late peer's wait
to the communicator and resumes: the same logits again."""

from __future__ import annotations

import contextlib

import pytest
import torch

from decode_runs import generate_logits, paged_logits
from helpers import tp_group
from hf_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # widths every tp here cuts on whole blocks of 32 (head_dim 32; 4 query heads over 3 ranks: 2, 1, 1)
    shape = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    return str(save_tiny("llama3", tmp_path_factory.mktemp("step"), overrides={**shape, "num_hidden_layers": 3}))


def _case(world, path, quantize):
    from shardwise.hf import load_pretrained
    from shardwise.kernels import step

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp, quantize=quantize)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    one = [torch.randint(1, V, (9,), generator=g).tolist()]
    sixteen = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (16,), generator=g)]
    res, calls, waits = {}, {}, {}
    for native in (False, True, "nospin"):
        before = tp.stats.calls("all_reduce")
        spin = step.SPIN_NS
        step.SPIN_NS = -1 if native == "nospin" else spin
        model.__dict__.pop("_step_programs", None)
        try:
            ctx = contextlib.nullcontext if native else step.off
            got = [generate_logits(model, p, ctx) for p in (one, sixteen)] + [paged_logits(model, ctx)]
        finally:
            step.SPIN_NS = spin
        res[native] = got
        calls[native] = tp.stats.calls("all_reduce") - before
        if native:
            progs = [e.program for e in model.__dict__.get("_step_programs", {}).values() if e]
            assert progs, f"the native step never ran: {model.__dict__.get('_step_refused')}"
            assert all((p.allreduce is None) == (tp.size == 1) for p in progs)
            waits[native] = sum(p.waits for p in progs)
    return {"res": res, "calls": calls, "waits": waits, "shm": type(tp).__name__}


@pytest.mark.parametrize(
    "tp,quantize",
    [
        (1, "q8_0"),
        (2, "q8_0"),
        (2, None),  # fp32: the program's fp32 kernel against MKL's, within rounding
        pytest.param(2, "q4_0", marks=pytest.mark.full),
        pytest.param(3, "q8_0", marks=pytest.mark.full),
        pytest.param(4, "q4_0", marks=pytest.mark.full),
    ],
)  # tp 3 and 4 in `make test-more`: the gate's tp=2 runs the same sharded code
def test_native_step_equals_the_per_op_path_at_every_tp(rank_pool, tiny, tp, quantize):
    results = rank_pool.run(_case, tp, args=(tiny, quantize))
    if tp > 1:  # without a spin, the rank that comes first to an all-reduce waits in Python
        assert sum(r["waits"]["nospin"] for r in results) > 0
    for r in results:
        if tp > 1:
            assert r["shm"] == "ShmCommunicator", "the pool's tp group should take the shared-memory all-reduce"
        plain = r["res"][False]
        for native in (True, "nospin"):
            got = r["res"][native]
            pairs = [("batch1", plain[0], got[0]), ("batch16", plain[1], got[1])]
            pairs += [("paged", a, b) for a, b in zip(plain[2], got[2], strict=True)]
            for name, a, b in pairs:
                if quantize is None:
                    torch.testing.assert_close(
                        b,
                        a,
                        rtol=1e-4,
                        atol=1e-4,
                        msg=lambda m, name=name, native=native: f"{name} at tp={tp} ({native}): {m}",
                    )
                    assert torch.equal(a.argmax(-1), b.argmax(-1)), name
                else:
                    assert torch.equal(a, b), f"{name} at tp={tp} ({native}): {(a - b).abs().max().item()}"
            assert r["calls"][native] == r["calls"][False], r["calls"]
        assert r["calls"][False] > 0 or tp == 1


@pytest.mark.full  # a launched job (8 s): the gate's fail-fast cases cover the launcher, this the native step's wait
def test_a_peer_that_never_comes_to_a_native_all_reduce_is_named(tiny):
    """Rank 0's native step finds rank 1 late, waits through the communicator, and times out
    naming it and the all-reduce (counted as the communicator's own: the board's numbers hold)."""
    import re
    import time

    from cases.native_step import late_peer_in_native_step
    from processes import wait_gone
    from shardwise.launch import RankFailedError, launch

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(late_peer_in_native_step, 2, args=(tiny,), timeout_s=2)
    err = info.value
    assert (err.rank, err.stuck) == (1, (1,)), err.summary
    assert re.match(r"stuck: never arrived at all_reduce/tp #\d+ \(rank 0 waited 2\.\d s for it\); ", err.summary)
    assert "CollectiveError: all_reduce on group 'tp'" in err.detail, err.detail
    assert time.monotonic() - start < 60
    assert wait_gone(pids=err.pids) == []
