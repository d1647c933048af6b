"""The decode step's shortcuts give the same answers as the general path they skip."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.comm import LocalCommunicator
from shardwise.comm.regions import copy_to_region, reduce_from_region
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import Norm, apply_rope, attention_mask, rope_cos_sin, rope_inv_freq


def test_one_query_without_padding_needs_no_mask():
    assert attention_mask(None, 1, 40, causal=True, window=None, device="cpu") is None
    assert attention_mask(None, 1, 40, causal=True, window=40, device="cpu") is None


def test_one_query_past_the_sliding_window_is_still_masked():
    mask = attention_mask(None, 1, 40, causal=True, window=16, device="cpu")  # (1, 1, 1, 40)
    assert mask.shape == (1, 1, 1, 40)
    assert mask[0, 0, 0].tolist() == [False] * 24 + [True] * 16


def test_padding_is_masked_for_one_query():
    pad = torch.tensor([[0, 0, 1, 1, 1]])
    mask = attention_mask(pad, 1, 5, causal=True, window=None, device="cpu")
    assert mask[0, 0, 0].tolist() == [False, False, True, True, True]


def _reference_rms(x, weight, eps, offset=0.0):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.float())).to(x.dtype)


def test_fused_rms_norm_matches_the_written_out_formula():
    torch.manual_seed(0)
    for offset, dtype in [(0.0, torch.float32), (1.0, torch.float32), (0.0, torch.bfloat16)]:
        norm = Norm(48, "rms", 1e-6, offset)
        with torch.no_grad():
            norm.weight.normal_()
        x = torch.randn(3, 5, 48).to(dtype)
        torch.testing.assert_close(norm(x), _reference_rms(x, norm.weight, 1e-6, offset))


def _rotate_half_reference(x, cos, sin):
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def test_rope_full_and_partial_match_rotate_half():
    torch.manual_seed(0)
    for rope_dim in (None, 16):
        cfg = ModelConfig(
            family="t", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
            num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=rope_dim,
        )  # fmt: skip
        positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
        cos, sin = rope_cos_sin(rope_inv_freq(cfg), positions, torch.float32)  # (B, 1, T, rot)
        x = torch.randn(2, 3, 3, 32)  # (B, H, T, hd)
        torch.testing.assert_close(apply_rope(x, cos, sin), _rotate_half_reference(x, cos, sin))


def test_decode_without_mask_equals_decode_with_an_all_ones_mask():
    torch.manual_seed(0)
    cfg = ModelConfig(
        family="t", vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    outs = []
    with torch.no_grad():
        for use_mask in (True, False):
            caches = model.new_caches(2, 10)
            model(ids, attention_mask=torch.ones(2, 7, dtype=torch.long), caches=caches)
            mask = torch.ones(2, 8, dtype=torch.long) if use_mask else None
            outs.append(model(ids[:, -1:], attention_mask=mask, caches=caches, start=7))
    torch.testing.assert_close(outs[0], outs[1])
    with torch.no_grad():  # and both equal the full forward without a cache
        full = model(torch.cat([ids, ids[:, -1:]], dim=1))[:, -1:]
    torch.testing.assert_close(outs[1], full, rtol=1e-5, atol=1e-5)


class _CountingComm(LocalCommunicator):
    """A size-2 stand-in that sums with itself, to see which path a region takes."""

    def __init__(self):
        super().__init__()
        self.size, self.calls = 2, []

    def all_reduce(self, t, op="sum"):
        self.calls.append("all_reduce")
        return t * 2

    def all_reduce_(self, t, op="sum"):
        self.calls.append("all_reduce_")
        return t.mul_(2)


def test_regions_skip_autograd_only_when_no_gradient_is_needed():
    comm = _CountingComm()
    x = torch.randn(3, 4)
    with torch.no_grad():
        y = F.linear(x, torch.eye(4))
        out = reduce_from_region(y, comm, inplace=True)
        assert out.data_ptr() == y.data_ptr() and comm.calls == ["all_reduce_"]
        assert copy_to_region(x, comm) is x
    w = torch.eye(4, requires_grad=True)
    y = F.linear(x, w)
    out = reduce_from_region(y, comm, inplace=True)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("ReduceFromRegion")
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(4, 4))  # the backward is the identity
