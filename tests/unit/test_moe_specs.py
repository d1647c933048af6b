"""Expert placements as ShardSpecs: every rank's pieces of the stacked `up` / `down` put back
together give the whole tensors, in both placements, even and uneven; bad tp sizes are
refused in one line naming the numbers."""

from __future__ import annotations

import pytest
import torch

from shardwise.layers import ShardError, expert_ranges, expert_specs
from shardwise.models.config import ModelConfig
from shardwise.sharding.plans import balance, check_tp, model_tp_sizes

E, H, I = 5, 4, 7  # noqa: E741


def _reassemble(tp: int, expert_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter each rank's local tensors back into place, counting how often each entry is written."""
    up, down = torch.zeros(E * 2 * I, H), torch.zeros(E * H, I)
    for r in range(tp):
        specs = expert_specs(E, H, I, tp, r, expert_parallel=expert_parallel)
        for full, spec in ((up, specs["up"]), (down, specs["down"])):
            at = 0
            for start, n in spec.pieces:
                full.narrow(spec.dim, start, n).add_(1)
                at += n
            assert spec.local_shape[spec.dim] == at
    return up, down


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_every_entry_is_held_exactly_once(tp, expert_parallel):
    up, down = _reassemble(tp, expert_parallel)
    assert torch.equal(up, torch.ones_like(up)) and torch.equal(down, torch.ones_like(down))


@pytest.mark.parametrize("tp", [2, 3])
def test_take_then_concatenate_gives_the_whole_tensors(tp):
    up, down = torch.randn(E * 2 * I, H), torch.randn(E * H, I)
    # expert parallel: the ranks' row blocks, in order, are the whole tensors
    ep = [expert_specs(E, H, I, tp, r, expert_parallel=True) for r in range(tp)]
    assert torch.equal(torch.cat([s["up"].take(up) for s in ep]), up)
    assert torch.equal(torch.cat([s["down"].take(down) for s in ep]), down)
    # tensor-parallel experts: per expert, gate and up column slices; down's column slices
    tpe = [expert_specs(E, H, I, tp, r, expert_parallel=False) for r in range(tp)]
    locals_ = [s["up"].take(up).view(E, 2, -1, H) for s in tpe]  # (E, gate|up, I/p, H)
    assert torch.equal(torch.cat(locals_, dim=2).reshape(-1, H), up)
    assert torch.equal(torch.cat([s["down"].take(down) for s in tpe], dim=1), down)


def test_uneven_expert_ranges():
    assert expert_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]


def test_bad_tp_sizes_are_refused_naming_the_numbers():
    cfg = ModelConfig.debug(num_experts=3, experts_per_token=2, expert_size=6, intermediate_size=6)
    with pytest.raises(
        ShardError, match=r"tp=4 is more than num_experts=3 with --expert-parallel; valid tp sizes: 1-3"
    ):
        check_tp(cfg, 4, expert_parallel=True)
    with pytest.raises(ShardError, match=r"tp=7 is more than expert intermediate size=6; valid tp sizes: 1-6"):
        check_tp(cfg, 7)
    assert model_tp_sizes(cfg, expert_parallel=True) == [1, 2, 3]
    with pytest.raises(ShardError, match="no experts"):
        check_tp(ModelConfig.debug(), 2, expert_parallel=True)


def test_balance_counts_experts_per_rank():
    cfg = ModelConfig.debug(num_experts=8, experts_per_token=2, expert_size=40, num_heads=4, num_kv_heads=2)
    ep = balance(cfg, 3, expert_parallel=True)
    assert ep.experts == (3, 3, 2) and ep.mlp == pytest.approx(3 * 3 / 8) and not ep.even
    assert "experts 3/3/2 per rank" in ep.describe()
    assert balance(cfg, 2, expert_parallel=True).even and balance(cfg, 2).even
    assert balance(cfg, 3).mlp == pytest.approx(14 * 3 / 40)  # width 40 over 3 in blocks of 2: 14/14/12


@pytest.mark.parametrize("src", [(2, False), (3, True)], ids=["from-tpexperts2", "from-ep3"])
@pytest.mark.parametrize("dst", [(3, False), (2, True), (4, True)], ids=["to-tpexperts3", "to-ep2", "to-ep4"])
def test_resharding_between_placements_is_arithmetic(src, dst):
    """Chunks stored by every rank of one placement (each piece of its spec) give every rank of
    another its local tensors (shardwise.checkpoint.reshard, as a checkpoint load does)."""
    from shardwise.checkpoint.reshard import assemble_any

    full = {"up": torch.randn(E * 2 * I, H), "down": torch.randn(E * H, I)}
    for name, tensor in full.items():
        stored = [expert_specs(E, H, I, src[0], r, expert_parallel=src[1])[name] for r in range(src[0])]
        dim = stored[0].dim
        chunks = [piece for spec in stored for piece in spec.pieces]

        def fetch(c, s, n, tensor=tensor, dim=dim, chunks=chunks):  # rows [s, s + n) of chunk c
            return tensor.narrow(dim, chunks[c][0] + s, n)

        def fetch_whole(c, tensor=tensor, dim=dim, chunks=chunks):
            return tensor.narrow(dim, *chunks[c])

        for r in range(dst[0]):
            want = expert_specs(E, H, I, dst[0], r, expert_parallel=dst[1])[name]
            got = assemble_any(want, torch.float32, chunks, dim, fetch, fetch_whole, what=name)
            assert torch.equal(got, want.take(tensor)), (name, r)
