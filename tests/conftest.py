"""Fixtures and markers shared by every test.

Three tiers, each a superset of the one before:
- `make test-fast` leaves out `slow`: a test under tests/multiproc or tests/e2e is `slow`
  unless it is marked `smoke` (one representative case of each kind); a unit test that
  is slow says so with @pytest.mark.slow.
- `make test` (CI's gate, under 5 minutes) leaves out `full`: a test under tests/e2e is
  `full` unless it is marked `smoke` or `gate` (each command's representative end-to-end
  cases); elsewhere a test that starts its own job (mpiexec, a fresh launch) where a
  cheaper case in the gate covers the same code says so with @pytest.mark.full.
- `make test-more` runs only the `full` tests, `make test-full` both (CI runs the gate, then
  `make test-more`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_pool import RankPool
from shardwise.launch import local

# Ranks forked in this process (the pools, launch() in tests) skip the imports that building
# an optimizer and allocating meta-built models trigger (~1.5 s of CPU per training rank).
local.PRELOAD += ["torch._dynamo", "torch.fx.experimental.symbolic_shapes"]

_SLOW_DIRS = ("multiproc", "e2e")
_FULL_DIRS = ("e2e",)


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(__file__).parent
    for item in items:
        path = Path(str(item.path))
        top = path.relative_to(root).parts[0] if path.is_relative_to(root) else ""
        smoke = item.get_closest_marker("smoke") is not None
        if top in _SLOW_DIRS and not smoke:
            item.add_marker(pytest.mark.slow)
        if top in _FULL_DIRS and not smoke and item.get_closest_marker("gate") is None:
            item.add_marker(pytest.mark.full)


@pytest.fixture(scope="session")
def rank_pool():
    """Pooled gloo ranks: rank_pool.run(fn, world_size, args=...) runs a case without launching a job."""
    pool = RankPool()
    yield pool
    pool.close()
