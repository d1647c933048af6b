"""One rank-aware logger for all of shardwise.

Rank 0 logs at the chosen level; other ranks log warnings and errors only, each line
prefixed with its rank, so N ranks do not print everything N times.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["get_logger", "setup_logging"]

_ROOT = "shardwise"


def get_logger(name: str = _ROOT) -> logging.Logger:
    """A logger under the shardwise hierarchy (configure it once with setup_logging)."""
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def setup_logging(rank: int = 0, world_size: int = 1, level: int | str = logging.INFO) -> logging.Logger:
    """Configure the shardwise logger for this rank; safe to call again (it replaces its handler)."""
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger
