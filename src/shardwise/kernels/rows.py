"""A matrix received a block of rows at a time, kept in the form a quantized weight is built
from, so that converting never holds a whole tensor in full precision.

    rows = Rows.for_weight((out, inp), "int8", device="cpu")
    for chunk in chunks:               # (n, inp) float tensors, in row order
        rows.add(chunk)                # quantized on arrival; the chunk can be freed now
    QuantizedWeight(rows, "int8")      # packed from the int8 buffer

Per-row int8 scales (amax / qmax of one row) need only that row, so each block is
quantized into a preallocated int8 buffer as it arrives: the result equals quantizing the
whole matrix at once, bit for bit. Forms (`kind`):

    int8   q int8 (rows, cols) and scale fp32 (rows,); `fbgemm`: rounded by
           torch.quantize_per_channel (the CPU kernel's input), else round-and-clamp
           (int8_rows: CUDA weights and embedding tables)
    fp16   a half-precision buffer
    fp32   a float buffer: fbgemm's fp16 prepack takes float32, so on CPU an fp16 weight
           still holds its whole matrix in float32 once (as before; int8 never does)
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["CPU_QMAX", "Rows", "row_scales", "int8_rows"]

CPU_QMAX = 63
"""Weight levels of fbgemm's int8 linear on CPU: [-63, 63] (see shardwise.quant.weights)."""


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


def _fbgemm_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) as torch.quantize_per_channel rounds for fbgemm: |w / scale| <= 63, no clamping."""
    scale = row_scales(w, CPU_QMAX)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still fbgemm's input
        q = torch.quantize_per_channel(
            w.detach().float(), scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8
        )
    return q.int_repr(), scale


class Rows:
    """A (rows, cols) matrix filled a block of rows at a time, in order (see the module docstring)."""

    __slots__ = ("shape", "kind", "fbgemm", "dtype", "device", "data", "scale", "filled")

    def __init__(
        self,
        shape: tuple[int, int],
        kind: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fbgemm: bool = False,
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"a quantized matrix is 2-D (rows, cols), got shape {tuple(shape)}")
        if kind not in ("int8", "fp16", "fp32"):
            raise ValueError(f"unknown row form {kind!r}")
        self.shape, self.kind, self.fbgemm = torch.Size(shape), kind, fbgemm
        self.dtype, self.device = dtype, torch.device(device)
        """The model's dtype and device: what the converted weight answers to."""
        store = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}[kind]
        self.data = torch.empty(self.shape, dtype=store, device=self.device)
        self.scale = torch.empty(shape[0], dtype=torch.float32, device=self.device) if kind == "int8" else None
        self.filled = 0

    @staticmethod
    def for_weight(shape, scheme: str, *, dtype=torch.float32, device="cpu") -> Rows:
        """The form a QuantizedWeight of `scheme` on `device` is packed from."""
        on_cpu = torch.device(device).type == "cpu"
        if scheme == "int8":
            return Rows(shape, "int8", dtype=dtype, device=device, fbgemm=on_cpu)
        if scheme == "fp16":
            return Rows(shape, "fp32" if on_cpu else "fp16", dtype=dtype, device=device)
        raise ValueError(f"unknown quantization scheme {scheme!r}")

    @staticmethod
    def for_table(shape, scheme: str, *, dtype=torch.float32, device="cpu") -> Rows:
        """The form a QuantizedTable of `scheme` keeps its rows in."""
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
        if self.kind == "int8":
            q, scale = _fbgemm_int8(w) if self.fbgemm else int8_rows(w)
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
        out.shape, out.kind, out.fbgemm = torch.Size((n, self.shape[1])), self.kind, self.fbgemm
        out.dtype, out.device = self.dtype, self.device
        out.data = self.data[start : start + n]
        out.scale = None if self.scale is None else self.scale[start : start + n]
        out.filled = n
        return out
