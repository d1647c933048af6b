"""Float rows -> block-format bytes (what `--quantize q8_0 / int8 / q4_k ...` stores).

    raw = quantize_rows(w, "Q4_K")     # w (rows, in) float -> (rows, blocks * 144) uint8

Every format's layout is shardwise.kernels.blocks' (GGUF's), so the result decodes with
the same reference dequantizer and runs on the same kernels as a file's own tensors. A
width that is not a whole number of blocks is padded with zero weights (the kernels pad
the activations to match). Rows are independent, so a matrix can be converted a block of
rows at a time and equal the whole at once, bit for bit.

Scales are chosen in one pass (no search): for the 32-weight formats, the gguf package's
own quantizers where it is installed (Q8_0 is written here as well, it is the int8 path);
for the K-quants, here: each sub-block's range sets its scale (and min), and the sub-block
scales are themselves quantized to 6 bits (Q4_K, Q5_K) or 8 bits (Q6_K) against one fp16
super-block scale, as the format stores them.
"""

from __future__ import annotations

import torch

from shardwise.kernels.blocks import FORMATS

__all__ = ["quantize_rows", "QUANTIZABLE"]

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _padded(w: torch.Tensor, block: int) -> torch.Tensor:
    w = w.detach().float()
    pad = -w.shape[1] % block
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:  # (..., ) float -> (..., 2) uint8
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(*v.shape, 2)


def _safe_inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d > 0, 1.0 / d, torch.zeros_like(d))


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0]
    wb = w.reshape(rows, -1, 32)  # (rows, blocks, 32)
    d = wb.abs().amax(-1) / 127.0
    q = torch.round(wb * _safe_inv(d)[..., None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=-1).reshape(rows, -1)


def _via_gguf(w: torch.Tensor, fmt: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    return torch.from_numpy(raw.copy()).reshape(w.shape[0], -1)


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes (the inverse of blocks._k_scales)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    out = torch.empty(sc.shape[0], 12, dtype=torch.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _k_nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """(n, 8, 32) values 0..15 -> (n, 128) bytes: bytes 32i.. hold sub-block 2i (low) and 2i + 1 (high)."""
    q = q.to(torch.uint8).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_5_k(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Q4_K (bits 4) / Q5_K (bits 5): w = d * sc * q - dmin * mn per sub-block of 32."""
    rows = w.shape[0]
    levels = (1 << bits) - 1
    x = w.reshape(-1, 8, 32)  # (n super-blocks, 8 sub-blocks, 32)
    lo = x.amin(-1).clamp(max=0.0)  # (n, 8): the offset is a min <= 0
    hi = x.amax(-1)
    scale = (hi - lo) / levels
    d = scale.amax(-1) / 63.0  # (n,)
    dmin = (-lo).amax(-1) / 63.0
    d16, dmin16 = d.to(torch.float16).float(), dmin.to(torch.float16).float()
    sc = torch.round(scale * _safe_inv(d16)[:, None]).clamp_(0, 63)
    mn = torch.round(-lo * _safe_inv(dmin16)[:, None]).clamp_(0, 63)
    step = d16[:, None] * sc  # (n, 8)
    off = dmin16[:, None] * mn
    q = torch.round((x + off[..., None]) * _safe_inv(step)[..., None]).clamp_(0, levels)  # (n, 8, 32)
    head = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)]
    if bits == 4:
        body = [_k_nibble_bytes(q)]
    else:
        qi = q.to(torch.uint8)
        high = (qi >> 4).reshape(-1, 8, 32)  # bit 4 of each weight; qh byte j, bit s = sub-block s, weight j
        qh = torch.zeros(qi.shape[0], 32, dtype=torch.uint8)
        for s in range(8):
            qh |= high[:, s, :] << s
        body = [qh, _k_nibble_bytes(qi & 0x0F)]
    out = torch.cat([head[0], head[1], head[2], *body], dim=-1)
    return out.reshape(rows, -1)


def _q6_k(w: torch.Tensor) -> torch.Tensor:
    """w = d * scale * (q - 32) per sub-block of 16; int8 scales, one fp16 d per 256."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16)
    amax = x.abs().amax(-1)  # (n, 16)
    scale = amax / 31.5
    d = scale.amax(-1) / 127.0
    d16 = d.to(torch.float16).float()
    sc = torch.round(scale * _safe_inv(d16)[:, None]).clamp_(-128, 127)
    step = d16[:, None] * sc
    q = (torch.round(x * _safe_inv(step)[..., None]).clamp_(-32, 31) + 32).to(torch.uint8).reshape(-1, 2, 4, 32)
    # halves of 128: ql bytes [64 h + j] hold q[h, 0 or 1, j] low nibbles (low) and q[h, 2 or 3, j] (high)
    ql = torch.cat(
        [(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4), (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], dim=-1
    )
    hb = q >> 4  # (n, 2, 4, 32), 2 bits each
    qh = hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)  # (n, 2, 32)
    out = torch.cat(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=-1
    )
    return out.reshape(rows, -1)


def quantize_rows(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """(rows, cols) float -> (rows, ceil(cols / block) * bytes per block) uint8 in `fmt`."""
    if fmt not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {fmt}; formats: {', '.join(QUANTIZABLE)}")
    f = FORMATS[fmt]
    x = _padded(w, f.block)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return torch.zeros(x.shape[0], x.shape[1] // f.block * f.nbytes, dtype=torch.uint8)
    if fmt == "Q8_0":
        return _q8_0(x)
    if fmt in ("Q4_K", "Q5_K"):
        return _q4_5_k(x, 4 if fmt == "Q4_K" else 5)
    if fmt == "Q6_K":
        return _q6_k(x)
    return _via_gguf(x.contiguous(), fmt)
