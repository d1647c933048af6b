"""Tensor-parallel layers with fp16 / int8 weights (--quantize) against their unsharded
converted twins at world sizes 1, 2, 3 and 4, on widths tp divides (36) and widths it does
not (37: split unevenly). The cases (tests/cases/quantized.py) run on pooled ranks."""

from __future__ import annotations

import pytest

from cases.quantized import quantized_layers_case
from helpers import grid


@pytest.mark.parametrize(
    "scheme,width,world_size",
    grid(
        ["fp16", "int8"], [36, 37], [1, 2, 3, 4], smoke=lambda scheme, width, ws: (scheme, width, ws) == ("int8", 37, 2)
    ),
)
def test_quantized_layer_parity(rank_pool, scheme, width, world_size):
    """Column, gathered column, row, qkv (9 / 3 heads), merged gate/up, LM head, embedding."""
    rank_pool.run(quantized_layers_case, world_size, args=(scheme, width))
