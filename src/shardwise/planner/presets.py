"""Named models and clusters, as data.

Model presets are the public config.json of each model (only the fields shardwise reads),
so they go through the same family code as a checkpoint directory. Cluster presets are
datasheet figures; the achieved fractions (efficiencies, all-reduce bus bandwidth) are
assumptions written next to them. `this-host` is no preset but measurements of this
machine (shardwise.bench.calibrate.this_host; `shardwise plan` wires it in).
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from pathlib import Path

from shardwise.models.config import ModelConfig
from shardwise.planner.specs import Cluster, Device, Link, PlannerError

__all__ = [
    "MODEL_PRESETS",
    "CLUSTER_PRESETS",
    "model_preset",
    "cluster_preset",
    "resolve_model",
    "preset_key",
    "customize",
    "THIS_HOST",
]

THIS_HOST = "this-host"
"""The cluster measured on this machine (shardwise.bench.calibrate), not a preset."""

_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

MODEL_PRESETS: dict[str, dict] = {
    "llama-2-7b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    },
    "llama-3-8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        **_LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b": {
        **_LLAMA,
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
    },
    "qwen2-7b": {  # 28 query heads / 4 KV heads: no even split over 8 devices
        **_LLAMA,
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
    "qwen2-72b": {
        **_LLAMA,
        "model_type": "qwen2",
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts of 14336, top-2, 46.7B parameters
        **_LLAMA,
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, top-8, every layer MoE, 30.5B
        **_LLAMA,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16",
    },
    "qwen2-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B config.json: 60 experts of 1408, top-4, a shared expert of 5632
        **_LLAMA,
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16",
    },
    "gpt3-175b": {  # Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, context 2048
        "model_type": "gpt2",
        "n_embd": 12288,
        "n_layer": 96,
        "n_head": 96,
        "n_inner": 49152,
        "n_positions": 2048,
        "vocab_size": 50257,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
    },
    # Narayanan et al. 2021 (Megatron-LM on GPU clusters), table 1: GPT shapes, vocabulary 51,200,
    # sequence 2048; trained at tp=8 x pp=35 on 2520 A100s (530B) and tp=8 x pp=64 on 3072 (1T)
    "megatron-530b": {
        "model_type": "gpt2",
        "n_embd": 20480,
        "n_layer": 105,
        "n_head": 128,
        "n_inner": 81920,
        "n_positions": 2048,
        "vocab_size": 51200,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
    },
    "megatron-1t": {
        "model_type": "gpt2",
        "n_embd": 25600,
        "n_layer": 128,
        "n_head": 160,
        "n_inner": 102400,
        "n_positions": 2048,
        "vocab_size": 51200,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
    },
    "bench-156m": {  # benchmarks/bench_model.py: the model the planner is validated against
        **_LLAMA,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    },
    "debug": {  # tiny, for tests
        **_LLAMA,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "torch_dtype": "float32",
    },
}

# Datasheet figures. Assumptions: large matmuls reach 60% of dense peak, weight streaming 80%
# of memory bandwidth; NCCL all-reduce bus bandwidth and latency as nccl-tests typically
# reports for the link; 20 us of kernel launches per layer (eager PyTorch); 1 GiB CUDA context.
_GPU = dict(matmul_efficiency=0.6, mem_efficiency=0.8, layer_overhead_us=20.0, step_overhead_us=100.0, reserved_gib=1)
CLUSTER_PRESETS: dict[str, dict] = {
    "dgx-a100-80gb": dict(
        device=dict(name="A100-SXM4-80GB", memory_gib=80, mem_bw_gbps=2039, **_GPU,
                    peak_tflops={"bfloat16": 312, "float16": 312, "float32": 19.5}),
        devices_per_node=8,
        intra=dict(name="NVLink 3 (NVSwitch, 600 GB/s)", busbw_gbps=230, latency_us=10),
        inter=dict(name="InfiniBand HDR (8x200 Gb/s per node)", busbw_gbps=20, latency_us=20),
    ),
    "dgx-h100": dict(
        device=dict(name="H100-SXM5-80GB", memory_gib=80, mem_bw_gbps=3350, **_GPU,
                    peak_tflops={"bfloat16": 989, "float16": 989, "float32": 67}),
        devices_per_node=8,
        intra=dict(name="NVLink 4 (NVSwitch, 900 GB/s)", busbw_gbps=450, latency_us=10),
        inter=dict(name="InfiniBand NDR (8x400 Gb/s per node)", busbw_gbps=40, latency_us=20),
    ),
    "pcie-8x-rtx4090": dict(
        device=dict(name="RTX 4090 24GB", memory_gib=24, mem_bw_gbps=1008, **_GPU,
                    peak_tflops={"bfloat16": 165, "float16": 165, "float32": 82.6}),
        devices_per_node=8,
        intra=dict(name="PCIe 4.0 x16 (no P2P, via host)", busbw_gbps=10, latency_us=25),
        inter=dict(name="25 GbE (TCP)", busbw_gbps=2.5, latency_us=50),
    ),
}  # fmt: skip


def preset_key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _unknown(kind: str, name: str, known: list[str]) -> PlannerError:
    close = difflib.get_close_matches(preset_key(name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PlannerError(f"unknown {kind} preset {name!r}{hint}; known: {', '.join(known)}")


def model_preset(name: str) -> ModelConfig:
    from shardwise.hf.families import family_for

    key = preset_key(name)
    if key not in MODEL_PRESETS:
        raise _unknown("model", name, list(MODEL_PRESETS))
    raw = MODEL_PRESETS[key]
    return family_for(raw).config(raw, where=f"model preset {key!r}")


def resolve_model(spec: str | Path) -> tuple[str, ModelConfig]:
    """(label, ModelConfig) from a checkpoint directory, a config.json (both through
    shardwise.hf.resolve_model), or a preset name."""
    from shardwise.hf import CheckpointError
    from shardwise.hf import resolve_model as resolve

    path = Path(spec)
    if path.exists():
        try:
            return str(path), _decoder_only(resolve(path).config, str(path))
        except CheckpointError as e:
            raise PlannerError(str(e)) from None
    if key_is_path_like(str(spec)) and preset_key(str(spec)) not in MODEL_PRESETS:
        raise PlannerError(
            f"{spec}: no such file or directory, and not a model preset; presets: {', '.join(MODEL_PRESETS)}"
        )
    return preset_key(str(spec)), model_preset(str(spec))


def key_is_path_like(spec: str) -> bool:
    return "/" in spec or spec.endswith(".json")


def _decoder_only(cfg: ModelConfig, label: str) -> ModelConfig:
    if not cfg.causal or cfg.family == "bert":
        raise PlannerError(f"{label}: the planner models decoder LMs; {cfg.family} is an encoder")
    return cfg


def cluster_preset(name: str, *, nodes: int = 1) -> Cluster:
    """A cluster of `nodes` nodes of a preset (datasheet figures). `this-host` is measured
    instead: shardwise.bench.calibrate.this_host()."""
    key = preset_key(name)
    if nodes < 1:
        raise PlannerError(f"nodes must be >= 1, got {nodes}")
    if key == THIS_HOST:
        raise PlannerError("this-host is measured, not a preset: use shardwise.bench.calibrate.this_host()")
    if key not in CLUSTER_PRESETS:
        raise _unknown("cluster", name, [*CLUSTER_PRESETS, THIS_HOST])
    p = CLUSTER_PRESETS[key]
    per_node = p["devices_per_node"]
    return Cluster(
        name=key,
        device=Device(**p["device"]),
        devices=nodes * per_node,
        devices_per_node=per_node,
        intra=Link(**p["intra"]),
        inter=Link(**p["inter"]),
    )


def customize(
    cluster: Cluster,
    *,
    devices: int | None = None,
    devices_per_node: int | None = None,
    memory_gib: float | None = None,
    peak_tflops: float | None = None,
    mem_bw_gbps: float | None = None,
    intra_gbps: float | None = None,
    intra_latency_us: float | None = None,
    inter_gbps: float | None = None,
    inter_latency_us: float | None = None,
) -> Cluster:
    """The cluster with some numbers replaced (None keeps the preset's); validated again.

    peak_tflops replaces the peak of every dtype: give the one of the dtype you compute in.
    inter_gbps alone, on a measured inter-node link (this-host's hosts: its veth), keeps the
    link's measured per-message costs and limits its transfers to that rate (specs.Link.shaped).
    """
    dev = cluster.device
    dev_kw = {k: v for k, v in (("memory_gib", memory_gib), ("mem_bw_gbps", mem_bw_gbps)) if v is not None}
    if peak_tflops is not None:
        dev_kw["peak_tflops"] = {k: peak_tflops for k in (dev.peak_tflops or {"float32": 0})}
    intra = cluster.intra
    if intra_gbps is not None or intra_latency_us is not None:
        intra = Link(
            f"{intra.name} (custom)",
            intra.busbw_gbps if intra_gbps is None else intra_gbps,
            intra.latency_us if intra_latency_us is None else intra_latency_us,
        )
    inter = cluster.inter
    if inter is not None and inter.points and inter_gbps is not None and inter_latency_us is None:
        # a measured link (this-host's veth): its per-message costs stay, its transfers at the rate
        inter = inter.shaped(inter_gbps, name=f"{inter.name.split(' at ')[0]} at {inter_gbps:g} GB/s")
    elif inter_gbps is not None or inter_latency_us is not None:
        if inter is None and (inter_gbps is None or inter_latency_us is None):
            raise PlannerError("an inter-node link needs both --inter-gbps and --inter-latency-us")
        inter = Link(
            "inter-node (custom)" if inter is None else f"{inter.name} (custom)",
            inter.busbw_gbps if inter_gbps is None else inter_gbps,
            inter.latency_us if inter_latency_us is None else inter_latency_us,
        )
    per_node = cluster.devices_per_node if devices_per_node is None else devices_per_node
    n = cluster.devices if devices is None else devices
    if devices_per_node is not None and devices is None:
        n = per_node * cluster.nodes
    return replace(
        cluster,
        device=replace(dev, **dev_kw) if dev_kw else dev,
        devices=n,
        devices_per_node=per_node,
        intra=intra,
        inter=inter,
    )
