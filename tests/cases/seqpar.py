"""Rank functions of the sequence-parallelism and recompute tests, fn(world, ...). The gloo
tests (through the rank pool) and the MPI test run the same functions.

- sequence_regions_case: the three sequence regions, forward and backward, against
  what they must compute (batch 1 and batch 2 take different paths), and the one-line
  refusal of a length the group does not divide.
- sp_block_case: one DecoderLayer sharded with and without sequence parallelism against
  its unsharded twin (output, input gradient, every parameter gradient; the norms' only
  after their partial gradients are summed, and provably partial before), returning the
  collectives each issued forward and backward.
- sp_lm_case: a whole tiny DecoderLM with sequence parallelism and each recompute mode,
  loss and every gradient against the unsharded model, and the bytes each layer kept for
  backward (which the test compares with shardwise.planner.activations).
- sp_train_many: training runs (setup + train_step) reporting what the tests compare with
  the single-process run, plus what only the job can see: every tp rank's replicated
  parameters (the norms summed over tp) bitwise equal, and the pipeline's bytes sent.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from cases.pipeline import _Grads
from helpers import assert_close, sharded_grads_expected, tp_group
from shardwise.comm import gather_from_sequence, reduce_scatter_to_sequence, scatter_to_sequence
from shardwise.layers import vocab_parallel_cross_entropy
from shardwise.models import DecoderLayer, DecoderLM, ModelConfig
from shardwise.models.modules import attention_mask, rope_cos_sin, rope_inv_freq
from shardwise.sharding import parallelize, partial_grad_names, sum_partial_grads
from shardwise.sharding.plans import decoder_plan, layer_plan
from shardwise.train import TrainConfig, full_state, setup, train_step
from shardwise.train.recompute import apply_recompute
from shardwise.train.saved import SavedBytes

__all__ = ["sequence_regions_case", "sp_block_case", "sp_lm_case", "sp_train_many"]

B, T = 2, 12


def _chunk(x: torch.Tensor, comm) -> torch.Tensor:
    return x.chunk(comm.size, dim=1)[comm.rank]


def sequence_regions_case(world) -> None:
    comm = tp_group(world)
    p, r = comm.size, comm.rank
    for batch in (1, 2):
        g = torch.Generator().manual_seed(0)
        full = torch.randn(batch, 4 * p, 3, generator=g)  # the same on every rank
        partial = [torch.randn(batch, 4 * p, 3, generator=g) for _ in range(p)]  # rank k's partial sum
        grad_full = torch.randn(batch, 4 * p, 3, generator=g)

        # gather: shards -> whole; backward reduce-scatters (every rank's gradient is a partial sum)
        x = _chunk(full, comm).clone().requires_grad_()
        y = gather_from_sequence(x, comm)
        assert torch.equal(y, full), ("gather_from_sequence", batch)
        y.backward(grad_full * (r + 1))
        assert_close(x.grad, _chunk(grad_full * sum(range(1, p + 1)), comm), f"gather backward, batch {batch}")

        # reduce-scatter: partial sums -> this rank's chunk of the sum; backward all-gathers
        x = partial[r].clone().requires_grad_()
        y = reduce_scatter_to_sequence(x, comm)
        assert_close(y, _chunk(sum(partial), comm), f"reduce_scatter_to_sequence, batch {batch}")
        y.backward(_chunk(grad_full, comm))
        assert torch.equal(x.grad, grad_full), ("reduce-scatter backward", batch)

        # scatter: whole -> this rank's chunk; backward all-gathers
        x = full.clone().requires_grad_()
        y = scatter_to_sequence(x, comm)
        assert torch.equal(y, _chunk(full, comm)), ("scatter_to_sequence", batch)
        y.backward(_chunk(grad_full, comm))
        assert torch.equal(x.grad, grad_full), ("scatter backward", batch)

    try:
        reduce_scatter_to_sequence(torch.ones(1, 2 * p + 1, 3, requires_grad=True), comm)
    except ValueError as e:
        assert f"sequence length {2 * p + 1} is not a multiple of group 'tp' of size {p}" in str(e), e
    else:
        raise AssertionError("an indivisible sequence length was accepted")


def sp_block_case(world, cfg: ModelConfig) -> dict[str, dict]:
    """One DecoderLayer, plain tp then sequence-parallel; the collectives of each."""
    comm = tp_group(world)
    torch.manual_seed(0)
    model = DecoderLayer(cfg)
    rope = rope_cos_sin(rope_inv_freq(cfg), torch.arange(T).expand(B, T), torch.float32)
    mask = attention_mask(None, T, T, causal=True, window=None, device="cpu")
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    y_ref = model(x, rope, mask)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)

    counts = {}
    for sp in (False, True):
        plan = layer_plan(cfg, sequence_parallel=sp)
        expected = sharded_grads_expected(model, plan, comm)
        sharded = parallelize(copy.deepcopy(model), plan, comm=comm)
        sharded.zero_grad(set_to_none=True)
        x_in = (_chunk(x, comm) if sp else x).detach().clone().requires_grad_()
        with comm.stats.track() as fwd:
            y = sharded(x_in, rope, mask)
        with comm.stats.track() as bwd:
            y.backward(_chunk(gy, comm) if sp else gy)
        what = "sp" if sp else "tp"
        assert_close(y, _chunk(y_ref, comm).detach() if sp else y_ref.detach(), f"{what} block output")
        assert_close(x_in.grad, _chunk(x.grad, comm) if sp else x.grad, f"{what} input grad")
        names = partial_grad_names(sharded, plan)
        assert names == (["attn_norm.weight", "mlp_norm.weight"] if sp else []), names
        grads = dict(sharded.named_parameters())
        for name in names:  # each rank's norm gradient covers its positions only...
            assert (grads[name].grad - expected[name]).abs().max() > 1e-4, f"{name}'s gradient is not partial"
        sum_partial_grads(sharded, names, comm=comm)  # ...until summed over tp
        for name, p in sharded.named_parameters():
            assert_close(p.grad, expected[name], f"{what} grad of {name}")
        counts[what] = {"fwd": fwd.snapshot(), "bwd": bwd.snapshot()}
    return counts


def sp_lm_case(world, cfg: ModelConfig, modes: list[str], *, sequence_parallel: bool = True) -> dict[str, float]:
    """A tiny DecoderLM with (or without) sequence parallelism and each recompute mode:
    vocab-parallel loss and every gradient against the unsharded model. Returns the bytes
    each layer kept for backward on this rank, per mode (shardwise.train.saved)."""
    comm = tp_group(world)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    target = torch.roll(ids, -1, dims=1)
    loss_ref = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    loss_ref.backward()
    plan = decoder_plan(cfg, gather_logits=False, sequence_parallel=sequence_parallel)
    expected = sharded_grads_expected(model, plan, comm)
    saved = {}
    for mode in modes:
        sharded = parallelize(copy.deepcopy(model), plan, comm=comm)
        sharded.zero_grad(set_to_none=True)
        recomputed = apply_recompute(sharded, mode)
        assert len(recomputed) == (0 if mode == "none" else cfg.num_layers), recomputed
        with SavedBytes(sharded) as kept:
            logits = sharded(ids)  # (B, T, V_pad / p): the head gathers the sequence
        loss = vocab_parallel_cross_entropy(logits, target, comm=comm).mean()
        loss.backward()
        sum_partial_grads(sharded, partial_grad_names(sharded, plan), comm=comm)
        assert_close(loss, loss_ref.detach(), f"loss, recompute {mode}")
        for name, p in sharded.named_parameters():
            assert_close(p.grad, expected[name], f"grad of {name}, recompute {mode}")
        saved[mode] = kept.mean_layer()
    return saved


def sp_train_case(world, cfg: TrainConfig) -> dict:
    """Train cfg.run.steps steps. Every rank: losses, norms, pipeline bytes sent, whether its
    replicated parameters are bitwise those of every tp rank. tp and dp rank 0 of each
    stage: first-step gradients and final weights, unsharded over tp."""
    tr = setup(world, cfg)
    mesh = tr.mesh
    lead = mesh.tp.rank == 0 and mesh.dp.rank == 0
    grads: dict[str, torch.Tensor] = {}
    step = tr.optimizer.step

    def capture(*args, **kwargs):
        if not grads:
            grads.update(full_state(_Grads(tr.model), mesh.tp, tr.specs))
        return step(*args, **kwargs)

    tr.optimizer.step = capture
    before = world.stats.copy()
    stats = [train_step(tr) for _ in range(cfg.run.steps)]
    spent = world.stats - before
    replicated = [n for n, per_rank in tr.specs.items() if per_rank[mesh.tp.rank].dim is None]
    flat = torch.cat([dict(tr.model.named_parameters())[n].detach().reshape(-1) for n in replicated])
    every = mesh.tp.all_gather(flat.unsqueeze(0), dim=0)
    state = full_state(tr.model, mesh.tp, tr.specs)  # collective over tp
    return {
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "pp_rank": mesh.pp_rank,
        "sent_bytes": spent.bytes("send", "pp"),
        "sends": spent.calls("send", "pp"),
        "reduce_scatters": spent.calls("reduce_scatter", "tp"),
        "partial_grads": tr.partial_grads,
        "tp_replicas_equal": all(torch.equal(every[0], row) for row in every),
        "grads": grads if lead else None,
        "state": state if lead else None,
    }


def sp_train_many(world, cfgs: list[TrainConfig]) -> list[dict]:
    return [sp_train_case(world, cfg) for cfg in cfgs]
