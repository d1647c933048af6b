"""Quantized weights for inference: `--quantize fp16|int8|q8_0|q4_k|...` (see shardwise.quant.schemes).

    check_quantize("int8")                        # the scheme, or a QuantizeError for the user
    quantize_model(model, "q4_k")                 # shardwise.quant.convert

The weights and the kernels that run them live in shardwise.kernels (block formats,
packed fp16); converting a model lives in shardwise.quant.convert (it imports the layers).
"""

from shardwise.kernels import BlockWeight, embedding, expert_blocks, linear
from shardwise.kernels.packed import QuantizedExperts, QuantizedTable, QuantizedWeight
from shardwise.kernels.rows import int8_rows
from shardwise.quant.schemes import BLOCK_ONLY, SCHEMES, QuantizeError, check_quantize

__all__ = [
    "SCHEMES",
    "BLOCK_ONLY",
    "QuantizeError",
    "check_quantize",
    "BlockWeight",
    "QuantizedWeight",
    "QuantizedExperts",
    "QuantizedTable",
    "linear",
    "embedding",
    "expert_blocks",
    "int8_rows",
]
