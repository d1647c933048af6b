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

from decode_runs import generate_logits, paged_logits
from helpers import tp_group
from hf_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny("llama3", tmp_path_factory.mktemp("fused")))


def _case(world, path):
    from shardwise.hf import load_pretrained

    tp = tp_group(world)
    model, _ = load_pretrained(path, comm=tp)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    one = [torch.randint(1, V, (9,), generator=g).tolist()]
    sixteen = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (16,), generator=g)]
    from shardwise.kernels import decode, step

    res = {}  # (plain, fused): the fused runs with the per-op kernels, no native program
    for name, prompts in (("batch1", one), ("batch16", sixteen)):
        res[name] = (generate_logits(model, prompts, decode.unfused), generate_logits(model, prompts, step.off))
    res["paged"] = (paged_logits(model, decode.unfused), paged_logits(model, step.off))
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
