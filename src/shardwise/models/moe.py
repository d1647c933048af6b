"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a router, stacked experts, an
optional shared expert. Plain single-device modules, like the rest of models/.

    router     logits = x @ gate^T                         (N, E)
    routing    top-k of softmax(logits) (renormalized when norm_topk_prob)
    experts    y = sum_k w_k * down_e(act(gate_e(x)) * up_e(x)) over the k chosen experts e
    shared     y += [sigmoid(x @ shared_gate^T)] * shared_mlp(x)   (Qwen2-MoE)

The experts' weights are stacked in two 2-D tensors, one row block per expert:

    up    (E * 2I, H)   expert e's rows [e*2I, e*2I + I) are its gate, the next I its up
    down  (E * H, I)    expert e's rows [e*H, (e+1)*H)

so a sharding plan cuts experts like any other weight (shardwise.layers.spec pieces):
whole row blocks for expert parallelism, each expert's gate/up rows and down columns for
tensor-parallel experts. An `Experts` module holds a contiguous run of experts starting
at `first` (0 unless expert-parallel) with widths read from its weights' shapes, and
computes the routed sum over the experts it holds only: a partial sum that the
parallel twin completes with one all-reduce (shardwise.layers.moe).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.kernels import expert_blocks, linear
from shardwise.models.config import ModelConfig
from shardwise.models.modules import ACTIVATIONS, MLP

__all__ = ["route", "Experts", "MoE", "load_balancing_loss", "moe_blocks"]


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) -> routing weights (N, k) in the logits' dtype, expert ids (N, k)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, idx = torch.topk(probs, k, dim=-1)  # (N, k) each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), idx


class Experts(nn.Module):
    """A contiguous run of gated-MLP experts, stacked (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, width: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.first = 0
        """Global id of the first expert held (expert parallelism holds a range)."""
        self.up = nn.Parameter(torch.empty(num_experts * 2 * width, hidden))  # (E * 2I, H)
        self.down = nn.Parameter(torch.empty(num_experts * hidden, width))  # (E * H, I)

    @property
    def num_local(self) -> int:
        """Experts held here: from the weights' shapes, sharded or not."""
        return self.down.shape[0] // self.up.shape[1]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H); idx, weights (N, k): global expert ids and routing weights
        -> (N, H): the weighted outputs of the experts held here (zero rows elsewhere)."""
        N, H = x.shape
        E, k = self.num_local, idx.shape[1]
        up = expert_blocks(self.up, E)  # E x (2I, H)
        down = expert_blocks(self.down, E)  # E x (H, I)
        local = (idx - self.first).reshape(-1)  # (N * k,)
        mine = ((local >= 0) & (local < E)).nonzero().squeeze(1)  # positions in (N * k) routed here
        expert = local[mine]
        order = expert.argsort(stable=True)
        mine, expert = mine[order], expert[order]  # grouped by expert
        counts = torch.bincount(expert, minlength=E).tolist()
        tokens = mine // k  # (M,) the token of each routed pair
        outs = []
        for e, xe in enumerate(x[tokens].split(counts)):  # (n_e, H) each
            if xe.shape[0]:
                gate, up_ = linear(xe, up[e]).chunk(2, dim=-1)  # (n_e, I) each
                outs.append(linear(self.act(gate) * up_, down[e]))  # (n_e, H)
        if not outs:
            return x.new_zeros(N, H) + 0 * x  # keeps the graph (and dtype) when nothing is routed here
        y = torch.cat(outs) * weights.reshape(-1)[mine].unsqueeze(1)  # (M, H)
        return x.new_zeros(N, H).index_add(0, tokens, y)

    def tokens_per_expert(self, idx: torch.Tensor) -> torch.Tensor:
        """(E_local,) how many routed (token, k) pairs each expert held here receives."""
        local = (idx - self.first).reshape(-1)
        local = local[(local >= 0) & (local < self.num_local)]
        return torch.bincount(local, minlength=self.num_local)


class MoE(nn.Module):
    """A sparse MLP: router, routed experts, optional (gated) shared expert. (B, T, H) -> (B, T, H)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.expert_size, cfg.act)
        self.shared = None
        self.shared_gate = None
        if cfg.shared_expert_size:
            shared_cfg = replace(cfg, intermediate_size=cfg.shared_expert_size, gated_mlp=True, mlp_bias=False)
            self.shared = MLP(shared_cfg)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.router_logits: torch.Tensor | None = None
        """The last forward's router logits (N, E), for the load-balancing loss."""
        self.routed: torch.Tensor | None = None
        """The last forward's expert ids (N, k), for load statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        logits = self.gate(flat)  # (N, E)
        weights, idx = route(logits, self.top_k, self.normalize)  # (N, k) each
        self.router_logits, self.routed = logits, idx
        y = self.experts(flat, idx, weights)  # (N, H)
        if self.shared is not None:
            s = self.shared(flat)  # (N, H)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(flat)) * s
            y = y + s
        return y.view(shape)


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE blocks of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int, sum_over=None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, as transformers computes it (load_balancing_loss_func
    without a mask): num_experts * sum_e (share of top-k picks that went to e) * (mean
    router probability of e), the statistics pooled over every layer's tokens.

    sum_over: a function that sums a tensor over the ranks holding other tokens (an autograd
    all-reduce over dp), so the loss is the one the whole global batch would give."""
    picks = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    probs = torch.zeros_like(picks)
    rows = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    for layer in logits:
        p = F.softmax(layer, dim=-1, dtype=torch.float32)  # (N, E)
        _, idx = torch.topk(p, top_k, dim=-1)
        picks = picks + torch.bincount(idx.reshape(-1), minlength=num_experts).float()
        probs = probs + p.sum(dim=0)
        rows = rows + p.shape[0]
    if sum_over is not None:
        stats = sum_over(torch.cat([picks, probs, rows.reshape(1)]))
        picks, probs, rows = stats[:num_experts], stats[num_experts:-1], stats[-1]
    return num_experts * torch.sum((picks / rows) * (probs / rows))
