"""Starting ranks: N local processes with fail-fast semantics."""

from shardwise.launch.local import JobTimeoutError, RankFailedError, free_port, launch

__all__ = ["launch", "RankFailedError", "JobTimeoutError", "free_port"]
