"""quant.layout.decode_layout: fp32 weights re-strided for one- and two-row products change
no value, no shape and no name; only the weights it names change order, and a larger batch
puts them back. Where the native decode step runs the layers, their weights keep the loaded
order (its kernel's fastest) and only the LM head moves."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import LocalCommunicator
from shardwise.engine import generate
from shardwise.engine.text import DEFAULT_MODEL
from shardwise.hf import load_pretrained
from shardwise.kernels import step
from shardwise.models.step import refusal
from shardwise.quant.layout import MAX_COLUMN_MAJOR_ROWS, column_major, decode_layout


@pytest.fixture(scope="module")
def model():
    m, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())
    return m.eval()


def _logits(m, ids):
    with torch.no_grad():
        return m(ids)


def test_column_major_order_changes_no_value_and_no_token(model):
    ids = torch.randint(2, model.cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))  # (B, T)
    before_sd = {k: v.clone() for k, v in model.state_dict().items()}
    before = _logits(model, ids)
    tokens = generate(model, [ids[0].tolist()], comm=LocalCommunicator(), max_new_tokens=8).tokens
    with step.off():  # the layers on PyTorch's (MKL's) products: the order it streams fastest
        changed = decode_layout(model, rows=1)
    try:
        wide = {n for n, p in model.named_parameters() if p.dim() == 2 and p.shape[0] >= p.shape[1]}
        moved = {n for n, p in model.named_parameters() if column_major(p)}
        assert changed == len(moved) > 0
        # every re-strided weight is a wide projection; norms, biases and tall (down/o) ones stay
        assert moved <= wide
        assert all(".mlp.down" not in n for n in moved)
        sd = model.state_dict()
        assert sd.keys() == before_sd.keys()
        for k, v in before_sd.items():
            assert sd[k].shape == v.shape and torch.equal(sd[k], v), k
        torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
        # greedy decode of one sequence (the case it is for) gives the same tokens
        assert generate(model, [ids[0].tolist()], comm=LocalCommunicator(), max_new_tokens=8).tokens == tokens
        with step.off():
            assert decode_layout(model, rows=MAX_COLUMN_MAJOR_ROWS) == 0  # already in that order
    finally:
        back = decode_layout(model, rows=MAX_COLUMN_MAJOR_ROWS + 1)
    assert back == changed
    assert not any(column_major(p) for p in model.parameters())
    assert all(p.is_contiguous() for p in model.parameters())


def test_only_cpu_fp32_projection_weights_move():
    from shardwise.layers.linear import ColumnParallelLinear, RowParallelLinear

    comm = LocalCommunicator()
    seq = torch.nn.Sequential(
        ColumnParallelLinear(8, 16, comm=comm),  # wide: moves
        RowParallelLinear(16, 8, comm=comm),  # tall: stays
        ColumnParallelLinear(8, 16, comm=comm).to(torch.bfloat16),  # bf16: no measured gain, stays
        torch.nn.Linear(8, 16),  # not a parallel projection: stays
    )
    assert decode_layout(seq, rows=1) == 1
    assert column_major(seq[0].weight) and not column_major(seq[1].weight)
    assert seq[2].weight.is_contiguous() and seq[3].weight.is_contiguous()
    x = torch.randn(2, 8)  # (B, in)
    torch.testing.assert_close(seq[0](x), x @ seq[0].weight.t() + seq[0].bias)
    with pytest.raises(ValueError, match="rows must be at least 1, got 0"):
        decode_layout(seq, rows=0)


@pytest.mark.skipif(not step.enabled(), reason="the native module (or its step) is not built")
def test_with_the_native_step_the_layers_keep_their_order_and_the_head_moves(model):
    assert refusal(model) is None  # the built-in model's layers run as one native call
    ids = [5, 9, 13, 2]
    tokens = generate(model, [ids], comm=LocalCommunicator(), max_new_tokens=8).tokens
    try:
        changed = decode_layout(model, rows=1)
        moved = {n for n, p in model.named_parameters() if column_major(p)}
        assert changed == len(moved) == 1 and all("layers." not in n for n in moved), moved  # the head
        assert generate(model, [ids], comm=LocalCommunicator(), max_new_tokens=8).tokens == tokens
        # a compressed wire keeps the step off (the per-op path encodes it): the layers move then
        comm = model.layers[0].attn.qkv.comm
        wire, comm.wire = comm.wire, "q8"
        try:
            assert refusal(model) is None  # one rank: no wire to encode
        finally:
            comm.wire = wire
        with step.off():
            assert refusal(model) is not None and decode_layout(model, rows=1) > 0
        assert any(column_major(p) for n, p in model.named_parameters() if "layers." in n)
        assert decode_layout(model, rows=1) > 0  # the step back on: the layers' rows again
        assert not any(column_major(p) for n, p in model.named_parameters() if "layers." in n)
    finally:
        decode_layout(model, rows=MAX_COLUMN_MAJOR_ROWS + 1)
    assert all(p.is_contiguous() for p in model.parameters())
