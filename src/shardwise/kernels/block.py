"""Block-format weights: a rank's matrix kept in GGUF block layouts and multiplied as stored.

    w = BlockWeight.of([("Q4_K", raw_q), ("Q6_K", raw_v)], in_features=2048)   # fused q|k|v
    y = w.linear(x)                # x (..., in) -> y (..., out), in x's dtype
    rows = w.lookup(ids)           # an embedding table's rows, dequantized

A BlockWeight is a stack of parts along the output rows, each one format (a fused q/k/v
whose v came from a Q6_K tensor and q, k from Q4_K ones; float parts for tensors a file
stores as F16/F32). A linear quantizes the activation rows once per block length (32 for
Q8_0/Q4_x/Q5_x, 256 for the K-quants: shardwise/kernels/csrc/sw.h) and runs each part's
integer kernel into its columns of y. Rows are independent, so a column-parallel rank
holds whole rows of the file's blocks; a row-parallel rank holds a run of whole blocks of
every row (cut on block boundaries: the loader checks).

Like the QuantizedWeight it replaces, a BlockWeight is not a Parameter (nothing trains it)
and answers `.shape`, `.dtype` and `.device` as the float weight did.

The arithmetic (native or fallback, every ISA):
    y[i, r] = sum over blocks b of  dw[r, b] * da[i, b] * (q_w[r, b] . q_a[i, b])  (+ offsets)
with the activations quantized symmetrically per block, d = amax / 127, round half to even
(the K-quants' blocks of 256: each 32 with its own scale d m_j, m_j in 1 .. A256_M: fake_quantize).
The PyTorch fallback computes the same thing in floats (dequantized weights times
dequantized activation blocks), so both agree to fp32 rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import shardwise.kernels.native as native
from shardwise.kernels.blocks import FORMATS, Format, dequantize_blocks

__all__ = [
    "GGML_IDS",
    "NATIVE_FORMATS",
    "Part",
    "BlockWeight",
    "quantize_activations",
    "fake_quantize",
    "offer_blocks",
    "act_block",
]

GGML_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
"""The block formats computed as stored, by their ggml type ids (csrc/sw.h)."""
NATIVE_FORMATS = tuple(GGML_IDS)
FLOAT_FORMATS = ("F32", "F16", "BF16")
_ACT_BYTES = {32: 40, 256: 316}
"""Bytes of one activation block (sw_a32, sw_a256)."""
A256_M = 8
"""sw_a256's sub-scales m_j run 1 .. A256_M (csrc/sw.h's SW_A256_M)."""
PREFILL_ROWS: int | None = (
    int(os.environ["SHARDWISE_PREFILL_ROWS"]) if os.environ.get("SHARDWISE_PREFILL_ROWS") else None
)
"""From this many activation rows on, a block-format part is dequantized a tile of rows at
a time and multiplied by MKL in fp32 with unquantized activations; None (the default): the
integer kernels at every row count. With the SIMD kernels the integer path measured faster
at every size tried (benchmarks/bench_block_linear.py, table in
docs/benchmarks/native-kernels.md: 2.7-3.8x at 64-512 rows on AMD EPYC, AVX-512),
as llama.cpp computes prefill. SHARDWISE_PREFILL_ROWS=N sets a threshold: exact fp32
activations for prefill (no 8-bit activation cost, about 0.5% of perplexity on SmolLM2),
at MKL's speed."""
_TILE_WEIGHTS = 1 << 20
"""Weights dequantized at a time on the prefill path (4 MiB of fp32)."""


@dataclass(frozen=True)
class Part:
    """Rows of a BlockWeight in one format: `data` is (rows, blocks * bytes) uint8 for a block
    format, or a (rows, in) float tensor for a float one."""

    fmt: str
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _fmt(name: str) -> Format:
    return FORMATS[name]


