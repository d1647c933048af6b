"""Monotonicity properties of the cost model (hypothesis), over random decoder shapes."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.models.config import ModelConfig
from shardwise.planner import InferenceWorkload, evaluate, recommend
from shardwise.planner.cost import pipeline_bubble_fraction
from shardwise.planner.footprint import kv_bytes_per_token, stage_params
from shardwise.planner.predict import Layout, predict_inference
from shardwise.planner.specs import Cluster, Device, Link
from shardwise.sharding.plans import even_tp_sizes, model_tp_sizes

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def configs(draw) -> ModelConfig:
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    hidden = heads * head_dim
    return ModelConfig(
        family="llama",
        vocab_size=draw(st.integers(100, 5000)),
        hidden_size=hidden,
        intermediate_size=hidden * draw(st.sampled_from([2, 3, 4])),
        num_layers=draw(st.integers(1, 12)),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        tie_embeddings=draw(st.booleans()),
        gated_mlp=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        max_positions=4096,
    )


def _weights(cfg: ModelConfig, tp: int, pp: int) -> int:
    return max(stage_params(cfg, tp, pp, s) for s in range(pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cluster(devices: int, memory_gib: float = 1.0) -> Cluster:
    dev = Device("dev", memory_gib, {"float32": 10.0}, 100.0)
    return Cluster("c", dev, devices, devices, Link("l", 10.0, 10.0))


@SETTINGS
@given(configs())
def test_more_devices_never_increase_weights_per_device(cfg):
    # over the even tp sizes: an uneven one may replicate a KV head its neighbours need not
    tps, pps = even_tp_sizes(cfg), _divisors(cfg.num_layers)
    for a, b in zip(tps, tps[1:], strict=False):
        for pp in pps:
            assert _weights(cfg, b, pp) <= _weights(cfg, a, pp)
    for a, b in zip(pps, pps[1:], strict=False):
        for tp in tps:
            assert _weights(cfg, tp, b) <= _weights(cfg, tp, a)
    for a, b in zip(tps, tps[1:], strict=False):
        assert kv_bytes_per_token(cfg, b, 2) <= kv_bytes_per_token(cfg, a, 2)


@SETTINGS
@given(configs(), st.integers(1, 7))
def test_a_bigger_cluster_never_needs_more_weights_per_device(cfg, devices):
    wl = InferenceWorkload(prompt_len=64, output_len=16)
    small, _ = evaluate(cfg, wl, _cluster(devices))
    big, _ = evaluate(cfg, wl, _cluster(devices + 1))
    assert min(c.memory.weights for c in big) <= min(c.memory.weights for c in small)
    fit_small = [c for c in small if c.fits]
    fit_big = [c for c in big if c.fits]
    assert len(fit_big) >= len(fit_small)


@SETTINGS
@given(configs(), st.floats(0.01, 4.0), st.floats(1.0, 4.0))
def test_more_memory_never_needs_a_bigger_replica(cfg, memory_gib, factor):
    wl = InferenceWorkload(prompt_len=64, output_len=16)
    low = recommend("m", cfg, wl, _cluster(8, memory_gib))
    high = recommend("m", cfg, wl, _cluster(8, memory_gib * factor))
    if low.recommended is not None:
        assert high.recommended is not None
        assert high.recommended.layout.replica <= low.recommended.layout.replica


@SETTINGS
@given(configs(), st.integers(1, 8), st.integers(1, 512), st.integers(1, 64))
def test_latency_grows_with_batch_and_context(cfg, batch, prompt, out):
    cl = _cluster(8)
    tp = model_tp_sizes(cfg)[-1] if model_tp_sizes(cfg)[-1] <= 8 else 1
    kw = dict(width=4, dtype="float32")
    p = predict_inference(cfg, cl, Layout(tp, 1, 1), batch=batch, prompt_len=prompt, output_len=out, **kw)
    more_b = predict_inference(cfg, cl, Layout(tp, 1, 1), batch=batch + 1, prompt_len=prompt, output_len=out, **kw)
    longer = predict_inference(cfg, cl, Layout(tp, 1, 1), batch=batch, prompt_len=prompt + 1, output_len=out, **kw)
    assert more_b.decode.total_s >= p.decode.total_s and more_b.prefill.total_s >= p.prefill.total_s
    assert longer.decode.total_s >= p.decode.total_s and longer.prefill.total_s >= p.prefill.total_s
    slower_link = replace(cl, intra=Link("slow", 1.0, 100.0))
    slow = predict_inference(cfg, slower_link, Layout(tp, 1, 1), batch=batch, prompt_len=prompt, output_len=out, **kw)
    assert slow.decode.total_s >= p.decode.total_s


@given(st.integers(1, 64), st.integers(1, 512))
def test_bubble_shrinks_with_micro_batches_and_grows_with_stages(p, m):
    assert pipeline_bubble_fraction(p, m + 1) <= pipeline_bubble_fraction(p, m)
    assert pipeline_bubble_fraction(p + 1, m) >= pipeline_bubble_fraction(p, m)
    assert 0 <= pipeline_bubble_fraction(p, m) < 1
