"""Vocab-parallel embedding and LM head.

The vocabulary is padded up to a multiple of tp and split into equal ranges:
rank i holds rows [i * V_pad/p, (i+1) * V_pad/p) of the (V_pad, D) table. The padded
rows are zero and never looked up, and the LM head masks their logits to -inf, so a
vocabulary that tp does not divide is handled, never an error.

Embedding:  each rank looks up the ids in its range (zeros elsewhere); one all-reduce sums.
LM head:    logits_i = X E_i^T, vocab-parallel; gathered only when asked.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.comm import Communicator, copy_to_region, gather_from_region, reduce_from_region
from shardwise.comm.regions import reduce_scatter_to_sequence
from shardwise.kernels import embedding, linear
from shardwise.layers.partition import padded_size
from shardwise.layers.sequence import sequence_parallel_linear
from shardwise.layers.spec import ShardSpec

__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "VocabShard"]


class VocabShard:
    """This rank's range of a padded vocabulary."""

    def __init__(self, vocab_size: int, comm: Communicator) -> None:
        self.vocab_size = vocab_size
        self.padded = padded_size(vocab_size, comm.size)
        self.local = self.padded // comm.size
        self.start = comm.rank * self.local
        self.end = self.start + self.local
        self.real_end = min(self.end, vocab_size)
        """End of the real (unpadded) rows in this rank's range; may equal start."""

    def copy_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an unpadded (vocab_size, ...) tensor, zero-padded to `local` rows."""
        out = full.new_zeros((self.local, *full.shape[1:]))
        n = max(self.real_end - self.start, 0)
        out[:n] = full[self.start : self.start + n]
        return out

    def spec(self, global_shape: tuple[int, ...]) -> ShardSpec:
        """ShardSpec of this rank's padded rows of an unpadded (vocab_size, ...) tensor."""
        n = max(self.real_end - self.start, 0)
        return ShardSpec(tuple(global_shape), 0, ((min(self.start, self.vocab_size), n),), self.local - n)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; forward all-reduces the partial lookups.

    sequence_parallel = True: the partial lookups are reduce-scattered along the sequence
    instead, returning this rank's (B, T/p, D) shard."""

    sequence_parallel: bool = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        comm: Communicator,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard = VocabShard(num_embeddings, comm)
        self.weight = nn.Parameter(torch.empty(self.shard.local, embedding_dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.normal_()
                self.weight[max(self.shard.real_end - self.shard.start, 0) :] = 0

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *, comm: Communicator) -> VocabParallelEmbedding:
        """This rank's vocabulary rows of an existing nn.Embedding."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, comm=comm, device="meta", dtype=emb.weight.dtype)
        if emb.weight.is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        layer.weight = nn.Parameter(layer.shard.copy_rows(emb.weight.detach()))
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.shard.spec((self.num_embeddings, self.embedding_dim))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return embedding(ids, self.weight)  # (..., D)
        s = self.shard
        outside = (ids < s.start) | (ids >= s.end)  # (...,) ids another rank holds
        local_ids = (ids - s.start).masked_fill(outside, 0)
        out = embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)  # (..., D)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.comm)  # (B, T/p, D): reduce-scatter fwd, all-gather bwd
        return reduce_from_region(out, self.comm, inplace=True)  # all-reduce fwd (in place), identity bwd

    def extra_repr(self) -> str:
        s = self.shard
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.comm.size}, rows [{s.start}, {s.end}) of {s.padded}"
        )


class VocabParallelLMHead(nn.Module):
    """logits = X E^T with E split by vocabulary rows, like the embedding it may be tied to.

    forward returns this rank's (..., V_pad/p) logits with padded columns at -inf, ready
    for vocab_parallel_cross_entropy; with gather_output=True it returns the full
    (..., vocab_size) logits instead.

    sequence_parallel = True: the input is this rank's sequence shard (B, T/p, D), all-gathered
    by sequence_parallel_linear; the logits cover the whole sequence.
    """

    sequence_parallel: bool = False

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        comm: Communicator,
        bias: bool = False,
        gather_output: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.gather_output = gather_output
        self.shard = VocabShard(vocab_size, comm)
        self.weight = nn.Parameter(torch.empty(self.shard.local, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.shard.local, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            with torch.no_grad():
                nn.init.normal_(self.weight, std=hidden_size**-0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, comm: Communicator, gather_output: bool = False) -> VocabParallelLMHead:
        """This rank's vocabulary rows of an existing (hidden -> vocab) nn.Linear."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm=comm,
            bias=linear.bias is not None,
            gather_output=gather_output,
            device="meta",
            dtype=linear.weight.dtype,
        )
        if linear.weight.is_meta:  # NOTE: a model built on meta (models.meta): its meta parameters are the shard
            return layer
        layer.weight = nn.Parameter(layer.shard.copy_rows(linear.weight.detach()))
        if linear.bias is not None:
            layer.bias = nn.Parameter(layer.shard.copy_rows(linear.bias.detach()))
        return layer

    @classmethod
    def tied(cls, embedding: VocabParallelEmbedding, *, gather_output: bool = False) -> VocabParallelLMHead:
        """An LM head that shares its weight Parameter with a vocab-parallel embedding."""
        layer = cls(
            embedding.embedding_dim,
            embedding.num_embeddings,
            comm=embedding.comm,
            gather_output=gather_output,
            device="meta",
            dtype=embedding.weight.dtype,
        )
        layer.weight = embedding.weight
        return layer

    def shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": self.shard.spec((self.vocab_size, self.hidden_size))}
        if self.bias is not None:
            specs["bias"] = self.shard.spec((self.vocab_size,))
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            logits = sequence_parallel_linear(x, self.weight, self.bias, self.comm)  # (B, T/p, D) -> (B, T, V_pad/p)
        else:
            x = copy_to_region(x, self.comm)  # (..., D)   identity fwd, all-reduce bwd
            logits = linear(x, self.weight, self.bias)  # (..., V_pad/p)
        n_real = self.shard.real_end - self.shard.start
        if n_real < self.shard.local:  # NOTE: only ranks holding padded rows pay for the mask
            pad = torch.arange(self.shard.local, device=logits.device) >= n_real
            logits = logits.masked_fill(pad, float("-inf"))
        if self.gather_output:
            logits = gather_from_region(logits, self.comm)[..., : self.vocab_size]  # (..., V)
        return logits

    def extra_repr(self) -> str:
        s = self.shard
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, tp={self.comm.size}, "
            f"rows [{s.start}, {s.end}) of {s.padded}, gather_output={self.gather_output}"
        )
