"""Kernels at the bottom of the house: a linear on a weight of any format and device, an
embedding lookup, and the native block-format kernels behind them.

    linear(x, w, b), embedding(ids, w), expert_blocks(w, E)    # shardwise.kernels.ops
    BlockWeight                    # GGUF block formats computed as stored (kernels.block)
    quantize_rows(w, "Q4_K")       # float rows -> block bytes (kernels.quantize)
    native.describe()              # which kernels run here, in one line
"""

from shardwise.kernels import native
from shardwise.kernels.block import GGML_IDS, NATIVE_FORMATS, BlockWeight, Part
from shardwise.kernels.ops import embedding, expert_blocks, linear
from shardwise.kernels.quantize import QUANTIZABLE, quantize_rows

__all__ = [
    "native",
    "GGML_IDS",
    "NATIVE_FORMATS",
    "BlockWeight",
    "Part",
    "linear",
    "embedding",
    "expert_blocks",
    "QUANTIZABLE",
    "quantize_rows",
]
