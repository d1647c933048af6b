"""Expert-parallel token dispatch: ranks hold different tokens AND different experts.

Each rank of `group` holds a contiguous run of experts (`owners[r]` = [start, end) of global
expert ids, e.g. shardwise.layers.partition.split_ranges(E, group.size, unit=1)) and its own
tokens. Every routed (token, choice) pair goes to the rank owning its expert, is computed
there, and comes back:

    x (N, H), idx (N, k), weights (N, k)          this rank's tokens and routing
    sort the N*k pairs by expert id                (grouped by owner, owners being in order)
    send_sizes[d] = pairs for rank d's experts     recv_sizes: one all_to_all of the counts
    rows  = all_to_all(x[token of each pair])      (M, H)   the pairs this rank's experts get
    ids   = all_to_all(expert id of each pair)     (M,)     (no gradient)
    out   = experts(rows, ids, 1)                  (M, H)   unweighted expert outputs
    back  = all_to_all(out, sizes swapped)         (N*k, H) in this rank's sorted pair order
    y     = sum over each token's k pairs of weight * back      (N, H)

The routing weights are applied here, at the source, after the return trip, so the weights
never travel and their gradient is local; gradients reach x (through both all_to_alls'
backwards, which are all_to_alls with the sizes swapped: shardwise.comm.alltoall), the
routing weights, and the experts' weights on their owners.

Collectives per call: 4 all_to_alls forward (counts, rows, ids, results) and 2 backward.
Every rank of `group` must call it, with tokens or without (N = 0 is fine), and run the
backward when its x or weights require grad (as every rank's do, in training).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.comm.alltoall import all_to_all
from shardwise.comm.communicator import Communicator
from shardwise.models.moe import Experts

__all__ = ["dispatch_experts", "ExpertDispatch", "check_owners"]


def check_owners(owners: list[tuple[int, int]], group: Communicator, experts: Experts) -> int:
    """The number of experts E; a ValueError naming the numbers unless `owners` cuts [0, E)
    into one contiguous range per rank of `group`, in rank order, this rank's being the
    experts it holds."""
    if len(owners) != group.size:
        raise ValueError(f"owners has {len(owners)} ranges for a group {group.name!r} of {group.size} ranks")
    end = 0
    for r, (lo, hi) in enumerate(owners):
        if lo != end or hi < lo:
            raise ValueError(f"owners {owners}: rank {r}'s range [{lo}, {hi}) does not start at {end}")
        end = hi
    held = (experts.first, experts.first + experts.num_local)
    if tuple(owners[group.rank]) != held:
        raise ValueError(
            f"owners {owners} give rank {group.rank} experts [{owners[group.rank][0]}, {owners[group.rank][1]}) "
            f"but its Experts hold [{held[0]}, {held[1]})"
        )
    return end


def dispatch_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: Experts,
    group: Communicator,
    owners: list[tuple[int, int]],
) -> torch.Tensor:
    """x (N, H); idx, weights (N, k): global expert ids and routing weights of this rank's
    tokens -> (N, H): sum_k weights * expert_idx(x), the experts computed on their owners
    (see the module docstring). Bad input raises ValueError before any collective."""
    E = check_owners(owners, group, experts)
    if x.dim() != 2 or idx.dim() != 2 or idx.shape != weights.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"dispatch_experts: x {tuple(x.shape)}, idx {tuple(idx.shape)}, weights {tuple(weights.shape)} "
            "must be (N, H), (N, k), (N, k)"
        )
    N, H = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)  # (N*k,) the expert of each pair
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < E:
        raise ValueError(
            f"dispatch_experts: expert ids span [{int(flat.min())}, {int(flat.max())}], not within [0, {E})"
        )
    order = flat.argsort(stable=True)  # (N*k,) pairs grouped by expert, hence by owner
    per_expert = torch.bincount(flat, minlength=E).tolist()  # (E,)
    send_sizes = [sum(per_expert[lo:hi]) for lo, hi in owners]  # pairs for each rank
    recv_sizes = group.all_to_all_sizes(send_sizes)  # pairs from each rank
    tokens = order // k  # (N*k,) the token of each pair, in sent order
    rows = all_to_all(x[tokens], group, send_sizes, recv_sizes)  # (M, H)
    ids = group.all_to_all(flat[order], send_sizes, recv_sizes)  # (M,)
    ones = rows.new_ones(ids.shape[0], 1)  # (M, 1): weights are applied at the source
    out = experts(rows, ids.unsqueeze(1), ones)  # (M, H)
    back = all_to_all(out, group, recv_sizes, send_sizes)  # (N*k, H) in sent order
    w = weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)  # (N*k, 1)
    return x.new_zeros(N, H).index_add(0, tokens, back * w)  # (N, H)


class ExpertDispatch(nn.Module):
    """`experts` (this rank's run of them) behind the token dispatch over `group`: the
    expert-parallel twin of an `Experts` holding all of them, called the same way."""

    def __init__(self, experts: Experts, group: Communicator, owners: list[tuple[int, int]]) -> None:
        super().__init__()
        self.experts, self.group, self.owners = experts, group, [tuple(o) for o in owners]
        self.num_experts = check_owners(self.owners, group, experts)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H); idx, weights (N, k) -> (N, H)."""
        return dispatch_experts(x, idx, weights, self.experts, self.group, self.owners)
