"""Tensor-parallel layers with fp16 / int8 weights (--quantize) against their unsharded
converted twins at world sizes 1, 2, 3 and 4, on widths tp divides (36) and widths it does
not (37: split unevenly). The cases (tests/cases/quantized.py) run on pooled ranks."""

from __future__ import annotations

import pytest

from cases.quantized import quantized_layer_case
from helpers import grid

KINDS = ["column", "column_gather", "row", "qkv", "merged", "head", "embedding"]


@pytest.mark.parametrize(
    "kind,scheme,width,world_size",
    grid(
        KINDS,
        ["fp16", "int8"],
        [36, 37],
        [1, 2, 3, 4],
        smoke=lambda kind, scheme, width, ws: (scheme, width, ws) == ("int8", 37, 2) and kind in ("column", "row"),
    ),
)
def test_quantized_layer_parity(rank_pool, kind, scheme, width, world_size):
    rank_pool.run(quantized_layer_case, world_size, args=(kind, scheme, width))
