"""Checkpointer: what the training loop calls to save and resume (shardwise.train.loop.Checkpointer)."""

from __future__ import annotations

from pathlib import Path

from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint
from shardwise.train import Trainer

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves under `root` (default: <run.out_dir>/checkpoints), keeping the last run.keep_last."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else None

    def _root(self, tr: Trainer) -> Path:
        return self.root if self.root is not None else Path(tr.cfg.run.out_dir) / "checkpoints"

    def save(self, tr: Trainer) -> Path:
        return save_checkpoint(tr, self._root(tr), keep_last=tr.cfg.run.keep_last)

    def resume(self, tr: Trainer, source: str) -> None:
        """source: a checkpoint directory, a directory with a `latest` pointer, or "latest"."""
        load_checkpoint(tr, str(self._root(tr)) if source == "latest" else source)
