"""Fixtures and markers shared by every test.

Markers: a test under tests/multiproc or tests/e2e is `slow` (left out of `make test-fast`)
unless it is marked `smoke`: one representative case of each kind. A unit test that is
slow says so with @pytest.mark.slow.
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


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(__file__).parent
    for item in items:
        path = Path(str(item.path))
        in_slow_dir = path.is_relative_to(root) and path.relative_to(root).parts[0] in _SLOW_DIRS
        if in_slow_dir and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def rank_pool():
    """Pooled gloo ranks: rank_pool.run(fn, world_size, args=...) runs a case without launching a job."""
    pool = RankPool()
    yield pool
    pool.close()
