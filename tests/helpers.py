"""Shared test utilities: tolerances, the expected shard of an unsharded gradient, parameter grids."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from shardwise.comm import Communicator, LocalCommunicator, tp_only
from shardwise.sharding import Plan, shard_grads_like

# fp32: sharding only reorders sums, so errors stay at a few ulps of the magnitudes.
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (eps = 2**-8). A row-parallel layer rounds each rank's
# partial sum to bf16 and the all-reduce adds the partials in bf16: up to tp + 1
# roundings of eps/2 each, ~ 2.5 * eps at tp=4. 4 * eps of the tensor's scale covers it.
BF16_TOL = 4 * 2**-8


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Tight for fp32, scale-relative 4 ulps for bf16/fp16 (see BF16_TOL)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.dtype in (torch.bfloat16, torch.float16):
        a, e = actual.float(), expected.float()
        scale = max(e.abs().max().item(), 1e-3)
        torch.testing.assert_close(a, e, rtol=BF16_TOL, atol=BF16_TOL * scale, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, rtol=FP32_TOL, atol=FP32_TOL, msg=lambda m: f"{what}: {m}")


def sharded_grads_expected(model: nn.Module, plan: Plan, comm: Communicator) -> dict[str, torch.Tensor]:
    """This rank's expected gradient of every parameter of parallelize(model, plan)."""
    return shard_grads_like(model, plan, comm=comm)


def tp_group(world: Communicator) -> Communicator:
    """The whole world as one tensor-parallel group (named "tp" in the accounting)."""
    return tp_only(world)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class NoCollectives(LocalCommunicator):
    """A rank of a size-4 group on which any collective is a test failure."""

    def __init__(self, rank: int = 0, size: int = 4) -> None:
        super().__init__(name="tp")
        self.rank, self.size = rank, size

    def _all_reduce(self, t, op):
        raise AssertionError("a collective ran during plan validation")

    _all_gather = _reduce_scatter = _broadcast = _all_reduce

    def _barrier(self):
        raise AssertionError("a collective ran during plan validation")


def grid(*axes: list, smoke: Callable[..., bool] = lambda *values: False) -> list:
    """The product of parameter axes as pytest params (a tuple entry fills several names);
    those for which smoke(*values) holds are marked `smoke`: they run in `make test-fast`."""
    params = []
    for combo in itertools.product(*axes):
        values = [v for part in combo for v in (part if isinstance(part, tuple) else (part,))]
        params.append(pytest.param(*values, marks=[pytest.mark.smoke] if smoke(*values) else []))
    return params
