"""Training data: a token file, its samples, and a dp-aware sampler.

Token file: a safetensors file holding one 1-D tensor `tokens` (uint16 when the
vocabulary fits, else int32), with metadata `vocab_size` and the sha256 of the text and
tokenizer it came from. It is memory-mapped; a batch reads only its own windows.

Samples are the non-overlapping windows  tokens[i*L : i*L + L + 1]  (inputs = the first
L, targets = the last L). The sampler fixes a global order, a fresh permutation every
epoch, independent of the layout: step s uses samples

    order[s*G : (s+1)*G]     G = global batch size

and dp rank d takes the d-th contiguous 1/dp of them, cut into micro-batches. So the
data of a step, and the loss (a mean over all its tokens), do not depend on tp, dp or the
micro-batch size, and a run resumed at any layout sees the same batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["TokenFile", "DPSampler", "write_token_file", "tokenize_text", "DataError"]

TOKENS_KEY = "tokens"


class DataError(ValueError):
    """A token file or text that cannot be used; the message names the file."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_token_file(path: str | Path, ids: torch.Tensor, *, vocab_size: int, source: dict | None = None) -> Path:
    """Write 1-D token ids atomically (temporary file, then rename)."""
    path = Path(path)
    if ids.dim() != 1:
        raise DataError(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DataError(f"token ids must lie in [0, vocab_size={vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    dtype = torch.uint16 if vocab_size <= 2**16 else torch.int32
    meta = {"vocab_size": str(vocab_size), "source": json.dumps(source or {}, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({TOKENS_KEY: ids.to(torch.int64).to(dtype).contiguous()}, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def tokenize_text(text: str | Path, tokenizer: str | Path, out: str | Path, *, vocab_size: int) -> Path:
    """Tokenize a UTF-8 text file into a token file at `out`; reuse `out` if it came from the same inputs."""
    text, tokenizer, out = Path(text), Path(tokenizer), Path(out)
    for p, what in ((text, "data.text"), (tokenizer, "model.tokenizer")):
        if not p.is_file():
            raise DataError(f"{what} file {p} does not exist")
    source = {"text": str(text), "text_sha256": _sha256_file(text), "tokenizer_sha256": _sha256_file(tokenizer)}
    if out.exists():
        try:
            with safe_open(str(out), framework="pt") as f:
                if json.loads(f.metadata().get("source", "{}")) == source:
                    return out
        except (OSError, ValueError, json.JSONDecodeError):
            pass  # a stale or broken cache: rewrite it
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"{tokenizer} has {tok.get_vocab_size()} tokens but model.vocab_size={vocab_size}")
    paragraphs = text.read_text(encoding="utf-8").split("\n\n")
    encoded = tok.encode_batch([p + "\n\n" for p in paragraphs])
    ids = torch.tensor([i for e in encoded for i in e.ids], dtype=torch.int64)
    return write_token_file(out, ids, vocab_size=vocab_size, source=source)


class TokenFile:
    """The samples of a token file: windows of seq_len + 1 tokens, read from the memory map."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path, self.seq_len = Path(path), seq_len
        if not self.path.is_file():
            raise DataError(f"token file {self.path} does not exist")
        try:
            self._file = safe_open(str(self.path), framework="pt")
            self._tokens = self._file.get_slice(TOKENS_KEY)
            meta = self._file.metadata() or {}
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise DataError(f"{self.path}: not a token file ({e})") from None
        shape = self._tokens.get_shape()
        if len(shape) != 1:
            raise DataError(f"{self.path}: tensor {TOKENS_KEY!r} must be 1-D, got shape {shape}")
        self.num_tokens = shape[0]
        self.vocab_size = int(meta.get("vocab_size", 0)) or None
        self.num_samples = (self.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(f"{self.path}: {self.num_tokens} tokens make no sample of seq_len={seq_len} + 1")

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(indices), seq_len) int64."""
        L = self.seq_len
        rows = [self._tokens[i * L : i * L + L + 1].to(torch.int64) for i in indices]
        window = torch.stack(rows)  # (B, L + 1)
        return window[:, :-1], window[:, 1:]


class DPSampler:
    """Which samples each micro-batch of each step holds, on one dp rank."""

    def __init__(
        self, num_samples: int, *, global_batch: int, micro_batch: int, dp: int, dp_rank: int, seed: int
    ) -> None:
        per_rank, rest = divmod(global_batch, dp)
        if rest or per_rank % micro_batch:
            raise DataError(
                f"global batch {global_batch} does not split into dp={dp} ranks of micro-batches of {micro_batch}"
            )
        if not 0 <= dp_rank < dp:
            raise DataError(f"dp_rank={dp_rank} is outside dp={dp}")
        self.num_samples, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.grad_accum = per_rank // micro_batch
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_samples, generator=g)
        return self._order

    def global_indices(self, step: int) -> list[int]:
        """Every sample of `step`, in order (all dp ranks together)."""
        out = []
        for pos in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch, i = divmod(pos, self.num_samples)
            out.append(int(self._perm(epoch)[i]))
        return out

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's samples of `step`: grad_accum lists of micro_batch indices."""
        per_rank = self.global_batch // self.dp
        mine = self.global_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [mine[m * self.micro_batch : (m + 1) * self.micro_batch] for m in range(self.grad_accum)]
