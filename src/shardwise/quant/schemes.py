"""Which weight formats `--quantize` offers, and where each can run.

    fp16   weights stored as IEEE half (2 bytes); on CPU, fbgemm's prepacked fp16 GEMM
           (activations stay fp32); on CUDA, a half-precision F.linear.
    int8   symmetric int8 weights with one fp32 scale per output row (1 byte + 4 bytes per
           row); on CPU, fbgemm's dynamic int8 GEMM (activations quantized per call, per
           tensor, to 7 bits as fbgemm needs without VNNI); on CUDA, the weight is
           dequantized into the product (memory saved at rest, no int8 arithmetic).

The kernels were chosen by measurement (benchmarks/bench_kernels.py,
docs/benchmarks/kernels.md). Checked here, before any rank starts: the scheme's
name, that the run is inference, and that the device has the kernel.
"""

from __future__ import annotations

import torch

__all__ = ["SCHEMES", "QuantizeError", "check_quantize"]

SCHEMES = ("fp16", "int8")


class QuantizeError(ValueError):
    """A `--quantize` this run cannot use; the message is one line for the user."""


def check_quantize(scheme: str | None, *, device: str | torch.device = "cpu", training: bool = False) -> str | None:
    """The scheme, checked: None passes through; anything else must be in SCHEMES, for
    inference, on a device with the kernel. Raises QuantizeError naming what is supported."""
    if scheme is None:
        return None
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
        if "fbgemm" not in engines:
            raise QuantizeError(
                f"--quantize {scheme} on CPU needs PyTorch's fbgemm kernels (x86 with AVX2); "
                f"this build has quantized engines: {', '.join(e for e in engines if e != 'none') or 'none'}"
            )
    elif kind != "cuda":
        raise QuantizeError(f"--quantize {scheme} runs on CPU (fbgemm) or CUDA, not on {kind}")
    return scheme
