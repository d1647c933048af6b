"""The fused decode kernels (shardwise.kernels.decode, csrc/attn.c, csrc/norm.c) against the
plain PyTorch path they replace, on every ISA this machine runs (the portable one always)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.engine.paged import PagedCaches
from shardwise.engine.slots import SlotCaches, StepBatch
from shardwise.kernels import decode, native
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.models.modules import ACTIVATIONS, Attention, KVCache, attention_mask, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built here")

ISAS = list(native.ISAS)


def _cfg(**kw) -> ModelConfig:
    base = dict(
        family="t", vocab_size=97, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, norm="rms", norm_eps=1e-6, act="silu", gated_mlp=True,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def _random(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_matches_torch(isa, act):
    torch.manual_seed(0)
    h = torch.randn(5, 2 * 300) * 4
    h[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 1e-30, 30.0, 90.0, 200.0])  # both ends of exp
    gate, up = h.chunk(2, dim=-1)
    want = ACTIVATIONS[act](gate) * up
    with native.use_isa(isa):
        got = decode.glu(h, act, ACTIVATIONS[act])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(got).all()


def test_glu_falls_back_for_other_activations_and_autograd():
    h = torch.randn(3, 40, requires_grad=True)
    got = decode.glu(h, "silu", F.silu)  # autograd: the torch path, differentiable
    got.sum().backward()
    assert h.grad is not None
    x = torch.randn(3, 40)
    torch.testing.assert_close(decode.glu(x, "relu", F.relu), F.relu(x[:, :20]) * x[:, 20:])


@pytest.mark.parametrize("isa", ISAS)
def test_add_rms_norm_matches_add_then_norm(isa):
    torch.manual_seed(1)
    x, a, w = torch.randn(4, 3, 576), torch.randn(4, 3, 576), torch.randn(576)
    with native.use_isa(isa):
        s, n = decode.add_rms_norm(x, a, w, 1e-5)
    torch.testing.assert_close(s, x + a, rtol=0, atol=0)
    torch.testing.assert_close(n, F.rms_norm(x + a, (576,), w, 1e-5), rtol=2e-6, atol=2e-6)


def _plain_and_fused(attn: Attention, h_in, rope, mask, make_cache, start):
    """Run one decode step of `attn` twice on fresh caches (plain path, fused path): outputs and caches."""
    out = []
    for fused in (False, True):
        cache = make_cache()
        ctx = decode.unfused() if not fused else torch.no_grad()
        with torch.no_grad(), ctx:
            y = attn(h_in, rope, mask, cache, start)
        out.append((y, cache))
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "kw",
    [
        {},  # GQA 4 q / 2 kv, full rotary
        {"num_kv_heads": 4},  # MHA
        {"num_kv_heads": 1},  # MQA
        {"rope_dim": 8},  # partial rotary
        {"qk_norm": True},
        {"attn_scale": 0.37},
        {"positions": "learned", "max_positions": 64},  # no rotary
    ],
)
def test_fused_attention_matches_plain_on_the_generate_cache(isa, kw):
    torch.manual_seed(2)
    cfg = _cfg(**kw)
    attn = Attention(cfg)
    _random(attn)
    B, past = 3, 11
    hist_k = torch.randn(B, cfg.num_kv_heads, past, cfg.head_dim)
    hist_v = torch.randn(B, cfg.num_kv_heads, past, cfg.head_dim)

    def make():
        c = KVCache(B, 20, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32)
        c.k[:, :, :past], c.v[:, :, :past] = hist_k, hist_v
        return c

    x = torch.randn(B, 1, cfg.hidden_size)
    pad = torch.ones(B, past + 1, dtype=torch.long)
    pad[1, :4] = 0  # row 1 was left-padded
    positions = (pad.cumsum(-1) - 1).clamp(min=0)[:, past:]
    rope = None
    if cfg.positions != "learned":
        rope = rope_cos_sin(rope_inv_freq(cfg), positions, torch.float32, signed=True)
    mask = attention_mask(pad, 1, past + 1, causal=True, window=None, device="cpu")
    with native.use_isa(isa):
        (y0, c0), (y1, c1) = _plain_and_fused(attn, x, rope, mask, make, past)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c1.k, c0.k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c1.v, c0.v, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_fused_attention_uneven_kv_groups(isa):
    """A tensor-parallel shard whose KV heads serve 3 and 1 query heads (qkv.kv_groups)."""
    torch.manual_seed(3)
    cfg = _cfg(num_heads=4, num_kv_heads=2)
    attn = Attention(cfg)
    _random(attn)
    attn.qkv.kv_groups = (3, 1)
    B, past = 2, 7

    def make():
        torch.manual_seed(9)
        c = KVCache(B, 10, 2, cfg.head_dim, dtype=torch.float32)
        c.k.normal_(), c.v.normal_()
        return c

    x = torch.randn(B, 1, cfg.hidden_size)
    rope = rope_cos_sin(rope_inv_freq(cfg), torch.full((B, 1), past), torch.float32, signed=True)
    with native.use_isa(isa):
        (y0, c0), (y1, c1) = _plain_and_fused(attn, x, rope, None, make, past)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c1.k, c0.k, rtol=1e-6, atol=1e-6)


def _step_logits(model, caches, steps, fused: bool):
    out = []
    ctx = torch.no_grad() if fused else decode.unfused()
    with torch.no_grad(), ctx:
        for batch in steps:
            out.append(caches.forward(model, batch))
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["slot", "paged"])
def test_fused_steps_match_plain_with_sequences_joining_and_leaving(isa, kind):
    """Continuous batching: prompts (plain path, T > 1), then decode steps of 1..5 rows whose
    lengths differ, a row leaving and one joining; every step's logits equal the plain path's."""
    torch.manual_seed(4)
    cfg = _cfg(num_layers=2, sliding_window=6)
    model = DecoderLM(cfg)
    _random(model, 5)
    model.eval()
    g = torch.Generator().manual_seed(6)

    def tok(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    lens = {0: 9, 1: 3, 2: 14}
    steps = [StepBatch.build([(s, 0, tok(n)) for s, n in lens.items()])]  # prefill, T = 14
    past = dict(lens)
    for t in range(5):
        rows = [(s, past[s], tok(1)) for s in sorted(past)]
        steps.append(StepBatch.build(rows))
        for s in past:
            past[s] += 1
        if t == 1:
            del past[1]  # sequence 1 leaves
        if t == 2:
            steps.append(StepBatch.build([(3, 0, tok(4))]))  # sequence 3 joins (its prompt)
            past[3] = 4
    if kind == "paged":
        bs, tables = 4, {}
        for b in steps:
            for s, p, n in zip(b.slots.tolist(), b.past.tolist(), b.n_new.tolist(), strict=True):
                tables.setdefault(s, [])
                while len(tables[s]) * bs < p + n:
                    tables[s].append(len(sum(tables.values(), [])) + 1)
        steps = [StepBatch(b.slots, b.past, b.n_new, b.ids, tables=_table(tables, b.slots.tolist())) for b in steps]

    def caches():
        return PagedCaches(model, 64, 4) if kind == "paged" else SlotCaches(model, 4, 32)

    with native.use_isa(isa):
        plain = _step_logits(model, caches(), steps, fused=False)
        fused = _step_logits(model, caches(), steps, fused=True)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _table(tables: dict, seqs: list[int]) -> torch.Tensor:
    width = max(len(tables[s]) for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(tables[s])] = torch.tensor(tables[s])
    return out


def test_the_fused_path_really_runs(monkeypatch):
    """A decode step calls the native attention, and not SDPA (so the tests above compare two paths)."""
    cfg = _cfg()
    model = DecoderLM(cfg)
    _random(model)
    calls = {"attend": 0, "sdpa": 0}
    real_attend, real_sdpa = decode.attend, F.scaled_dot_product_attention

    def counting_attend(*a, **k):
        calls["attend"] += 1
        return real_attend(*a, **k)

    def counting_sdpa(*a, **k):
        calls["sdpa"] += 1
        return real_sdpa(*a, **k)

    import shardwise.models.modules as modules

    monkeypatch.setattr(modules, "attend", counting_attend)
    monkeypatch.setattr(modules.F, "scaled_dot_product_attention", counting_sdpa)
    caches = model.new_caches(2, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), caches=caches, start=0)  # prefill: plain
        assert calls == {"attend": 0, "sdpa": cfg.num_layers}
        model(torch.tensor([[7], [8]]), caches=caches, start=3)  # decode: fused
    assert calls == {"attend": cfg.num_layers, "sdpa": cfg.num_layers}


def _q8_weight(out_f: int, in_f: int, fmt: str = "Q8_0"):
    from shardwise.kernels import BlockWeight, quantize_rows

    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(7))
    return BlockWeight.of([(fmt, quantize_rows(w, fmt))], in_f)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K"])
def test_norm_quantizes_for_the_next_linear_in_the_same_call(isa, fmt, monkeypatch):
    """rms_norm(block=...) and add_rms_norm(block=...) hand their output's activation blocks to
    the next block-format linear, which then quantizes nothing itself; the product is bit for
    bit the unfused one. A tensor changed in place after its norm is quantized afresh."""
    from shardwise.kernels import block as block_mod
    from shardwise.kernels.block import act_block
    from shardwise.kernels.ops import rms_norm

    torch.manual_seed(8)
    w = _q8_weight(40, 512, fmt)
    blk = act_block(w)
    assert blk == (256 if fmt == "Q4_K" else 32)
    x, a, nw = torch.randn(3, 1, 512), torch.randn(3, 1, 512), torch.randn(512)
    calls = []
    real = block_mod.quantize_activations
    monkeypatch.setattr(block_mod, "quantize_activations", lambda *z: calls.append(1) or real(*z))
    with native.use_isa(isa):
        want = w.linear(rms_norm(x, nw, 1e-5))  # the norm offers nothing: the linear quantizes
        assert len(calls) == 1
        h = rms_norm(x, nw, 1e-5, blk)
        got = w.linear(h)
        assert len(calls) == 1  # took the norm's blocks
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        _, h2 = decode.add_rms_norm(x, a, nw, 1e-5, blk)
        got2 = w.linear(h2)
        assert len(calls) == 1
        _, plain = decode.add_rms_norm(x, a, nw, 1e-5)
        torch.testing.assert_close(got2, w.linear(plain), rtol=0, atol=0)
        assert len(calls) == 2
        h3 = rms_norm(x, nw, 1e-5, blk)
        h3.mul_(2.0)  # changed after its norm: its blocks are stale
        got3 = w.linear(h3)
        assert len(calls) == 3
        torch.testing.assert_close(got3, w.linear(h3.clone()), rtol=0, atol=0)


def test_act_block_answers_only_for_one_native_block_length():
    from shardwise.kernels import BlockWeight, quantize_rows
    from shardwise.kernels.block import act_block

    w = torch.randn(8, 256)
    assert act_block(w) is None  # a float tensor
    assert act_block(_q8_weight(8, 256)) == 32
    mixed = BlockWeight.of([("Q8_0", quantize_rows(w, "Q8_0")), ("Q4_K", quantize_rows(w, "Q4_K"))], 256)
    assert act_block(mixed) is None  # two block lengths: the linear quantizes per part
    with_float = BlockWeight.of([("Q8_0", quantize_rows(w, "Q8_0")), ("F32", w)], 256)
    assert act_block(with_float) is None


def test_only_cpu_fp32_outside_autograd_takes_the_fused_kernels():
    """Other devices and dtypes (CUDA among them) run the stock path: fused_ok says no."""
    assert decode.fused_ok(torch.zeros(2, 8))
    assert not decode.fused_ok(torch.zeros(2, 8, device="meta"))  # any non-CPU device
    assert not decode.fused_ok(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not decode.fused_ok(torch.zeros(2, 8, requires_grad=True))
    with decode.unfused():
        assert not decode.fused_ok(torch.zeros(2, 8))
    with torch.no_grad():
        assert decode.fused_ok(torch.zeros(2, 8, requires_grad=True))
