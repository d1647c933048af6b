"""Rank functions of the block and tiny-LM parity tests, fn(world, ...): a DecoderLayer, an
MLP and a whole tiny DecoderLM sharded by their plans against their unsharded twins
(outputs, every gradient), returning the collectives counted. The gloo tests (through the
rank pool) and the MPI test run them."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from helpers import assert_close, sharded_grads_expected, tp_group
from shardwise.layers import vocab_parallel_cross_entropy
from shardwise.models import DecoderLayer, DecoderLM, ModelConfig
from shardwise.models.modules import MLP, attention_mask, rope_cos_sin, rope_inv_freq
from shardwise.sharding import parallelize
from shardwise.sharding.plans import decoder_plan, layer_plan, mlp_plan

__all__ = ["block_case", "tiny_lm_case", "TINY", "TINY3"]

B, T = 2, 7


def block_case(world, cfg: ModelConfig, kind: str) -> dict[str, dict]:
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


def tiny_lm_case(world, cfg: ModelConfig, dtype_name: str) -> None:
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
