"""The reshard arithmetic as a property: for random tensor shapes, split dims and tp sizes,
chunks written by one layout, read back through plan_reads/assemble for any rank of
another layout, give exactly ShardSpec.take of the whole tensor. Plus the real model's
specs at tp 1, 2, 4 (padded vocabulary, replicated KV heads) in every direction, and the
pipeline stages' share of the parameters at several splits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint import CheckpointError, assemble, check_cover, plan_reads
from shardwise.checkpoint.stages import held_names, stage_layout, stage_names
from shardwise.layers import ShardSpec
from shardwise.models.config import ModelConfig
from shardwise.train.layout import all_rank_specs, local_segments, owned_intervals, rank_specs


def _even_specs(shape: tuple[int, ...], dim: int, tp: int, replicas: int = 1) -> list[ShardSpec]:
    """tp ranks over `dim`, padded like a vocabulary when tp does not divide it; `replicas`
    consecutive ranks hold the same rows (like KV heads replicated when tp > num_kv_heads)."""
    groups = tp // replicas
    size = shape[dim]
    width = -(-size // groups)
    specs = []
    for r in range(tp):
        g = r // replicas
        start = min(g * width, size)
        n = max(min(width, size - start), 0)
        specs.append(ShardSpec(shape, dim, ((start, n),), width - n))
    return specs


def _chunks_from(specs: list[ShardSpec], full: torch.Tensor) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """What a checkpoint of this layout stores: each rank's owned rows, cut from its local tensor."""
    intervals, data = [], []
    for r, spec in enumerate(specs):
        local = spec.take(full)
        for start, length in owned_intervals(specs, r):
            for l_start, g_start, n in local_segments(spec):
                if g_start <= start < g_start + n:
                    intervals.append((start, length))
                    data.append(local.narrow(spec.dim, l_start + start - g_start, length))
    return intervals, data


@st.composite
def _case(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    dim = draw(st.integers(0, ndim - 1))
    tp_from, tp_to = draw(st.sampled_from([1, 2, 3, 4, 8])), draw(st.sampled_from([1, 2, 3, 4, 8]))
    rep_from = draw(st.sampled_from([d for d in (1, 2, 4) if tp_from % d == 0]))
    rep_to = draw(st.sampled_from([d for d in (1, 2, 4) if tp_to % d == 0]))
    return shape, dim, tp_from, rep_from, tp_to, rep_to


@settings(max_examples=200, deadline=None)
@given(_case())
def test_any_layout_reads_back_exactly(case):
    shape, dim, tp_from, rep_from, tp_to, rep_to = case
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    intervals, data = _chunks_from(_even_specs(shape, dim, tp_from, rep_from), full)
    check_cover(intervals, shape[dim], what="t")  # every row stored exactly once

    def fetch(i, start, length):
        return data[i].narrow(dim, start, length)

    for spec in _even_specs(shape, dim, tp_to, rep_to):
        got = assemble(spec, torch.float32, plan_reads(intervals, spec), fetch)
        assert torch.equal(got, spec.take(full))


@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 30))
def test_check_cover_accepts_exactly_one_cover(lengths, span):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    chunks = [(s, n) for s, n in zip(starts, lengths, strict=True) if n]
    if sum(lengths) == span:
        check_cover(chunks, span, what="t")
    else:
        with pytest.raises(CheckpointError):
            check_cover(chunks, span, what="t")


def test_gap_and_overlap_are_named():
    with pytest.raises(CheckpointError, match=r"rows \[4, 6\) of 10 are in no chunk"):
        check_cover([(0, 4), (6, 4)], 10, what="t")
    with pytest.raises(CheckpointError, match=r"rows \[3, 4\) are stored twice"):
        check_cover([(0, 4), (3, 7)], 10, what="t")
    with pytest.raises(CheckpointError, match=r"rows \[2, 4\) needed by this rank are in no chunk"):
        plan_reads([(0, 2), (4, 6)], ShardSpec((10,), 0, ((1, 5),)))


CFG = ModelConfig(
    family="llama", vocab_size=515, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip


@pytest.mark.parametrize("tp_from,tp_to", [(1, 4), (4, 1), (2, 4), (4, 2), (4, 4)])
def test_model_specs_reshard_between_tp_sizes(tp_from, tp_to):
    """The decoder's real specs: fused [q;k;v] rows, replicated KV heads at tp=4, padded vocab."""
    src, dst = all_rank_specs(CFG, tp_from), all_rank_specs(CFG, tp_to)
    for name, specs in src.items():
        full = torch.randn(specs[0].global_shape)
        if specs[0].dim is None:
            continue
        intervals, data = _chunks_from(specs, full)
        check_cover(intervals, full.shape[specs[0].dim], what=name)
        for spec in dst[name]:
            fetch = lambda i, s, n, d=spec.dim, data=data: data[i].narrow(d, s, n)  # noqa: E731
            got = assemble(spec, full.dtype, plan_reads(intervals, spec), fetch)
            assert torch.equal(got, spec.take(full)), name


@pytest.mark.parametrize(
    "pp,virtual,split,tied",
    [(1, 1, None, False), (2, 1, None, True), (2, 1, [3, 1], False), (4, 1, None, True), (2, 2, None, True),
     (3, 1, [1, 2, 1], True)],
)  # fmt: skip
def test_pipeline_stages_own_every_parameter_once(pp, virtual, split, tied):
    """What a checkpoint's stages write: every parameter of the model by exactly one stage, each
    stage only what it holds, the tied embedding by stage 0 though the last stage holds a copy."""
    cfg = replace(CFG, num_layers=4, tie_embeddings=tied)
    layout = stage_layout(cfg, pp, virtual, split)
    owned = stage_names(cfg, layout)
    flat = [n for names in owned for n in names]
    assert sorted(flat) == sorted(rank_specs(cfg, 1, 0)) and len(flat) == len(set(flat))
    for rank, names in enumerate(owned):
        held = held_names(cfg, layout, rank)
        assert set(names) <= set(held)
        layers = {int(n.split(".")[1]) for n in held if n.startswith("layers.")}
        assert layers == set(layout.layers_of(rank))
    assert "embed.weight" in owned[0]
    if pp > 1:
        assert ("embed.weight" in held_names(cfg, layout, pp - 1)) == tied
