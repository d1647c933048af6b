"""The decode step's cheaper forms compute exactly what the forms they replace computed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.comm import LocalCommunicator
from shardwise.engine import generate
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import Norm, apply_rope, rope_cos_sin, rope_inv_freq


def _cfg(**kw) -> ModelConfig:
    base = dict(
        family="t", vocab_size=60, hidden_size=32, intermediate_size=40, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _rotate_half(x, cos, sin):
    """The rotate-half convention as it was written before: neg and cat, then addcmul."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-x_rot[..., rot // 2 :], x_rot[..., : rot // 2]], dim=-1)
    return torch.cat([torch.addcmul(x_rot * cos, rotated, sin), x_pass], dim=-1)


def test_rope_by_roll_is_bitwise_rotate_half_with_or_without_the_signed_sin():
    torch.manual_seed(0)
    for rope_dim, dtype in [(None, torch.float32), (16, torch.float32), (None, torch.bfloat16)]:
        cfg = _cfg(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, rope_dim=rope_dim)
        positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
        inv = rope_inv_freq(cfg)
        cos, sin, signed = rope_cos_sin(inv, positions, dtype, signed=True)
        assert all(t.equal(u) for t, u in zip((cos, sin), rope_cos_sin(inv, positions, dtype), strict=True))
        x = torch.randn(2, 3, 3, 32).to(dtype).transpose(1, 2)  # (B, H, T, hd), strided as in Attention
        ref = _rotate_half(x, cos, sin)
        assert apply_rope(x, cos, sin).equal(ref)
        assert apply_rope(x, cos, sin, signed).equal(ref)


def test_rms_norm_skips_only_no_op_casts():
    torch.manual_seed(0)
    for offset, dtype in [(0.0, torch.float32), (1.0, torch.float32), (0.0, torch.bfloat16), (1.0, torch.bfloat16)]:
        norm = Norm(48, "rms", 1e-6, offset).to(dtype)
        with torch.no_grad():
            norm.weight.normal_()
        x = torch.randn(3, 5, 48).to(dtype)
        w = norm.weight.float() + offset
        ref = F.rms_norm(x.float(), w.shape, w, 1e-6).to(dtype)  # the old form: fp32 math, every cast written
        assert norm(x).dtype == dtype and norm(x).equal(ref)
    x = torch.randn(4, 48, requires_grad=True)  # and gradients still flow through the fp32 form
    Norm(48, "rms", 1e-6)(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def _spy_masks(model: DecoderLM) -> list:
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    return seen


def test_decode_steps_build_a_mask_only_when_a_prompt_is_padded():
    torch.manual_seed(0)
    model = DecoderLM(_cfg()).eval()
    comm = LocalCommunicator()
    seen = _spy_masks(model)
    generate(model, [[1, 2, 3], [4, 5, 6]], comm=comm, max_new_tokens=4)
    assert seen[0] is not None and all(m is None for m in seen[1:])  # prefill's mask, then none
    seen.clear()
    generate(model, [[1, 2, 3], [4, 5]], comm=comm, max_new_tokens=4)
    assert [tuple(m.shape) for m in seen] == [(2, 3), (2, 4), (2, 5), (2, 6)]
    assert seen[-1][1].tolist() == [0, 1, 1, 1, 1, 1]


def test_greedy_generation_equals_recomputing_every_token():
    torch.manual_seed(0)
    for cfg in (_cfg(), _cfg(rope_dim=4), _cfg(qk_norm=True)):
        model = DecoderLM(cfg).eval()
        prompts = [[5, 7, 11, 13], [17, 19]]
        out = generate(model, prompts, comm=LocalCommunicator(), max_new_tokens=6).tokens
        for p, toks in zip(prompts, out, strict=True):
            seq = list(p)
            with torch.no_grad():
                for _ in range(6):  # no cache, no padding: the whole sequence each time
                    seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            assert toks == seq[len(p) :]
