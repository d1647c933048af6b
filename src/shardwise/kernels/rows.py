"""A matrix received a block of rows at a time, kept in the form its converted weight is
built from, so that converting never holds a whole tensor in full precision.

    rows = Rows.for_weight((out, inp), "int8", device="cpu")    # Q8_0 blocks on CPU
    for chunk in chunks:               # (n, inp) float tensors, in row order
        rows.add(chunk)                # converted on arrival; the chunk can be freed now
    Target.convert(rows)               # shardwise.quant.convert: the weight it becomes

Every form needs only the rows of a chunk (block formats and int8 scale each row's own
blocks), so filling a block of rows at a time equals converting the whole matrix at
once, bit for bit. Forms (`kind`):

    blocks   a block format (`fmt`: Q8_0, Q4_K, ...): (rows, blocks * bytes) uint8 in GGUF's
             layout (shardwise.kernels.quantize); every scheme on CPU but fp16, int8 = Q8_0
    int8     q int8 (rows, cols) and one fp32 scale per row (CUDA weights)
    fp16     a half-precision buffer
    fp32     a float buffer: fbgemm's fp16 prepack takes float32, so on CPU an fp16 weight
             still holds its whole matrix in float32 once
"""

from __future__ import annotations

import torch

from shardwise.kernels.blocks import FORMATS
from shardwise.kernels.quantize import quantize_rows
from shardwise.memory import empty_huge

__all__ = ["Rows", "row_scales", "int8_rows", "BLOCK_SCHEMES", "block_format"]

BLOCK_SCHEMES = {"int8": "Q8_0", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
                 "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}  # fmt: skip
"""`--quantize` schemes stored as block formats on CPU (int8 is Q8_0: 8-bit weights, one
fp16 scale per 32)."""


def block_format(scheme: str, device: str | torch.device = "cpu") -> str | None:
    """The block format `scheme` is stored in on `device`, or None (a packed scheme)."""
    if torch.device(device).type != "cpu":
        return None
    return BLOCK_SCHEMES.get(scheme)


def row_scales(w: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    """fp32 (rows,): amax / qmax of each row of a (rows, cols) matrix; 1 for a row of zeros."""
    amax = w.detach().abs().amax(dim=1).float() if w.shape[1] else w.new_zeros(w.shape[0], dtype=torch.float32)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def int8_rows(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a (rows, cols) float matrix: (q int8 (rows, cols) in
    [-qmax, qmax], scale fp32 (rows,)), w ~= q * scale[:, None]. A row of zeros gets scale 1."""
    scale = row_scales(w, qmax)
    q = torch.round(w.detach().float() / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


class Rows:
    """A (rows, cols) matrix filled a block of rows at a time, in order (see the module docstring)."""

    __slots__ = ("shape", "kind", "fmt", "dtype", "device", "data", "scale", "filled")

    def __init__(
        self,
        shape: tuple[int, int],
        kind: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fmt: str | None = None,
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"a quantized matrix is 2-D (rows, cols), got shape {tuple(shape)}")
        if kind not in ("blocks", "int8", "fp16", "fp32"):
            raise ValueError(f"unknown row form {kind!r}")
        self.shape, self.kind, self.fmt = torch.Size(shape), kind, fmt
        self.dtype, self.device = dtype, torch.device(device)
        """The model's dtype and device: what the converted weight answers to."""
        if kind == "blocks":
            f = FORMATS[fmt]
            # streamed every decode step: on transparent huge pages (shardwise.memory.empty_huge)
            self.data = empty_huge((shape[0], -(-shape[1] // f.block) * f.nbytes), torch.uint8)
        else:
            store = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}[kind]
            self.data = torch.empty(self.shape, dtype=store, device=self.device)
        self.scale = torch.empty(shape[0], dtype=torch.float32, device=self.device) if kind == "int8" else None
        self.filled = 0

    @staticmethod
    def for_weight(shape, scheme: str, *, dtype=torch.float32, device="cpu") -> Rows:
        """The form a weight of `scheme` on `device` is built from."""
        fmt = block_format(scheme, device)
        if fmt is not None:
            return Rows(shape, "blocks", dtype=dtype, device=device, fmt=fmt)
        if scheme == "int8":
            return Rows(shape, "int8", dtype=dtype, device=device)
        if scheme == "fp16":
            on_cpu = torch.device(device).type == "cpu"
            return Rows(shape, "fp32" if on_cpu else "fp16", dtype=dtype, device=device)
        raise ValueError(f"unknown quantization scheme {scheme!r}")

    @staticmethod
    def for_table(shape, scheme: str, *, dtype=torch.float32, device="cpu") -> Rows:
        """The form an embedding table of `scheme` keeps its rows in."""
        fmt = block_format(scheme, device)
        if fmt is not None:
            return Rows(shape, "blocks", dtype=dtype, device=device, fmt=fmt)
        if scheme not in ("int8", "fp16"):
            raise ValueError(f"unknown quantization scheme {scheme!r}")
        return Rows(shape, scheme, dtype=dtype, device=device)

    @staticmethod
    def of(w: torch.Tensor, rows: Rows) -> Rows:
        """`rows` filled with the whole of w at once."""
        rows.add(w)
        return rows.done()

    def add(self, w: torch.Tensor) -> None:
        """The next w.shape[0] rows (float, any dtype), converted into the buffer now."""
        n = w.shape[0]
        if w.dim() != 2 or w.shape[1] != self.shape[1] or self.filled + n > self.shape[0]:
            raise ValueError(
                f"rows {self.filled}..{self.filled + n} of shape {tuple(w.shape)} do not fit a {tuple(self.shape)} matrix"
            )
        at = slice(self.filled, self.filled + n)
        if self.kind == "blocks":
            self.data[at] = quantize_rows(w, self.fmt)
        elif self.kind == "int8":
            q, scale = int8_rows(w)
            self.data[at], self.scale[at] = q, scale
        else:
            self.data[at] = w.detach()  # cast to the buffer's dtype
        self.filled += n

    def done(self) -> Rows:
        """self, once every row has arrived."""
        if self.filled != self.shape[0]:
            raise ValueError(f"{self.filled} of {self.shape[0]} rows arrived for a {tuple(self.shape)} matrix")
        return self

    def narrow(self, start: int, n: int) -> Rows:
        """Rows [start, start + n) of a filled matrix, sharing its buffers (one expert's block)."""
        out = Rows.__new__(Rows)
        out.shape, out.kind, out.fmt = torch.Size((n, self.shape[1])), self.kind, self.fmt
        out.dtype, out.device = self.dtype, self.device
        out.data = self.data[start : start + n]
        out.scale = None if self.scale is None else self.scale[start : start + n]
        out.filled = n
        return out
