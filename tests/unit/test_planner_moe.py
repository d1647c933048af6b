"""The planner on mixtures of experts: parameters per rank against the real sharded model
(both placements over tp), FLOPs per token by hand, and the placement the cost model picks."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.hf.families import family_for
from shardwise.layers import model_shard_specs
from shardwise.planner.cost import moe_flops_per_token
from shardwise.planner.footprint import stage_params, touched_experts
from shardwise.planner.presets import cluster_preset, model_preset
from shardwise.planner.search import evaluate
from shardwise.planner.specs import InferenceWorkload
from shardwise.sharding import parallelize

_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301,
         "max_position_embeddings": 64, "num_experts_per_tok": 2}  # fmt: skip
RAW = {
    "mixtral": {**_BASE, "model_type": "mixtral", "intermediate_size": 96, "num_hidden_layers": 2,
                "num_local_experts": 5},
    "qwen2_moe": {**_BASE, "model_type": "qwen2_moe", "intermediate_size": 80, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 72, "num_hidden_layers": 3, "num_experts": 6,
                  "mlp_only_layers": [1]},
}  # fmt: skip


@pytest.mark.parametrize("name", list(RAW))
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_parameters_per_rank_match_the_real_sharded_model(name, tp, expert_parallel):
    family = family_for(RAW[name])
    cfg = family.config(RAW[name], where=name)
    with torch.device("meta"):
        model = family.model(cfg)
    parallelize(model, family.plan(cfg, expert_parallel=expert_parallel), comm=DryRunCommunicator(tp))
    held = sum(math.prod(s.local_shape) for s in model_shard_specs(model).values())
    assert stage_params(cfg, tp, expert_parallel=expert_parallel) == held


def test_flops_and_touched_experts_by_hand():
    cfg = model_preset("mixtral-8x7b")
    h, i = 4096, 14336
    assert moe_flops_per_token(cfg, 1) == 2 * (h * 8 + 2 * 3 * h * i)  # router + top-2, not all 8
    assert moe_flops_per_token(cfg, 2) == 2 * (h * 8 + 2 * 3 * h * i // 2)
    assert moe_flops_per_token(cfg, 2, expert_parallel=True) == moe_flops_per_token(cfg, 2)  # 4 of 8 whole
    assert touched_experts(cfg, 2, 1) == pytest.approx(8 * 2 / 8)  # E (1 - (1 - k/E)^1)
    # expert parallel at one token: the busiest rank's expected max of Binomial(4, 1/4) over 2 ranks
    p = [math.comb(4, x) * 0.25**x * 0.75 ** (4 - x) for x in range(5)]
    cdf = [sum(p[: x + 1]) for x in range(5)]
    assert touched_experts(cfg, 2, 1, expert_parallel=True) == pytest.approx(sum(1 - cdf[x] ** 2 for x in range(4)))
    assert touched_experts(cfg, 2, 10_000, expert_parallel=True) == pytest.approx(4)


def test_the_placement_flips_with_the_batch():
    """At batch 1 a few experts are touched and may land on one rank: tensor-parallel experts
    win; once every expert is touched, fewer experts per rank (expert parallelism) win."""
    cfg, cl = model_preset("mixtral-8x7b"), cluster_preset("dgx-h100")
    picks = {}
    for batch in (1, 64):
        ranked, _ = evaluate(cfg, InferenceWorkload(batch=batch, prompt_len=128, output_len=32), cl)
        picks[batch] = ranked[0].layout
    assert picks[1].tp == picks[64].tp == 2
    assert picks[1].ep == "" and picks[64].ep == "tp"


def test_the_explanation_says_which_placement_wins_and_why():
    from shardwise.planner import recommend

    for batch, which, reads in (
        (1, "tensor-parallel experts decode", "2.00 experts"),
        (64, "expert parallelism decode", "4.00 whole experts"),
    ):
        wl = InferenceWorkload(batch=batch, prompt_len=128, output_len=32)
        rec = recommend("mixtral-8x7b", model_preset("mixtral-8x7b"), wl, cluster_preset("dgx-h100"))
        (line,) = [w for w in rec.explanation if w.startswith("Experts: ")]
        assert which in line and reads in line and "faster than the other placement at 2 ranks" in line, line
