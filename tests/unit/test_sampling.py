from __future__ import annotations

import pytest
import torch

from shardwise.engine import SamplingParams, sample


def test_greedy_and_degenerate_filters_pick_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, SamplingParams()), best)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.0, top_k=1), g), best)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), g), best)


def test_top_k_and_top_p_only_draw_from_the_kept_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    g = torch.Generator().manual_seed(0)
    draws_k = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g).item() for _ in range(300)}
    assert draws_k == {0, 1}
    draws_p = {sample(logits, SamplingParams(temperature=1.0, top_p=0.85), g).item() for _ in range(300)}
    assert draws_p == {0, 1, 2}  # 0.5 + 0.3 < 0.85, so the third token is needed


def test_seed_reproduces():
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=0.8, seed=123)
    assert torch.equal(sample(logits, p, p.generator()), sample(logits, p, p.generator()))


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
