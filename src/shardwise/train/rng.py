"""RNG tracker: which random stream a random op (dropout) draws from, per rank.

Megatron-LM's rule, with data parallelism added:

    stream      used for                                  same across tp ranks   same across dp ranks
    default     ops on replicated activations             yes                    no
    "tp"        ops on activations sharded over tp        no                     no

Every pipeline stage has its own streams (seeded with its pp rank too), so stages holding
different layers draw different masks.

The default stream is torch's global generator, seeded from (seed, dp rank); the "tp"
stream is a separate state, seeded from (seed, dp rank, tp rank), swapped in by
`with tracker.fork():`. So a dropout on the (replicated) residual stream draws the same
mask on every tp rank of a model replica, as the math requires, while a dropout on a
rank's own attention heads draws its own mask, and different replicas (dp) draw
different masks.

States are plain uint8 tensors (torch.get_rng_state), saved in checkpoints as tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["RNGTracker", "stream_seed"]

_TP_OFFSET = 2718  # Megatron's offset between the default and the model-parallel seed


def stream_seed(seed: int, *, dp_rank: int, tp_rank: int | None, step: int = 0, pp_rank: int = 0) -> int:
    """A 63-bit seed for one stream: tp_rank None = the default (replicated) stream.
    Each pipeline stage draws its own (pp_rank 0 keeps the seeds a pp = 1 run draws)."""
    h = seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + dp_rank * 0x94D049BB133111EB
    h += pp_rank * 0x2545F4914F6CDD1D
    if tp_rank is not None:
        h += (_TP_OFFSET + tp_rank) * 0xD6E8FEB86659FD93
    h ^= h >> 31
    return h % (2**63 - 1)


class RNGTracker:
    """The default and the tp-sharded random streams of one rank."""

    def __init__(self, seed: int, *, tp_rank: int, dp_rank: int, pp_rank: int = 0, device: str = "cpu") -> None:
        self.seed, self.tp_rank, self.dp_rank, self.pp_rank, self.device = seed, tp_rank, dp_rank, pp_rank, device
        self._tp_state: torch.Tensor | None = None
        self.reseed(step=0)

    def reseed(self, step: int) -> None:
        """Seed both streams as a function of (seed, step, ranks): used at start, and on resuming
        at a different layout, where the saved per-rank states do not map onto the new ranks."""
        ranks = {"dp_rank": self.dp_rank, "pp_rank": self.pp_rank, "step": step}
        torch.manual_seed(stream_seed(self.seed, tp_rank=None, **ranks))
        tp_seed = stream_seed(self.seed, tp_rank=self.tp_rank, **ranks)
        self._tp_state = torch.Generator(device=self.device).manual_seed(tp_seed).get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the tp-sharded stream; the default stream is untouched by it."""
        saved = self._get()
        self._set(self._tp_state)
        try:
            yield
        finally:
            self._tp_state = self._get()
            self._set(saved)

    def state(self) -> dict[str, torch.Tensor]:
        """Both streams' states, as uint8 tensors (for a checkpoint)."""
        return {"default": self._get().clone(), "tp": self._tp_state.clone()}

    def load_state(self, states: dict[str, torch.Tensor]) -> None:
        self._set(states["default"])
        self._tp_state = states["tp"].clone()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)
