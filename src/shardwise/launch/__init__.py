"""Starting ranks: ours (local processes, or mpiexec's for MPI) or an external launcher's,
with fail-fast semantics."""

from shardwise.launch.env import ExternalRank, external_rank
from shardwise.launch.failfast import JobTimeoutError, RankFailedError
from shardwise.launch.local import free_port
from shardwise.launch.run import LaunchError, launch, run_job

__all__ = [
    "launch",
    "run_job",
    "RankFailedError",
    "JobTimeoutError",
    "LaunchError",
    "free_port",
    "ExternalRank",
    "external_rank",
]
