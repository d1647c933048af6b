"""Quantized weights and the one function per operation that runs them.

    linear(x, w, b)      w: a Tensor (F.linear) or a QuantizedWeight (its kernel)
    embedding(ids, w)    w: a Tensor (F.embedding) or a QuantizedTable (rows dequantized)

Every parallel layer calls these instead of F.linear / F.embedding, so a layer holds either
kind of weight and runs the same code. A QuantizedWeight is a rank's local (out, in)
matrix, converted once when it is loaded; it is not a Parameter (nothing trains it, and it
is not in state_dict) but answers `.shape`, `.dtype` and `.device` as the tensor did, so
code that reads local widths off a weight's shape runs unchanged.

Scales (int8): one per output row of the local matrix, amax / qmax over that row's local
columns. A column-parallel slice holds whole rows, so its scales are the unsharded ones at
every tp; a row-parallel slice holds a run of each row's columns, so its scale covers only
that run (finer than the unsharded row's, never straddling two ranks).

Kernels (measured: benchmarks/bench_kernels.py):
    CPU   fp16  torch.ops.quantized.linear_dynamic_fp16 on a prepacked weight (fbgemm)
          int8  torch.ops.quantized.linear_dynamic (fbgemm; activations quantized per call,
                per tensor, to 8 bits). AVX2 has no VNNI: fbgemm multiplies u8 activations
                by s8 weights in pairs summed into int16 (vpmaddubsw), which saturates when
                2 * 255 * |w| > 32767. fbgemm's usual remedy (reduce_range) halves the
                activations' range; here the weights use [-63, 63] instead (qmax = 63), so
                no pair can saturate and the activations keep all 8 bits. Measured on the
                built-in model (4 x 256 tokens of its text): perplexity +3.1% with
                reduce_range and 127-level weights, +0.3% with 63-level weights and 8-bit
                activations (docs/benchmarks.md "Quantized weights").
    CUDA  fp16  F.linear in half precision
          int8  F.linear on the weight dequantized per call (stock PyTorch; saves memory at rest)
Activations and results stay in the model's dtype; fbgemm computes from fp32 inputs.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

__all__ = ["QuantizedWeight", "QuantizedExperts", "QuantizedTable", "linear", "embedding", "expert_blocks", "int8_rows"]


CPU_QMAX = 63
"""Weight levels of fbgemm's int8 linear on CPU: [-63, 63] (see the module docstring)."""


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


class QuantizedWeight:
    """A (out, in) linear weight in `scheme` ("fp16" or "int8"), packed for its device's kernel."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "_packed", "_w", "_scale")

    def __init__(self, w: torch.Tensor, scheme: str) -> None:
        if w.dim() != 2:
            raise ValueError(f"a linear weight is 2-D (out, in), got shape {tuple(w.shape)}")
        self.scheme, self.shape, self.dtype, self.device = scheme, w.shape, w.dtype, w.device
        self._packed = self._w = self._scale = None
        out, inp = w.shape
        on_cpu = w.device.type == "cpu"
        if scheme == "fp16":
            self.nbytes = 2 * out * inp
            if not on_cpu:
                self._w = w.detach().to(torch.float16)
            elif out and inp:
                self._packed = torch.ops.quantized.linear_prepack_fp16(w.detach().float(), None)
        elif scheme == "int8":
            self.nbytes = out * inp + 4 * out
            if not on_cpu:
                q, scale = int8_rows(w)
                self._w, self._scale = q, scale.to(w.dtype)
            elif out and inp:
                scale = row_scales(w, CPU_QMAX)  # |w / scale| <= 63: no clamping needed
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # quantized tensors are deprecated, still fbgemm's input
                    qw = torch.quantize_per_channel(
                        w.detach().float(), scale.double(), torch.zeros(out, dtype=torch.long), 0, torch.qint8
                    )  # (out, in) int8: the only copy made besides the packed weight
                self._packed = torch.ops.quantized.linear_prepack(qw, None)
        else:
            raise ValueError(f"unknown quantization scheme {scheme!r}")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype, plus bias (in the model's dtype) when given."""
        out, inp = self.shape
        lead = x.shape[:-1]
        if self._packed is None and self._w is None:  # an empty slice: nothing to multiply
            y = x.new_zeros((*lead, out))
        elif self._w is not None:  # CUDA: stock F.linear
            w = self._w.to(x.dtype) if self.scheme == "fp16" else self._w.to(x.dtype) * self._scale[:, None]
            y = F.linear(x.to(w.dtype), w)
        else:
            x2 = x.reshape(-1, inp)  # (N, in)
            if x2.dtype is not torch.float32:
                x2 = x2.float()
            if x2.shape[0] == 0:
                y = x2.new_zeros((0, out))
            elif self.scheme == "fp16":
                y = torch.ops.quantized.linear_dynamic_fp16(x2, self._packed)  # (N, out)
            else:
                y = torch.ops.quantized.linear_dynamic(x2, self._packed, False)  # (N, out), 8-bit activations
            if len(lead) != 1:  # NOTE: a decode step's (B, 1, in) input: no-op views and casts cost per call
                y = y.view(*lead, out)
            if y.dtype is not x.dtype:
                y = y.to(x.dtype)
        return y if bias is None else y + bias

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.scheme}, shape={tuple(self.shape)}, {self.nbytes} bytes, {self.device})"


class QuantizedExperts:
    """Stacked expert weights (E * rows, in), one QuantizedWeight per expert's block."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "blocks")

    def __init__(self, w: torch.Tensor, num_experts: int, scheme: str) -> None:
        self.scheme, self.shape, self.dtype, self.device = scheme, w.shape, w.dtype, w.device
        self.blocks = [QuantizedWeight(b, scheme) for b in w.view(num_experts, -1, w.shape[1]).unbind(0)]
        self.nbytes = sum(b.nbytes for b in self.blocks)

    def __repr__(self) -> str:
        return (
            f"QuantizedExperts({self.scheme}, {len(self.blocks)} x {tuple(self.blocks[0].shape)}, {self.nbytes} bytes)"
        )


class QuantizedTable:
    """An embedding table (rows, dim): fp16 rows, or int8 rows with one fp32 scale per row."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "_t", "_scale")

    def __init__(self, w: torch.Tensor, scheme: str) -> None:
        self.scheme, self.shape, self.dtype, self.device = scheme, w.shape, w.dtype, w.device
        self._scale = None
        if scheme == "fp16":
            self._t = w.detach().to(torch.float16)
            self.nbytes = 2 * w.numel()
        elif scheme == "int8":
            self._t, self._scale = int8_rows(w)
            self.nbytes = w.numel() + 4 * w.shape[0]
        else:
            raise ValueError(f"unknown quantization scheme {scheme!r}")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self._t).to(self.dtype)  # (..., dim)
        return rows if self._scale is None else rows * self._scale[ids].unsqueeze(-1).to(self.dtype)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def __repr__(self) -> str:
        return f"QuantizedTable({self.scheme}, shape={tuple(self.shape)}, {self.nbytes} bytes)"


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x w^T + b for a float weight (F.linear) or a QuantizedWeight (its kernel)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w.linear(x, bias)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of a float table (F.embedding) or a QuantizedTable."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    return w.lookup(ids)


def expert_blocks(w, num_experts: int) -> list:
    """Each expert's weight of a stacked (E * rows, in) expert tensor: views of a float
    tensor, or the blocks of a QuantizedExperts."""
    if isinstance(w, torch.Tensor):
        return list(w.view(num_experts, -1, w.shape[1]).unbind(0))
    return w.blocks
