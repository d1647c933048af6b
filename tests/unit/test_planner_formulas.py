"""Every cost-model formula against hand-computed values, and the planner's counts against
the real sharded model on the meta device (the same technique as `shardwise info`)."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.bench.calibrate import after_compute_extra_us
from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.hf.families import family_for
from shardwise.layers import model_shard_specs
from shardwise.planner.activations import layer_activation_terms, paper_layer_bytes
from shardwise.planner.cost import (
    forward_flops_per_token,
    megatron_flops_per_iteration,
    pipeline_bubble_fraction,
    tp_forward_collectives,
    training_flops_per_token,
)
from shardwise.planner.footprint import (
    kv_bytes_per_token,
    layer_params,
    stage_params,
    state_bytes,
    training_activation_bytes_per_layer,
)
from shardwise.planner.predict import Layout, mean_burst_s, predict_inference, predict_training
from shardwise.planner.presets import model_preset
from shardwise.planner.specs import PRECISIONS, Cluster, Device, Link, PlannerError, TrainingWorkload
from shardwise.sharding import parallelize
from shardwise.sharding.plans import model_tp_sizes

BENCH = model_preset("bench-156m")  # h 1024, 8 layers, 16/4 heads, inter 2816, vocab 32000


def test_parameters_per_rank_by_hand():
    # qkv (16 + 2*4) * 64 = 1536 rows; o 1024x1024; up 2 * 2816; down 2816 -> 11,272,192 matmul weights
    assert layer_params(BENCH, 1) == (11_272_192 + 2048, 11_272_192)
    # tp=2: qkv (8 + 2*2) * 64 = 768 rows, o 512 cols, up 2 * 1408, down 1408
    assert layer_params(BENCH, 2) == (5_636_096 + 2048, 5_636_096)
    # 8 layers + embedding + head (32000 x 1024 each) + final norm = 155.7M (docs/benchmarks/README.md)
    assert stage_params(BENCH, 1) == 8 * 11_274_240 + 2 * 32_768_000 + 1024 == 155_730_944
    # pp=2: stage 0 has 4 layers + embedding, stage 1 has 4 layers + norm + head
    assert stage_params(BENCH, 1, 2, 0) == 4 * 11_274_240 + 32_768_000
    assert stage_params(BENCH, 1, 2, 1) == 4 * 11_274_240 + 32_768_000 + 1024


def test_kv_cache_per_token_by_hand():
    assert kv_bytes_per_token(BENCH, 1, 4) == 2 * 8 * 4 * 64 * 4 == 16384
    llama8b = model_preset("llama-3-8b")
    assert kv_bytes_per_token(llama8b, 1, 2) == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB
    assert kv_bytes_per_token(llama8b, 8, 2) == 131072 // 8
    # tp=16 > 8 KV heads: each rank keeps one (replicated) KV head, not half of one
    assert kv_bytes_per_token(llama8b, 16, 2) == 2 * 32 * 1 * 128 * 2


def test_flops_match_megatron_closed_form():
    gpt3 = model_preset("gpt3-175b")  # 12 h^2 weights per layer, 4 s h attention, tied head
    B, s, l, h, V = 4, 2048, 96, 12288, 50257  # noqa: E741
    for recompute in (True, False):
        ours = B * s * training_flops_per_token(gpt3, s, recompute=recompute)
        theirs = megatron_flops_per_iteration(B, s, l, h, V, recompute=recompute)
        assert ours == pytest.approx(theirs, rel=1e-12)
    assert megatron_flops_per_iteration(1, 2048, 96, 12288, 50257) == pytest.approx(
        96 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 50257 / (16 * 96 * 12288))
    )
    # forward, no context: 2 x (8 layers' matmul weights + head)
    assert forward_flops_per_token(BENCH, 0) == 2 * (8 * 11_272_192 + 32000 * 1024) == 245_891_072


def test_optimizer_state_and_bubble_by_hand():
    mixed, fp32 = PRECISIONS["bf16-mixed"], PRECISIONS["fp32"]
    n = stage_params(BENCH, 1)
    per = lambda p, **kw: sum(state_bytes(BENCH, 1, width=p.weight_bytes, **kw)) / n  # noqa: E731
    # as shardwise trains: bf16 weights 2 + fp32 reduced grads 4 + fp32 master 4 + Adam 8
    assert (per(mixed), per(fp32), per(mixed, optimizer="sgd")) == (18, 16, 14)
    assert per(fp32, dp=4, distributed_optimizer=True) == 8 + 8 / 4  # fp32 weights are the master
    assert per(mixed, dp=4, distributed_optimizer=True) == 4 + 12 / 4
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble_fraction(1, 8) == 0


def test_activation_memory_matches_korthikanti():
    """The paper's Table 2 (for comparison), and the planner's own count of shardwise's layer
    (planner/activations.py; tests/unit/test_seqpar_options.py holds it to measured bytes):
    sequence parallelism divides everything but the per-head attention terms and the mask
    by tp, full recomputation keeps the layer input, selective drops the kernel's extras."""
    cfg = model_preset("llama-3-8b")  # h 4096, 32 heads, 8 KV heads
    sbh = 2048 * 1 * 4096
    paper = lambda tp, **kw: paper_layer_bytes(cfg, tp=tp, micro_batch=1, seq=2048, **kw)  # noqa: E731
    assert paper(1) == sbh * (34 + 5 * 32 * 2048 / 4096)
    assert paper(8) == sbh * (10 + 24 / 8 + 5 * 32 * 2048 / (4096 * 8))
    assert paper(8, recompute="selective") == sbh * (10 + 3)
    assert paper(8, sequence_parallel=True) == sbh * (34 + 5 * 32 * 2048 / 4096) / 8
    assert paper(8, recompute="full") == 2 * sbh

    act = lambda tp, **kw: training_activation_bytes_per_layer(cfg, tp, 1, 2048, 2, flash=True, **kw)  # noqa: E731
    terms = layer_activation_terms(cfg, tp=8, micro_batch=1, seq=2048, act_bytes=2, stream_bytes=2)
    assert act(8, recompute=False) == sum(terms.values())
    assert act(8, recompute=True) == act(8, recompute="full") == 2 * sbh
    assert act(8, recompute="full", sequence_parallel=True) == 2 * sbh / 8
    sp = layer_activation_terms(cfg, tp=8, micro_batch=1, seq=2048, act_bytes=2, stream_bytes=2, sequence_parallel=True)
    between = ("attention norm", "qkv input", "mlp norm", "mlp input")
    assert all(sp[k] == terms[k] / 8 for k in between) and all(sp[k] == terms[k] for k in terms if k not in between)
    dropped = terms["log-sum-exp"] + terms["mask copy"]
    assert act(8, recompute="selective") == pytest.approx(act(8, recompute="none") - dropped)
    scores = 1 * (32 // 8) * 2048 * 2048 * 2  # the unfused kernel's softmax output, per rank
    unfused = training_activation_bytes_per_layer(cfg, 8, 1, 2048, 2, recompute=False, flash=False)
    assert unfused == pytest.approx(act(8, recompute=False) + scores)


def test_link_alpha_beta_and_interpolation():
    link = Link("x", busbw_gbps=100, latency_us=10)
    assert link.all_reduce_s(1e9, 1) == 0
    assert link.all_reduce_s(1e9, 8) == pytest.approx(3 * 10e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    assert link.all_gather_s(1e6, 4) == pytest.approx(2 * 10e-6 + 3 * 1e6 / 100e9)
    measured = Link("m", busbw_gbps=1, latency_us=5, points=((1000, 1e-3), (4000, 4e-3)))
    assert measured.all_reduce_s(2000, 2) == pytest.approx(2e-3)  # log-log between the points
    assert measured.all_reduce_s(8000, 2) == pytest.approx(5e-6 + 8000 / 1e9)  # outside: the model
    assert measured.all_reduce_s(2000, 4) == pytest.approx(2 * 5e-6 + 1.5 * 2000 / 1e9)


def test_extra_after_compute_by_hand():
    # measured: +200 us after 0.1 ms of compute, +500 us after 1 ms, +1100 us after 10 ms
    link = Link("g", 1, 400, after_compute=((1e-3, 500e-6), (1e-4, 200e-6), (1e-2, 1100e-6)))
    assert link.extra_after_s(0.0) == 0
    assert link.extra_after_s(5e-5) == pytest.approx(200e-6)  # below the first burst: its value
    assert link.extra_after_s(1e-4) == pytest.approx(200e-6)
    assert link.extra_after_s(10**-3.5) == pytest.approx(350e-6)  # halfway in log(burst)
    assert link.extra_after_s(10**-2.5) == pytest.approx(800e-6)
    assert link.extra_after_s(1e-2) == link.extra_after_s(1.0) == pytest.approx(1100e-6)  # above: the last
    assert Link("none", 1, 5).extra_after_s(1e-3) == 0
    for bad in (((0.0, 1e-6),), ((1e-3, -1e-6),)):
        with pytest.raises(PlannerError, match="after_compute"):
            Link("bad", 1, 5, after_compute=bad)
    # calibration: a call inside the step, less the same all-reduce between idle ranks, at least 0
    assert after_compute_extra_us(1150.0, 400.0) == pytest.approx(750.0)
    assert after_compute_extra_us(30.0, 40.0) == 0
    # the burst before each collective: a pass's compute over its collectives
    assert mean_burst_s(0.019, 19) == pytest.approx(0.001)
    assert mean_burst_s(0.5, 0) == 0.5


def _cluster(busbw=10.0, latency=10.0, after=(), devices=8, **dev) -> Cluster:
    d = dict(name="d", memory_gib=64, peak_tflops={"float32": 1.0}, mem_bw_gbps=100, matmul_efficiency=1.0,
             mem_efficiency=1.0)  # fmt: skip
    return Cluster("c", Device(**(d | dev)), devices, devices, Link("l", busbw, latency, after_compute=after))


def test_decode_prediction_by_hand():
    p = predict_inference(BENCH, _cluster(), Layout(1, 1, 1), batch=1, prompt_len=128, output_len=32, width=4,
                          dtype="float32")  # fmt: skip
    # memory-bound: (8 layers + norm + head) * 4 bytes + KV of 128 + 32/2 = 144 tokens, at 100 GB/s
    streamed = (8 * 11_274_240 + 1024 + 32_768_000) * 4 + 144 * 16384
    assert p.decode.compute_s == pytest.approx(streamed / 100e9)
    assert p.decode.comm_s == 0
    p2 = predict_inference(BENCH, _cluster(), Layout(2, 1, 1), batch=1, prompt_len=128, output_len=32, width=4,
                           dtype="float32")  # fmt: skip
    assert p2.decode.compute_s == pytest.approx(((8 * 5_638_144 + 1024 + 16_000 * 1024) * 4 + 144 * 8192) / 100e9)
    # 17 all-reduces of 1024 fp32 and, greedy, 1 all-gather of each rank's best (16 bytes; engine.argmax),
    # at 10 us + n / 10 GB/s: no logits gathered, no token broadcast
    comm = 17 * (10e-6 + 4096 / 10e9) + (10e-6 + 16 / 10e9)
    assert p2.decode.comm_s == pytest.approx(comm)
    # prefill is compute-bound: 128 tokens x (8 layers at context 128) + one head row, at 1 TFLOP/s
    flops = 128 * 8 * (2 * 11_272_192 + 4 * 128 * 16 * 64) + 2 * 1024 * 32000
    assert p.prefill.compute_s == pytest.approx(flops / 1e12)
    assert p.request_s == pytest.approx(p.prefill.total_s + 31 * p.decode.total_s)


def test_decode_of_a_file_in_its_own_formats_streams_its_bytes_by_hand():
    """A GGUF file computed as stored (ModelConfig.stored_bytes_per_weight): the projections
    and the head stream at the file's bytes per weight, the norms and the KV cache as before."""
    from dataclasses import replace

    q4 = replace(BENCH, stored_bytes_per_weight=144 / 256)  # Q4_K
    p = predict_inference(q4, _cluster(), Layout(1, 1, 1), batch=1, prompt_len=128, output_len=32, width=4,
                          dtype="float32")  # fmt: skip
    matrices = 8 * 11_272_192 + 32_768_000  # the projections and the (tied) head
    streamed = matrices * 144 / 256 + (8 * 2048 + 1024) * 4 + 144 * 16384  # + norms (fp32) + KV
    assert p.decode.compute_s == pytest.approx(streamed / 100e9)


def test_decode_of_a_file_in_its_own_formats_runs_each_share_on_its_kernels_measured_rate():
    """With the file's formats (ModelConfig.stored_formats) and each one's kernel measured
    (Device.quantized_rows_tflops, the calibration's block-format probe), each format's share
    of the projections and the head takes that kernel's time at one row; the norms and the
    KV cache stay on the roofline; a format without a measured kernel: bytes at mem_bw."""
    from dataclasses import replace

    mix = replace(BENCH, stored_bytes_per_weight=0.75, stored_formats=(("Q4_K", 0.75), ("Q6_K", 0.25)))
    rates = {"Q4_K": ((1, 0.2), (4, 0.4)), "Q6_K": ((1, 0.1), (4, 0.3))}  # TFLOP/s at 1 and 4 rows
    cl = _cluster(quantized_rows_tflops=rates)
    kw = dict(batch=1, prompt_len=128, output_len=32, width=4, dtype="float32")
    p = predict_inference(mix, cl, Layout(1, 1, 1), **kw)
    flops = 2 * (8 * 11_272_192 + 32_768_000)  # the projections and the (tied) head, one row
    rest = (8 * 2048 + 1024) * 4 + 144 * 16384  # norms (fp32) + KV
    kernels = 0.75 * flops / 0.2e12 + 0.25 * flops / 0.1e12
    assert p.decode.compute_s == pytest.approx(max(8 * 4 * 144 * 16 * 64 / 1e12, rest / 100e9) + kernels)
    unmeasured = predict_inference(mix, _cluster(quantized_rows_tflops={"Q4_K": rates["Q4_K"]}), Layout(1, 1, 1), **kw)
    matrices = 8 * 11_272_192 + 32_768_000
    assert unmeasured.decode.compute_s == pytest.approx((matrices * 0.75 + rest) / 100e9)


def test_decode_collectives_pay_the_extra_after_their_burst():
    kw = dict(batch=1, prompt_len=128, output_len=32, width=4, dtype="float32")
    plain = predict_inference(BENCH, _cluster(), Layout(2, 1, 1), **kw).decode
    flat = predict_inference(BENCH, _cluster(after=((1e-3, 500e-6),)), Layout(2, 1, 1), **kw).decode
    assert flat.compute_s == plain.compute_s
    assert flat.comm_s == pytest.approx(plain.comm_s + 18 * 500e-6)  # 17 all-reduces, 1 all-gather of the choice
    # +0 after 0.1 ms, +1 ms after 10 ms; the decode step's 2.471 ms of compute (above) over 18 collectives
    sloped = predict_inference(BENCH, _cluster(after=((1e-4, 0.0), (1e-2, 1e-3))), Layout(2, 1, 1), **kw).decode
    burst = 247_140_352 / 100e9 / 18
    assert sloped.comm_s == pytest.approx(plain.comm_s + 18 * 1e-3 * math.log(burst / 1e-4) / math.log(100))


def test_training_collectives_pay_the_extra_and_one_device_works_alone():
    wl = TrainingWorkload(global_batch=2, micro_batch=1, seq_len=128, precision="fp32")
    after = ((1e-3, 1e-3),)  # +1 ms after any burst
    for layout, calls in ((Layout(1, 1, 2), 1), (Layout(2, 1, 1), 2 * 36)):
        # dp=2: the gradient all-reduce; tp=2: 2 micro-batches x (17 forward + 19 backward, 2 of them the loss's)
        plain = predict_training(BENCH, _cluster(), layout, wl).step
        extra = predict_training(BENCH, _cluster(after=after), layout, wl).step
        assert extra.comm_s == pytest.approx(plain.comm_s + calls * 1e-3), layout
    # a core keeps half its rates while others work; tp=1 dp=1 uses one device of 8, which works alone
    shared = dict(busy_compute=0.5, busy_memory=0.5)
    alone = predict_training(BENCH, _cluster(devices=1), Layout(1, 1, 1), wl).step.compute_s
    assert predict_training(BENCH, _cluster(**shared), Layout(1, 1, 1), wl).step.compute_s == pytest.approx(alone)
    # dp=2: both work, each at half its rates
    halved = predict_training(BENCH, _cluster(peak_tflops={"float32": 0.5}, mem_bw_gbps=50), Layout(1, 1, 2), wl)
    assert predict_training(BENCH, _cluster(**shared), Layout(1, 1, 2), wl).step.compute_s == pytest.approx(
        halved.step.compute_s
    )


def test_training_step_bubble_and_throughput():
    wl = TrainingWorkload(global_batch=16, micro_batch=1, seq_len=256)
    # optimizer update ~free; a link ~free: the bubble alone is what a pipeline adds
    t = predict_training(BENCH, _cluster(busbw=1e12, latency=0.0, mem_bw_gbps=1e9), Layout(1, 4, 1), wl)
    assert t.micro_batches == 16
    pipeline = t.step.total_s  # dp=1: no gradient all-reduce
    assert t.step.bubble_s / pipeline == pytest.approx(pipeline_bubble_fraction(4, 16), rel=1e-6)
    assert t.tokens_per_s == pytest.approx(16 * 256 / t.step.total_s)


CONFIGS = {
    "llama-gqa": model_preset("debug"),  # 8 q / 4 KV heads: replicated KV at tp=8
    "gpt2-tied": family_for({"model_type": "gpt2"}).config(
        {"model_type": "gpt2", "n_embd": 96, "n_layer": 2, "n_head": 6, "vocab_size": 500, "n_positions": 64}
    ),
    "qwen2-bias": family_for({"model_type": "qwen2"}).config(
        {
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 301,
            "max_position_embeddings": 64,
        }
    ),  # fmt: skip
}


@pytest.mark.parametrize(("name", "tp"), [(n, t) for n, cfg in CONFIGS.items() for t in model_tp_sizes(cfg) if t <= 8])
def test_counts_match_the_real_sharded_model(name, tp):
    """Parameters per rank and collectives per forward, against the model built on the meta
    device, sharded by its real plan, run through a dry-run communicator."""
    cfg = CONFIGS[name]
    family = family_for({"model_type": cfg.family})
    comm = DryRunCommunicator(tp)
    with torch.device("meta"):
        model = family.model(cfg)
    parallelize(model, family.plan(cfg), comm=comm)
    held = sum(math.prod(s.local_shape) for s in model_shard_specs(model).values())
    assert stage_params(cfg, tp) == held
    B, L = 2, 16
    caches = model.new_caches(B, L + 1)
    ids = torch.zeros(B, L, dtype=torch.long, device="meta")
    for tokens, start in ((L, 0), (1, L)):
        mask = torch.ones(B, start + tokens, device="meta")
        with comm.stats.track() as real:
            model(ids[:, :tokens], attention_mask=mask, caches=caches, start=start, last_only=True)
        ours = tp_forward_collectives(
            cfg, tp, batch=B, tokens=tokens, width=4, layers=cfg.num_layers, first=True, last=True
        )
        assert {c.key(): {"calls": c.calls, "bytes": c.bytes} for c in ours} == {
            k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in real.snapshot().items()
        }


def test_training_step_with_measured_training_terms_by_hand():
    """This host's calibration measures what a training micro-step adds to the matmul
    roofline: the share of the matmul FLOP/s it reaches, its fixed time per layer and per
    micro-step, and the optimizer update's bytes/s; gradient accumulation, in the
    weight-gradient products (kernels.wgrad), reads .grad once more for every micro-batch after
    the first; the gradient norm and clipping make three passes over the gradients a step."""
    wl = TrainingWorkload(global_batch=2, micro_batch=1, seq_len=128, precision="fp32")  # m = 2
    measured = dict(train_efficiency=0.5, train_layer_overhead_us=300.0, train_step_overhead_us=600.0,
                    optimizer_gbps=10.0)  # fmt: skip
    t = predict_training(BENCH, _cluster(devices=1, **measured), Layout(1, 1, 1), wl)
    flops = 128 * training_flops_per_token(BENCH, 128, recompute=False)  # compute-bound at 128 tokens
    n = stage_params(BENCH, 1)
    micro = flops / (1e12 * 0.5) + (8 * 300 + 600) * 1e-6 + n * 4 / 100e9 * (2 - 1) / 2
    assert t.forward_s + t.backward_s == pytest.approx(micro, rel=1e-9)
    assert t.step.compute_s == pytest.approx(2 * micro + 2 * n * 16 / 10e9 + 3 * n * 4 / 100e9, rel=1e-9)
    assert t.step.comm_s == 0 and t.step.bubble_s == 0
    # the presets measure none of it: the matmul rate, the decode overheads once per pass
    plain = predict_training(BENCH, _cluster(devices=1), Layout(1, 1, 1), wl)
    assert plain.forward_s + plain.backward_s == pytest.approx(flops / 1e12 + n * 4 / 100e9 / 2, rel=1e-9)
    with pytest.raises(PlannerError, match="training 1.5"):
        _cluster(train_efficiency=1.5)


def test_measured_rows_rates_are_interpolated_and_the_peak_is_the_roofline():
    from shardwise.planner.specs import Device

    table = ((2, 0.01), (8, 0.03), (32, 0.06))
    dev = Device("cpu", 16, {"float32": 0.1}, 10, matmul_efficiency=1.0, mem_efficiency=1.0, rows_tflops=table)
    for m, v in table:
        assert dev.flops_at(m, "float32") == pytest.approx(v * 1e12)
    assert dev.flops_at(4, "float32") == pytest.approx((0.01 * 0.03) ** 0.5 * 1e12)  # log-log midpoint
    rates = [dev.flops_at(m, "float32") for m in range(2, 80)]
    assert rates == sorted(rates)  # more rows never run slower per FLOP here
    assert dev.flops_at(1, "float32") == dev.flops_at(64, "float32") == dev.flops("float32")  # gemv; past 2 x 32
    assert dev.flops_at(8, "bfloat16") == dev.flops("bfloat16")  # measured for fp32 only
    busy = Device("cpu", 16, {"float32": 0.1}, 10, matmul_efficiency=1.0, mem_efficiency=1.0, rows_tflops=table,
                  busy_compute=0.5)  # fmt: skip
    assert busy.flops_at(8, "float32", busy=True) == pytest.approx(0.015e12)  # no busy table: scaled
    plain = Device("gpu", 80, {"float32": 60.0}, 2000)
    assert plain.flops_at(8, "float32") == plain.flops("float32")


def test_serving_throughput_counts_the_servers_own_work_and_pipelines_keep_steps_in_flight():
    from dataclasses import replace

    from shardwise.planner.predict import Layout, predict_inference
    from shardwise.planner.presets import cluster_preset, model_preset

    cfg, cluster = model_preset("llama-3-8b"), cluster_preset("dgx-h100")
    kw = dict(prompt_len=128, output_len=32, width=2, dtype="bfloat16")
    plain = predict_inference(cfg, cluster, Layout(1, 1, 1), batch=16, **kw)
    assert plain.serving_tokens_per_s == pytest.approx(16 * 32 / (plain.prefill.total_s + 31 * plain.decode.total_s))
    busy = replace(cluster, device=replace(cluster.device, serve_step_us=1000.0, serve_row_us=100.0,
                                           serve_request_us=50_000.0))  # fmt: skip
    slow = predict_inference(cfg, busy, Layout(1, 1, 1), batch=16, **kw)
    per_token = plain.decode.total_s + (1000 + 16 * 100) * 1e-6
    assert slow.serving_tokens_per_s == pytest.approx(16 * 32 / (plain.prefill.total_s + 0.05 + 31 * per_token))
    # pp=2 with 16 sequences: two groups of 8, each stage busy most of the time
    pp = predict_inference(cfg, cluster, Layout(1, 2, 1), batch=16, **kw)
    assert len(pp.stage_s) == 2 and 0 <= pp.idle_fraction < 0.2
    assert pp.decode.total_s == pytest.approx(max(sum(pp.stage_s), 2 * max(pp.stage_s)))
    one = predict_inference(cfg, cluster, Layout(1, 2, 1), batch=1, **kw)  # nothing to overlap
    assert one.idle_fraction == pytest.approx(0.5, abs=0.1)
