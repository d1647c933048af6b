"""GGUF block formats, and dequantizing whole blocks of them in torch.

A GGUF tensor of shape (rows, cols) stores each row as cols / block weights' worth of
fixed-size blocks, so a row range and a range of whole blocks along the columns can be
cut out of the memory-mapped bytes and dequantized on their own. Layouts (little-endian,
d / m / dmin are fp16):

    F32, F16, BF16   1 weight per "block" of 4 / 2 / 2 bytes
    Q8_0   32 weights,  34 bytes: d, 32 x int8                    w = d * q
    Q4_0   32 weights,  18 bytes: d, 16 bytes of nibbles          w = d * (q - 8)
    Q4_1   32 weights,  20 bytes: d, m, 16 bytes of nibbles       w = d * q + m
    Q5_0   32 weights,  22 bytes: d, 4 bytes of 5th bits, nibbles w = d * (q - 16)
    Q5_1   32 weights,  24 bytes: d, m, 5th bits, nibbles        w = d * q + m
    Q4_K  256 weights, 144 bytes: d, dmin, 12 bytes of 6-bit sub-scales and sub-mins
                                  (8 sub-blocks of 32), 128 bytes of nibbles
                                  w = d * sc * q - dmin * mn
    Q5_K  256 weights, 176 bytes: Q4_K's, plus 32 bytes of 5th bits before the nibbles
    Q6_K  256 weights, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs,
                                  16 x int8 scales (sub-blocks of 16), d
                                  w = d * scale * (q - 32)

Nibble order (Q4_0, Q4_1, Q5_*): byte j holds weight j (low) and weight j + 16 (high).
K-quants: each 32-byte run of nibbles holds two sub-blocks, low nibbles first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "dequantize_blocks"]


@dataclass(frozen=True)
class Format:
    name: str
    block: int
    """Weights per block, along a row."""
    nbytes: int
    """Bytes per block."""
    decode: Callable[[torch.Tensor], torch.Tensor]
    """(n, nbytes) uint8 -> (n, block) float32."""


def _f16(raw: torch.Tensor) -> torch.Tensor:  # (n, 2k) uint8 -> (n, k) float32
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32): weight j in the low nibble of byte j, j + 16 in its high one."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count / 8) bytes -> (n, count) 0/1, bit i of byte i // 8 (little-endian words)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], count)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, head: int) -> torch.Tensor:
    """Q5_0 (head 2: d) and Q5_1 (head 4: d, m): the 5th bits follow the head."""
    q = _nibbles(b[:, head + 4 :]) | (_bits(b[:, head : head + 4], 32) << 4)
    return q.float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4) + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit sub-block scales and 8 mins, each (n, 8).

    Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7: the
    same for the mins; bytes 8-11: the low 4 bits of scale 4+i (low nibble) and min 4+i."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) bytes -> (n, 8, 32): sub-block 2i = low nibbles of bytes 32i.., 2i+1 = high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (n, 1)
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)  # bit s: sub-block s
    q = (_k_nibbles(b[:, 48:176]) | ((qh & 1) << 4)).float()
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)  # two halves of 128 weights
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).float().reshape(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _f16(b[:, 208:210])  # (n, 1)
    return ((d * scales).unsqueeze(-1) * q).reshape(n, 256)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("F32", 1, 4, lambda b: b.contiguous().view(torch.float32)),
        Format("F16", 1, 2, lambda b: b.contiguous().view(torch.float16).float()),
        Format("BF16", 1, 2, lambda b: b.contiguous().view(torch.bfloat16).float()),
        Format("Q8_0", 32, 34, _q8_0),
        Format("Q4_0", 32, 18, _q4_0),
        Format("Q4_1", 32, 20, _q4_1),
        Format("Q5_0", 32, 22, _q5_0),
        Format("Q5_1", 32, 24, _q5_1),
        Format("Q4_K", 256, 144, _q4_k),
        Format("Q5_K", 256, 176, _q5_k),
        Format("Q6_K", 256, 210, _q6_k),
    )
}
"""The types shardwise reads, by their ggml names."""


def dequantize_blocks(raw: torch.Tensor, fmt: Format) -> torch.Tensor:
    """(rows, k * nbytes) uint8 -> (rows, k * block) float32: k whole blocks of each row."""
    rows, nb = raw.shape[0], raw.shape[1] // fmt.nbytes
    if rows == 0 or nb == 0:
        return torch.zeros(rows, nb * fmt.block)
    out = fmt.decode(raw.reshape(rows * nb, fmt.nbytes))
    return out.reshape(rows, nb * fmt.block)
