"""Communication: parallel layout, communicators, accounting and autograd collectives."""

from shardwise.comm.accounting import CommStats, OpCount
from shardwise.comm.agree import AgreedError, agree
from shardwise.comm.alltoall import AllToAll, all_to_all
from shardwise.comm.communicator import (
    DEFAULT_TIMEOUT_S,
    CollectiveError,
    Communicator,
    LocalCommunicator,
    P2PMismatchError,
    ReduceOp,
)
from shardwise.comm.dims import Mesh, ParallelDims, tp_only
from shardwise.comm.regions import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    scatter_to_sequence,
)
from shardwise.comm.shm import ShmCommunicator, intra_host
from shardwise.comm.tcp import TcpCommunicator, across_hosts

__all__ = [
    "AllToAll",
    "all_to_all",
    "AgreedError",
    "agree",
    "CommStats",
    "OpCount",
    "CollectiveError",
    "P2PMismatchError",
    "Communicator",
    "LocalCommunicator",
    "ReduceOp",
    "DEFAULT_TIMEOUT_S",
    "Mesh",
    "ParallelDims",
    "tp_only",
    "ShmCommunicator",
    "intra_host",
    "TcpCommunicator",
    "across_hosts",
    "copy_to_region",
    "gather_from_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
]
