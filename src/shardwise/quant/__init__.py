"""Quantized weights for inference: `--quantize fp16|int8` (see shardwise.quant.schemes).

    check_quantize("int8")                        # the scheme, or a QuantizeError for the user
    linear(x, w, b), embedding(ids, w)            # what every layer calls, float or quantized w

Converting a model lives in shardwise.quant.convert (it imports the layers, which import this).
"""

from shardwise.quant.schemes import SCHEMES, QuantizeError, check_quantize
from shardwise.quant.weights import (
    QuantizedExperts,
    QuantizedTable,
    QuantizedWeight,
    embedding,
    expert_blocks,
    int8_rows,
    linear,
)

__all__ = [
    "SCHEMES",
    "QuantizeError",
    "check_quantize",
    "QuantizedWeight",
    "QuantizedExperts",
    "QuantizedTable",
    "linear",
    "embedding",
    "expert_blocks",
    "int8_rows",
]
