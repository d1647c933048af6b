"""Which weight formats `--quantize` offers, and where each can run.

    int8   8-bit weights in blocks of 32 with one fp16 scale each (GGUF's Q8_0, 8.5 bits a
           weight); on CPU, shardwise's native block kernels with the activations
           quantized per block of 32 (shardwise.kernels); on CUDA, symmetric int8 with one
           scale per output row, dequantized into the product (memory saved at rest).
    q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k
           GGUF's block formats, computed as stored by the native kernels (CPU only).
    fp16   weights stored as IEEE half (2 bytes); on CPU, fbgemm's prepacked fp16 GEMM
           (activations stay fp32); on CUDA, a half-precision F.linear.

A GGUF file needs no `--quantize`: on CPU each tensor runs in the file's own format.
`--quantize none` dequantizes a GGUF file's blocks to the model's dtype as they are read
(what every GGUF load did before the block kernels; a checkpoint of floats is unchanged).
Checked here, before any rank starts: the scheme's name, that the run is inference, and
that the device has the kernel.
"""

from __future__ import annotations

import torch

__all__ = ["SCHEMES", "BLOCK_ONLY", "NONE", "QuantizeError", "check_quantize", "conversion"]

SCHEMES = ("fp16", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
BLOCK_ONLY = SCHEMES[2:]
NONE = "none"
"""--quantize none: every weight in the model's dtype, a GGUF file's blocks dequantized."""
"""Schemes that exist only as block formats (CPU)."""


class QuantizeError(ValueError):
    """A `--quantize` this run cannot use; the message is one line for the user."""


def check_quantize(scheme: str | None, *, device: str | torch.device = "cpu", training: bool = False) -> str | None:
    """The scheme, checked: None passes through; anything else must be in SCHEMES, for
    inference, on a device with the kernel. Raises QuantizeError naming what is supported."""
    if scheme is None or scheme == NONE:
        return scheme
    if scheme not in SCHEMES:
        raise QuantizeError(f"--quantize {scheme} is not supported; supported: {', '.join(SCHEMES)}")
    if training:
        raise QuantizeError(
            f"--quantize {scheme} is for inference only: training needs full-precision weights "
            "(train in fp32 or bf16, then quantize when you load for generate or serve)"
        )
    kind = torch.device(device).type
    if kind == "cpu":
        engines = torch.backends.quantized.supported_engines
        if scheme == "fp16" and "fbgemm" not in engines:
            raise QuantizeError(
                f"--quantize fp16 on CPU needs PyTorch's fbgemm kernels (x86 with AVX2); this build has "
                f"quantized engines: {', '.join(e for e in engines if e != 'none') or 'none'}; "
                "int8 and the block formats run on shardwise's own kernels"
            )
    elif kind == "cuda":
        if scheme in BLOCK_ONLY:
            raise QuantizeError(
                f"--quantize {scheme} is a block format computed by shardwise's CPU kernels; on CUDA use int8 or fp16"
            )
    else:
        raise QuantizeError(f"--quantize {scheme} runs on CPU or CUDA, not on {kind}")
    return scheme


def conversion(scheme: str | None) -> str | None:
    """The scheme weights are converted to: None for no conversion (None or "none")."""
    return None if scheme == NONE else scheme
