"""Starting ranks: N local processes with fail-fast semantics."""

from shardwise.launch.env import ExternalRank, external_rank
from shardwise.launch.local import JobTimeoutError, RankFailedError, free_port, launch
from shardwise.launch.run import run_job

__all__ = ["launch", "run_job", "RankFailedError", "JobTimeoutError", "free_port", "ExternalRank", "external_rank"]
