"""Weights packed for a stock kernel: fp16 (fbgemm on CPU, half precision on CUDA), and int8
on CUDA (dequantized into the product: memory saved at rest, no int8 arithmetic).

    QuantizedWeight(w, "fp16")    # a rank's local (out, in) matrix, packed once at load
    QuantizedTable(w, "int8")     # an embedding table of int8 rows (CUDA) or fp16 rows

int8 on CPU is not here: it is a Q8_0 BlockWeight (shardwise.kernels.block), computed by
the native block kernels with activations quantized per block of 32 (the fbgemm dynamic
int8 path it replaces quantized each activation tensor with one scale and needed
PyTorch's deprecated quantized tensors; on the real SmolLM2-135M it raised perplexity by
70%: docs/benchmarks/quantization.md).

A QuantizedWeight is not a Parameter (nothing trains it, and it is not in state_dict) but
answers `.shape`, `.dtype` and `.device` as the tensor did, so code that reads local
widths off a weight's shape runs unchanged.

Kernels (measured: benchmarks/bench_kernels.py):
    CPU   fp16  torch.ops.quantized.linear_dynamic_fp16 on a prepacked float weight (fbgemm)
    CUDA  fp16  F.linear in half precision
          int8  F.linear on the weight dequantized per call (one scale per output row)
Activations and results stay in the model's dtype; fbgemm computes from fp32 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels.rows import Rows

__all__ = ["QuantizedWeight", "QuantizedExperts", "QuantizedTable"]


class QuantizedWeight:
    """A (out, in) linear weight in `scheme` ("fp16" or "int8"), packed for its device's kernel.

    w: the float matrix, or its Rows (shardwise.quant.rows) filled a block of rows at a time
    (Rows.for_weight), which is how the loaders convert without a float copy of the whole."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "_packed", "_w", "_scale")

    def __init__(self, w: torch.Tensor | Rows, scheme: str) -> None:
        if isinstance(w, torch.Tensor):
            if w.dim() != 2:
                raise ValueError(f"a linear weight is 2-D (out, in), got shape {tuple(w.shape)}")
            w = Rows.of(w, Rows.for_weight(w.shape, scheme, dtype=w.dtype, device=w.device))
        rows = w.done()
        self.scheme, self.shape, self.dtype, self.device = scheme, rows.shape, rows.dtype, rows.device
        self._packed = self._w = self._scale = None
        out, inp = rows.shape
        on_cpu = rows.device.type == "cpu"
        if scheme == "fp16":
            self.nbytes = 2 * out * inp
            if not on_cpu:
                self._w = rows.data
            elif out and inp:
                self._packed = torch.ops.quantized.linear_prepack_fp16(rows.data, None)  # from fp32 rows
        elif scheme == "int8":
            if on_cpu:
                raise ValueError("int8 on CPU is a Q8_0 BlockWeight (shardwise.kernels.block), not a QuantizedWeight")
            self.nbytes = out * inp + 4 * out
            self._w, self._scale = rows.data, rows.scale.to(rows.dtype)
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
            else:
                y = torch.ops.quantized.linear_dynamic_fp16(x2, self._packed)  # (N, out)
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
    """Stacked expert weights (E * rows, in), one QuantizedWeight per expert's block; w a
    float tensor or its Rows (Rows.for_weight), as for QuantizedWeight."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "blocks")

    def __init__(self, w: torch.Tensor | Rows, num_experts: int, scheme: str) -> None:
        if isinstance(w, torch.Tensor):
            w = Rows.of(w, Rows.for_weight(w.shape, scheme, dtype=w.dtype, device=w.device))
        rows = w.done()
        self.scheme, self.shape, self.dtype, self.device = scheme, rows.shape, rows.dtype, rows.device
        per = rows.shape[0] // num_experts
        self.blocks = [QuantizedWeight(rows.narrow(e * per, per), scheme) for e in range(num_experts)]
        self.nbytes = sum(b.nbytes for b in self.blocks)

    def __repr__(self) -> str:
        return (
            f"QuantizedExperts({self.scheme}, {len(self.blocks)} x {tuple(self.blocks[0].shape)}, {self.nbytes} bytes)"
        )


class QuantizedTable:
    """An embedding table (rows, dim): fp16 rows, or int8 rows with one fp32 scale per row;
    w a float tensor or its Rows (Rows.for_table)."""

    __slots__ = ("scheme", "shape", "dtype", "device", "nbytes", "_t", "_scale")

    def __init__(self, w: torch.Tensor | Rows, scheme: str) -> None:
        if isinstance(w, torch.Tensor):
            w = Rows.of(w, Rows.for_table(w.shape, scheme, dtype=w.dtype, device=w.device))
        rows = w.done()
        self.scheme, self.shape, self.dtype, self.device = scheme, rows.shape, rows.dtype, rows.device
        self._t, self._scale = rows.data, rows.scale
        self.nbytes = rows.data.numel() * rows.data.element_size() + (0 if rows.scale is None else 4 * rows.shape[0])

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self._t).to(self.dtype)  # (..., dim)
        return rows if self._scale is None else rows * self._scale[ids].unsqueeze(-1).to(self.dtype)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def __repr__(self) -> str:
        return f"QuantizedTable({self.scheme}, shape={tuple(self.shape)}, {self.nbytes} bytes)"
