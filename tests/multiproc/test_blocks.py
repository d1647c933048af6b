"""Whole layers and a whole tiny DecoderLM, sharded by their plans, against their
unsharded twins; and the Megatron communication count (2 all-reduces per layer forward,
2 backward) asserted through the communication accounting."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, sharded_grads_expected, tp_group

from shardwise.launch import launch
from shardwise.models import DecoderLayer, DecoderLM, ModelConfig
from shardwise.models.modules import MLP, attention_mask, rope_cos_sin, rope_inv_freq
from shardwise.sharding import parallelize
from shardwise.sharding.plans import decoder_plan, layer_plan, mlp_plan

B, T = 2, 7


def _block_case(world, cfg: ModelConfig, kind: str) -> dict[str, dict]:
    """kind "block": one DecoderLayer (attention + gated MLP, RoPE, causal mask); "mlp": one MLP."""
    comm = tp_group(world)
    torch.manual_seed(0)
    model = DecoderLayer(cfg) if kind == "block" else MLP(cfg)
    plan = layer_plan(cfg) if kind == "block" else mlp_plan(cfg)
    rope = rope_cos_sin(rope_inv_freq(cfg), torch.arange(T).expand(B, T), torch.float32)  # (B, 1, T, hd) each
    mask = attention_mask(None, T, T, causal=True, window=None, device="cpu")  # (1, 1, T, T)
    inputs = (rope, mask) if kind == "block" else ()
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    y_ref = model(x, *inputs)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)

    expected = sharded_grads_expected(model, plan, comm)
    sharded = parallelize(copy.deepcopy(model), plan, comm=comm)
    sharded.zero_grad(set_to_none=True)
    x_local = x.detach().clone().requires_grad_()
    with comm.stats.track() as fwd:
        y = sharded(x_local, *inputs)
    with comm.stats.track() as bwd:
        y.backward(gy)

    assert_close(y, y_ref.detach(), "block output")
    assert_close(x_local.grad, x.grad, "input grad")
    for name, p in sharded.named_parameters():
        assert_close(p.grad, expected[name], f"grad of {name}")
    return {"fwd": fwd.snapshot(), "bwd": bwd.snapshot()}


def _only_tp_all_reduces(snapshot: dict[str, dict]) -> int:
    assert set(snapshot) <= {"all_reduce/tp"}, f"unexpected collectives: {snapshot}"
    return snapshot.get("all_reduce/tp", {"calls": 0})["calls"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformer_block_two_all_reduces_each_way(world_size):
    cfg = ModelConfig.debug(hidden_size=32, num_heads=8, num_kv_heads=4, intermediate_size=64)
    for counts in launch(_block_case, world_size, args=(cfg, "block")):
        expected = 0 if world_size == 1 else 2
        assert _only_tp_all_reduces(counts["fwd"]) == expected
        assert _only_tp_all_reduces(counts["bwd"]) == expected


MEGATRON_MLP = ModelConfig.debug(
    hidden_size=24, num_heads=4, num_kv_heads=4, intermediate_size=48, gated_mlp=False, act="gelu", mlp_bias=True
)  # down(gelu(up(x))) with biases: Megatron-LM's fc2(gelu(fc1(x)))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_megatron_mlp_one_all_reduce_each_way(world_size):
    for counts in launch(_block_case, world_size, args=(MEGATRON_MLP, "mlp")):
        assert _only_tp_all_reduces(counts["fwd"]) == 1
        assert _only_tp_all_reduces(counts["bwd"]) == 1


def test_replicated_kv_block_sums_replica_grads():
    """2 KV heads at tp=4: each KV head on 2 ranks. Grads still match the unsharded block;
    the replicas' weight and bias gradients cost one extra all-reduce in backward."""
    cfg = ModelConfig.debug(
        hidden_size=32, num_heads=8, num_kv_heads=2, intermediate_size=64, qkv_bias=True, o_bias=True, mlp_bias=True
    )
    for counts in launch(_block_case, 4, args=(cfg, "block")):
        assert _only_tp_all_reduces(counts["fwd"]) == 2
        assert _only_tp_all_reduces(counts["bwd"]) == 2 + 2  # + weight and bias replica sums


def _tiny_lm_case(world, cfg: ModelConfig, dtype_name: str) -> None:
    comm = tp_group(world)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    target = torch.roll(ids, -1, dims=1)
    logits_ref = model(ids)  # (B, T, V)
    loss_ref = F.cross_entropy(logits_ref.float().flatten(0, 1), target.flatten())
    loss_ref.backward()

    plan = decoder_plan(cfg, gather_logits=False)
    expected = sharded_grads_expected(model, plan, comm)
    sharded = parallelize(copy.deepcopy(model), plan, comm=comm)
    sharded.zero_grad(set_to_none=True)
    assert sharded.lm_head.weight is sharded.embed.weight, "tied weights must stay tied"

    from shardwise.layers import vocab_parallel_cross_entropy

    local_logits = sharded(ids)  # (B, T, V_pad/p)
    loss = vocab_parallel_cross_entropy(local_logits, target, comm=comm).mean()
    loss.backward()
    if dtype == torch.float32:
        assert_close(loss, loss_ref.detach(), "loss")
    else:
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=2e-2, atol=2e-2)
    for name, p in sharded.named_parameters():
        assert_close(p.grad, expected[name], f"grad of {name}")

    full = parallelize(copy.deepcopy(model), decoder_plan(cfg, gather_logits=True), comm=comm)
    with torch.no_grad():
        assert_close(full(ids), logits_ref.detach(), "gathered logits")


TINY = ModelConfig.debug(hidden_size=32, num_heads=8, num_kv_heads=2, intermediate_size=48, vocab_size=250)
TINY3 = ModelConfig.debug(hidden_size=48, num_heads=12, num_kv_heads=6, intermediate_size=48, vocab_size=250)


@pytest.mark.parametrize(
    "world_size,cfg",
    [(1, TINY), (2, TINY), (3, TINY3), (4, TINY)],
    ids=["tp1", "tp2", "tp3", "tp4-replicated-kv"],
)
def test_tiny_lm_loss_and_grads_match_unsharded(world_size, cfg):
    launch(_tiny_lm_case, world_size, args=(cfg, "fp32"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_lm_bf16(world_size):
    launch(_tiny_lm_case, world_size, args=(TINY, "bf16"))
