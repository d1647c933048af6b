"""Training from a Hugging Face checkpoint (tiny Qwen3: q/k norms, tied embeddings) at tp=2
and at tp=2 x pp=2 matches training it in one process: losses of 3 steps, and every weight
after them. The q/k norm weights are replicated but each tp rank applies them to its own
heads, so their gradients are partial sums over tp (summed in the step); at pp=2 each stage
loads only its own tensors, and the tied embedding is held by the first and last stage."""

from __future__ import annotations

import pytest
import torch

from hf_models import save_tiny
from shardwise.comm import LocalCommunicator
from shardwise.train import TrainConfig, full_state, setup, train_step, write_token_file

STEPS = 3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    path = save_tiny("qwen3", root)
    g = torch.Generator().manual_seed(0)
    tokens = write_token_file(root / "tokens.safetensors", torch.randint(0, 130, (8000,), generator=g), vocab_size=130)
    return path, tokens, root


def _config(path, tokens, out, **parallel) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": {"pretrained": str(path)},
            "data": {"tokens": str(tokens), "seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2},
            "optim": {"lr": 3e-3, "schedule": "constant"},
            "parallel": parallel,
            "run": {"steps": STEPS, "progress": False, "plot": False, "out_dir": str(out), "log_every": 100},
        }
    )


def _run(world, cfg) -> dict:
    tr = setup(world, cfg)
    losses = [train_step(tr).loss for _ in range(STEPS)]
    state = full_state(tr.model, tr.mesh.tp, tr.specs)
    first = tr.mesh.tp.rank == 0 and tr.mesh.dp.rank == 0
    return {
        "losses": losses,
        "state": state if first else {},
        "norms": sorted(n for n in tr.partial_grads if "_norm." in n),
    }


def test_pretrained_qwen3_trains_at_tp2_and_tp2_pp2_as_in_one_process(rank_pool, qwen3):
    path, tokens, root = qwen3
    ref = _run(LocalCommunicator(), _config(path, tokens, root / "ref"))
    for world, parallel in ((2, {"tp": 2}), (4, {"tp": 2, "pp": 2})):
        results = rank_pool.run(_run, world, args=(_config(path, tokens, root / "pp", **parallel),))
        what = f"qwen3 {parallel}"
        assert results[0]["norms"] and all(".attn.q_norm." in n or ".attn.k_norm." in n for n in results[0]["norms"])
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=2e-5)
        merged = {}
        for r in results:
            merged.update(r["state"])
        assert merged.keys() == ref["state"].keys(), (what, merged.keys() ^ ref["state"].keys())
        for name, full in ref["state"].items():
            torch.testing.assert_close(
                merged[name], full, rtol=1e-4, atol=1e-4, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
            )
