"""train.optim.sum_of_squares (GradNorm's per-parameter sum and the distributed optimizer's, a chunk of rows at a time in
fp64) against the whole-tensor formula: 0-d, 1-d, 2-d and 3-d gradients, row and column
masks, chunks smaller than a row, of a few rows, and larger than the tensor."""

from __future__ import annotations

import pytest
import torch

from shardwise.train import optim


def _whole(g: torch.Tensor, mask: torch.Tensor | None, dim: int) -> torch.Tensor:
    sq = g.double().pow(2)
    if mask is not None:
        if sq.dim():
            shape = [1] * sq.dim()
            shape[dim] = -1
            sq = sq * mask.view(shape)
        else:
            sq = sq * mask.any()
    return sq.sum()


@pytest.mark.parametrize("chunk", [1, 7, 40, 1 << 20])
@pytest.mark.parametrize("shape", [(), (13,), (9, 5), (6, 4, 3)])
@pytest.mark.parametrize("masked", [None, 0, 1])
def test_chunked_sum_of_squares_matches_the_whole_tensor(monkeypatch, chunk, shape, masked):
    monkeypatch.setattr(optim, "_CHUNK", chunk)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    mask = dim = None
    if masked is not None and len(shape) > masked:
        dim = masked
        mask = torch.arange(shape[dim]) % 3 != 1  # some rows (or columns) are another rank's
    elif masked is not None and not shape:
        mask, dim = torch.tensor([False]), 0  # a 0-d gradient on a rank that does not own it
    got = optim.sum_of_squares(g, mask, dim or 0)
    want = _whole(g, mask, dim or 0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