def fake_quantize(x: torch.Tensor, block: int, m_max: int = A256_M) -> torch.Tensor:
    """x (n, k) float32 -> the activation blocks' values (n, k), what every kernel multiplies by
    (csrc/act.c, sw.h). Blocks of 32: d * round(x / d), d = amax / 127. Blocks of 256 (the
    K-quants'): each 32 of them (sub-block j) with the scale s_j = d * m_j, d = amax / (127 M),
    m_j = ceil(M amax_j / amax) in 1 .. M: s_j * round(x / s_j). M = m_max, the kernels'
    A256_M (1: one scale per 256, llama.cpp's Q8_K; benchmarks/ppl_activation_blocks.py)."""
    n, k = x.shape
    if block == 256:
        xb = x.reshape(n, k // 256, 8, 32)
        sub = xb.abs().amax(-1, keepdim=True)  # (n, k / 256, 8, 1)
        amax = sub.amax(-2, keepdim=True)  # (n, k / 256, 1, 1)
        d = amax / float(127 * m_max)
        m = torch.where(amax > 0, torch.ceil(m_max * sub / torch.where(amax > 0, amax, 1.0)), 1.0).clamp(1, m_max)
        s = d * m
        q = torch.round(xb * torch.where(s > 0, 1.0 / s, torch.zeros_like(s)))
        return (q * s).reshape(n, k)
    xb = x.reshape(n, k // block, block)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xb * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)))
    return (q * d).reshape(n, k)


def quantize_activations(x: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """x: n contiguous rows of k float32 (any shape) -> n * k / block activation blocks (uint8 bytes), native."""
    out = torch.empty(n * (k // block) * _ACT_BYTES[block], dtype=torch.uint8)
    native.lib.quantize(block, native.isa(), x.data_ptr(), k, n, k, out.data_ptr())
    return out


_offered: tuple | None = None
"""(tensor, its version, block, activation blocks): the last RMSNorm output quantized in the
same native call (kernels.ops.rms_norm(block=...)); the next linear of that block length on
that very tensor, unmodified, takes these blocks instead of quantizing it again. The strong
reference keeps the tensor's memory from being reused while it is offered."""


def offer_blocks(x: torch.Tensor, block: int, blocks: torch.Tensor) -> None:
    """x (..., k) fp32 contiguous was quantized to `blocks` of `block`: offer them to its next linear."""
    global _offered
    _offered = (x, x._version, block, blocks)


def _taken(x: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor | None:
    """The offered blocks, when x (n contiguous rows of k) is the offered tensor, unchanged, in blocks of `block`."""
    o = _offered
    if o is None or o[2] != block:
        return None
    t = o[0]
    if t.data_ptr() != x.data_ptr() or o[1] != x._version or t.shape[-1] != k or t.numel() != n * k:
        return None
    return o[3]


def act_block(w) -> int | None:
    """The one activation block length a weight's linear quantizes its input to, when every
    part is a native block format of that length and the input needs no padding; else None."""
    if not isinstance(w, BlockWeight) or w.padded_in != w.shape[1]:
        return None
    blocks = {FORMATS[p.fmt].block if p.fmt in GGML_IDS else 0 for p in w.parts}
    return blocks.pop() if len(blocks) == 1 and 0 not in blocks else None


class BlockWeight:
    """A (out, in) linear weight (or embedding table) held as block-format parts; see the module docstring."""

    __slots__ = ("parts", "shape", "dtype", "device", "nbytes", "padded_in", "_offsets")

    def __init__(self, parts: list[Part], in_features: int, *, dtype: torch.dtype = torch.float32) -> None:
        if not parts:
            raise ValueError("a BlockWeight needs at least one part")
        padded = in_features
        for p in parts:
            if p.fmt in FLOAT_FORMATS:
                if p.data.dim() != 2 or p.data.shape[1] != in_features:
                    raise ValueError(f"a float part is ({p.rows}, {in_features}), got {tuple(p.data.shape)}")
                continue
            if p.fmt not in GGML_IDS:
                raise ValueError(f"format {p.fmt} has no kernel; block formats computed as stored: {NATIVE_FORMATS}")
            f = _fmt(p.fmt)
            blocks = -(-in_features // f.block)
            if p.data.dtype != torch.uint8 or p.data.dim() != 2 or p.data.shape[1] != blocks * f.nbytes:
                raise ValueError(
                    f"a {p.fmt} part of {in_features} columns is ({p.rows}, {blocks * f.nbytes}) uint8 "
                    f"({blocks} blocks of {f.nbytes} bytes), got {tuple(p.data.shape)} {p.data.dtype}"
                )
            padded = max(padded, blocks * f.block)
        for p in parts:  # NOTE: a width not a multiple of the block is padded with zero weights (int8 of odd widths)
            if p.fmt not in FLOAT_FORMATS and -(-in_features // _fmt(p.fmt).block) * _fmt(p.fmt).block != padded:
                raise ValueError(f"parts of {in_features} columns pad to different widths: {[q.fmt for q in parts]}")
        self.parts = [Part(p.fmt, p.data.contiguous()) for p in parts]
        self.shape = torch.Size((sum(p.rows for p in parts), in_features))
        self.dtype, self.device = dtype, parts[0].data.device
        self.nbytes = sum(p.nbytes for p in self.parts)
        self.padded_in = padded
        offsets, o = [], 0
        for p in self.parts:
            offsets.append(o)
            o += p.rows
        self._offsets = offsets
        if any(p.fmt in GGML_IDS for p in self.parts):
            native.note_fallback()

    @classmethod
    def of(cls, parts: list[tuple[str, torch.Tensor]], in_features: int, *, dtype=torch.float32) -> BlockWeight:
        return cls([Part(f, d) for f, d in parts], in_features, dtype=dtype)

    @property
    def formats(self) -> list[str]:
        return sorted({p.fmt for p in self.parts})

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def narrow(self, start: int, n: int) -> BlockWeight:
        """Rows [start, start + n) (one expert's block of a stacked expert tensor), sharing memory."""
        parts, o = [], 0
        for p in self.parts:
            lo, hi = max(start, o), min(start + n, o + p.rows)
            if lo < hi:
                parts.append(Part(p.fmt, p.data[lo - o : hi - o]))
            o += p.rows
        return BlockWeight(parts, self.shape[1], dtype=self.dtype)

    # ---- compute -------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype, plus bias when given."""
        out, k = self.shape
        lead = x.shape[:-1]
        if x.dtype is torch.float32 and self.padded_in == k and x.is_contiguous():
            x2 = x  # read in place as (N, in) rows: no reshape, no copy (a decode step's usual case)
        else:
            x2 = x.reshape(-1, k)  # (N, in)
            if x2.dtype is not torch.float32:
                x2 = x2.float()
            if self.padded_in != k:
                x2 = F.pad(x2, (0, self.padded_in - k))
            x2 = x2.contiguous()
        n = x2.numel() // self.padded_in if self.padded_in else 0
        y = torch.empty(*lead, out)  # (..., out)
        if n and out:
            self._run(x2, n, y)
        if y.dtype is not x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias

    def _run(self, x: torch.Tensor, n: int, y: torch.Tensor) -> None:
        """y (N rows of out) = x (N contiguous rows of padded in) times every part, into its
        columns. The native kernels where built (else the same arithmetic in torch); from
        PREFILL_ROWS rows on (when set), tiles of dequantized rows against the float activations
        on either path."""
        kp = self.padded_in
        lib = native.lib if x.device.type == "cpu" else None
        acts: dict[int, torch.Tensor] = {}  # activation blocks, once per block length
        rows: torch.Tensor | None = None  # x as (N, padded in), made only where a torch op needs it
        ld = self.shape[0]
        for p, o in zip(self.parts, self._offsets, strict=True):
            f = None if p.fmt in FLOAT_FORMATS else _fmt(p.fmt)
            if f is None or lib is None or (PREFILL_ROWS is not None and n >= PREFILL_ROWS):
                rows = x.view(n, kp) if rows is None else rows
                y2 = y.view(n, ld)
            if f is None:
                y2[:, o : o + p.rows] = F.linear(rows[:, : self.shape[1]], p.data.float())
                continue
            if PREFILL_ROWS is not None and n >= PREFILL_ROWS:  # tiles of dequantized rows through MKL
                step = max(1, _TILE_WEIGHTS // kp)
                for r in range(0, p.rows, step):
                    e = min(r + step, p.rows)
                    y2[:, o + r : o + e] = F.linear(rows, _dequantize(p.fmt, p.data[r:e]).to(x.device))
                continue
            a = acts.get(f.block)
            if a is None and lib is not None:
                a = _taken(x, n, kp, f.block)  # quantized with the op before it, in one call
            if a is None:
                a = quantize_activations(x, n, kp, f.block) if lib else fake_quantize(x.view(n, kp), f.block)
            acts[f.block] = a
            if lib is None:
                y2[:, o : o + p.rows] = F.linear(a, dequantize_blocks(p.data, f).to(x.device))
                continue
            lib.gemm(
                GGML_IDS[p.fmt], native.isa(), p.data.data_ptr(), p.data.stride(0), p.rows, kp // f.block,
                a.data_ptr(), n, y.data_ptr() + 4 * o, ld,
            )  # fmt: skip

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float (len(rows), in) matrix of rows `rows` (all when None), in float32."""
        pieces = []
        for p, o in zip(self.parts, self._offsets, strict=True):
            sel = None if rows is None else rows[(rows >= o) & (rows < o + p.rows)] - o
            data = p.data if sel is None else p.data.index_select(0, sel)
            if p.fmt in FLOAT_FORMATS:
                pieces.append(data.float())
            else:
                pieces.append(_dequantize(p.fmt, data)[:, : self.shape[1]])
        if rows is None or len(pieces) == 1:
            return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        # rows spanning parts: put them back in the order asked
        order = torch.cat(
            [
                torch.nonzero((rows >= o) & (rows < o + p.rows)).flatten()
                for p, o in zip(self.parts, self._offsets, strict=True)
            ]
        )
        out = torch.empty(len(rows), self.shape[1])
        out[order] = torch.cat(pieces)
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of an embedding table held in blocks -> (*ids.shape, in) in self.dtype."""
        flat = ids.reshape(-1)
        return self.dequantize(flat).view(*ids.shape, self.shape[1]).to(self.dtype)

    def __repr__(self) -> str:
        fm = "+".join(f"{p.fmt}x{p.rows}" for p in self.parts)
        return f"BlockWeight({fm}, shape={tuple(self.shape)}, {self.nbytes} bytes)"


def _dequantize(fmt: str, data: torch.Tensor) -> torch.Tensor:
    """(rows, blocks * bytes) uint8 -> (rows, blocks * block) float32, natively where built."""
    f = _fmt(fmt)
    lib = native.lib
    if lib is not None and data.device.type == "cpu" and data.shape[0]:
        data = data.contiguous()
        kb = data.shape[1] // f.nbytes
        out = torch.empty(data.shape[0], kb * f.block)
        try:  # the next ISA down when this one has no dequantizer for the format
            lib.dequantize(
                GGML_IDS[fmt], native.isa(), data.data_ptr(), data.stride(0), data.shape[0], kb, out.data_ptr()
            )
            return out
        except ValueError:  # no dequantizer for the format at all (yet): the torch decoder
            pass
    return dequantize_blocks(data, f)
