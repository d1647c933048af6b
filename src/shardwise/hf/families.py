"""The Hugging Face families shardwise runs with its own model code.

A family is data: how to read its config.json into a ModelConfig, and one name table
from our parameter names to its checkpoint tensors. The model class and the sharding
plan come from the config (see shardwise.sharding.plans.decoder).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from shardwise.hf.sources import Src
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.sharding.plan import Plan
from shardwise.sharding.plans.decoder import decoder_plan

__all__ = ["Family", "FAMILIES", "family_for", "register", "supported_model_types"]

NameTable = dict[str, list[Src]]

_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    config: Callable[[dict], ModelConfig]
    names: Callable[[ModelConfig, str], NameTable]
    """(config, prefix) -> {our parameter name: [checkpoint sources]}."""
    prefixes: tuple[str, ...]
    """Candidate prefixes of the base model's tensors, e.g. "model." (CausalLM) or "" (base)."""
    probe: str
    """A tensor every checkpoint of the family has, without prefix: finds the prefix."""
    ignore: tuple[str, ...] = ()
    """fnmatch patterns of checkpoint tensors that are not weights we use (buffers)."""
    model: Callable[[ModelConfig], nn.Module] = DecoderLM
    """The plain model class, built on the meta device."""
    plan: Callable[[ModelConfig], Plan] = decoder_plan
    """The sharding plan for that model."""


def _act(d: dict, *keys: str) -> str:
    for k in keys:
        if d.get(k):
            if d[k] not in _ACTS:
                raise NotImplementedError(f"activation {d[k]!r} is not supported; supported: {', '.join(_ACTS)}")
            return _ACTS[d[k]]
    return "silu"


def _rope(d: dict) -> dict:
    """rope_theta, partial factor and scaling from transformers 5 (rope_parameters) or 4 (rope_scaling)."""
    rp = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or None
    if scaling is None and rp.get("rope_type", "default") != "default":
        scaling = rp
    theta = rp.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    partial = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", d.get("rotary_pct", 1.0)))
    if scaling is not None and "rope_type" not in scaling and "type" in scaling:
        scaling = {**scaling, "rope_type": scaling["type"]}
    return {"rope_theta": float(theta), "partial": float(partial), "rope_scaling": scaling}


def _dtype(d: dict) -> str:
    return str(d.get("dtype") or d.get("torch_dtype") or "float32").replace("torch.", "")


def _llama_like(d: dict, family: str) -> ModelConfig:
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    rope = _rope(d)
    bias = bool(d.get("attention_bias", False))
    window = d.get("sliding_window")
    if family == "qwen2" or family == "qwen3":
        if d.get("use_sliding_window"):
            raise NotImplementedError(f"{family} with use_sliding_window=True is not supported")
        window = None
    return ModelConfig(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm="rms",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        norm_offset=1.0 if family == "gemma" else 0.0,
        act=_act(d, "hidden_activation", "hidden_act") if family == "gemma" else _act(d, "hidden_act"),
        qkv_bias=bias or family == "qwen2",
        o_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        positions="rope",
        max_positions=d.get("max_position_embeddings", 2048),
        rope_theta=rope["rope_theta"],
        rope_dim=int(head_dim * rope["partial"]),
        rope_scaling=rope["rope_scaling"],
        embed_scale=math.sqrt(d["hidden_size"]) if family == "gemma" else 1.0,
        tie_embeddings=bool(d.get("tie_word_embeddings", family == "gemma")),
        sliding_window=window,
        dtype=_dtype(d),
    )


def _llama_names(cfg: ModelConfig, prefix: str, *, fused: bool = False) -> NameTable:
    nq, nkv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    t: NameTable = {"embed.weight": [Src(f"{prefix}embed_tokens.weight")], "norm.weight": [Src(f"{prefix}norm.weight")]}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = [Src("lm_head.weight")]
    for i in range(cfg.num_layers):
        p, q = f"{prefix}layers.{i}.", f"layers.{i}."
        att = f"{p}self_attn."
        if fused:  # Phi-3 stores qkv_proj and gate_up_proj already fused, in our order
            t[q + "attn.qkv.weight"] = [Src(att + "qkv_proj.weight", nq + 2 * nkv)]
            t[q + "mlp.up.weight"] = [Src(f"{p}mlp.gate_up_proj.weight", 2 * inter)]
        else:
            t[q + "attn.qkv.weight"] = [
                Src(att + f"{x}_proj.weight", n) for x, n in (("q", nq), ("k", nkv), ("v", nkv))
            ]
            t[q + "mlp.up.weight"] = [Src(f"{p}mlp.gate_proj.weight", inter), Src(f"{p}mlp.up_proj.weight", inter)]
        if cfg.qkv_bias:
            t[q + "attn.qkv.bias"] = [Src(att + f"{x}_proj.bias", n) for x, n in (("q", nq), ("k", nkv), ("v", nkv))]
        t[q + "attn.o.weight"] = [Src(att + "o_proj.weight")]
        if cfg.o_bias:
            t[q + "attn.o.bias"] = [Src(att + "o_proj.bias")]
        if cfg.qk_norm:
            t[q + "attn.q_norm.weight"] = [Src(att + "q_norm.weight")]
            t[q + "attn.k_norm.weight"] = [Src(att + "k_norm.weight")]
        t[q + "mlp.down.weight"] = [Src(f"{p}mlp.down_proj.weight")]
        if cfg.mlp_bias:
            t[q + "mlp.up.bias"] = [Src(f"{p}mlp.gate_proj.bias", inter), Src(f"{p}mlp.up_proj.bias", inter)]
            t[q + "mlp.down.bias"] = [Src(f"{p}mlp.down_proj.bias")]
        t[q + "attn_norm.weight"] = [Src(f"{p}input_layernorm.weight")]
        t[q + "mlp_norm.weight"] = [Src(f"{p}post_attention_layernorm.weight")]
    return t


def _llama_family(name: str, model_types: tuple[str, ...], fused: bool = False) -> Family:
    return Family(
        name=name,
        model_types=model_types,
        config=lambda d: _llama_like(d, name),
        names=lambda cfg, prefix: _llama_names(cfg, prefix, fused=fused),
        prefixes=("model.", ""),
        probe="embed_tokens.weight",
        ignore=("*rotary_emb.inv_freq",),
    )


def _gpt2_config(d: dict) -> ModelConfig:
    hidden, heads = d["n_embd"], d["n_head"]
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
        raise NotImplementedError("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn")
    return ModelConfig(
        family="gpt2",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        num_layers=d["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm="layer",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        act=_act(d, "activation_function"),
        gated_mlp=False,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        positions="learned",
        max_positions=d.get("n_positions", 1024),
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        dtype=_dtype(d),
    )


def _gpt2_names(cfg: ModelConfig, prefix: str) -> NameTable:
    # NOTE: Conv1D weights are stored (in, out); c_attn's columns are [q | k | v], our order.
    t: NameTable = {
        "embed.weight": [Src(f"{prefix}wte.weight")],
        "pos_embed.weight": [Src(f"{prefix}wpe.weight")],
        "norm.weight": [Src(f"{prefix}ln_f.weight")],
        "norm.bias": [Src(f"{prefix}ln_f.bias")],
    }
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = [Src("lm_head.weight")]
    for i in range(cfg.num_layers):
        p, q = f"{prefix}h.{i}.", f"layers.{i}."
        for ours, theirs in (
            ("attn.qkv", "attn.c_attn"),
            ("attn.o", "attn.c_proj"),
            ("mlp.up", "mlp.c_fc"),
            ("mlp.down", "mlp.c_proj"),
        ):
            t[f"{q}{ours}.weight"] = [Src(f"{p}{theirs}.weight", transposed=True)]
            t[f"{q}{ours}.bias"] = [Src(f"{p}{theirs}.bias")]
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            t[f"{q}{ours}.weight"] = [Src(f"{p}{theirs}.weight")]
            t[f"{q}{ours}.bias"] = [Src(f"{p}{theirs}.bias")]
    return t


def _neox_config(d: dict) -> ModelConfig:
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    rope = _rope(d)
    head_dim = hidden // heads
    return ModelConfig(
        family="gpt_neox",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        norm="layer",
        norm_eps=d.get("layer_norm_eps", 1e-5),
        act=_act(d, "hidden_act"),
        gated_mlp=False,
        qkv_bias=bool(d.get("attention_bias", True)),
        o_bias=bool(d.get("attention_bias", True)),
        mlp_bias=True,
        positions="rope",
        max_positions=d.get("max_position_embeddings", 2048),
        rope_theta=rope["rope_theta"],
        rope_dim=int(head_dim * rope["partial"]),
        rope_scaling=rope["rope_scaling"],
        parallel_residual=bool(d.get("use_parallel_residual", True)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        dtype=_dtype(d),
    )


def _neox_names(cfg: ModelConfig, prefix: str) -> NameTable:
    # NOTE: query_key_value is stored per head: [h0: q k v | h1: q k v | ...].
    t: NameTable = {
        "embed.weight": [Src(f"{prefix}embed_in.weight")],
        "norm.weight": [Src(f"{prefix}final_layer_norm.weight")],
        "norm.bias": [Src(f"{prefix}final_layer_norm.bias")],
    }
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = [Src("embed_out.weight")]
    for i in range(cfg.num_layers):
        p, q = f"{prefix}layers.{i}.", f"layers.{i}."
        t[f"{q}attn.qkv.weight"] = [Src(f"{p}attention.query_key_value.weight", heads=cfg.num_heads, parts=3)]
        t[f"{q}attn.o.weight"] = [Src(f"{p}attention.dense.weight")]
        if cfg.qkv_bias:
            t[f"{q}attn.qkv.bias"] = [Src(f"{p}attention.query_key_value.bias", heads=cfg.num_heads, parts=3)]
            t[f"{q}attn.o.bias"] = [Src(f"{p}attention.dense.bias")]
        for ours, theirs in (("mlp.up", "mlp.dense_h_to_4h"), ("mlp.down", "mlp.dense_4h_to_h")):
            t[f"{q}{ours}.weight"] = [Src(f"{p}{theirs}.weight")]
            t[f"{q}{ours}.bias"] = [Src(f"{p}{theirs}.bias")]
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            t[f"{q}{ours}.weight"] = [Src(f"{p}{theirs}.weight")]
            t[f"{q}{ours}.bias"] = [Src(f"{p}{theirs}.bias")]
    return t


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _llama_family("llama", ("llama",)),
        _llama_family("mistral", ("mistral",)),
        _llama_family("qwen2", ("qwen2",)),
        _llama_family("qwen3", ("qwen3",)),
        _llama_family("gemma", ("gemma",)),
        _llama_family("phi3", ("phi3",), fused=True),
        Family(
            "gpt2",
            ("gpt2",),
            _gpt2_config,
            _gpt2_names,
            ("transformer.", ""),
            "wte.weight",
            ("*.attn.bias", "*.attn.masked_bias"),
        ),
        Family(
            "gpt_neox",
            ("gpt_neox",),
            _neox_config,
            _neox_names,
            ("gpt_neox.", ""),
            "embed_in.weight",
            ("*.attention.bias", "*.attention.masked_bias", "*rotary_emb.inv_freq"),
        ),
    )
}


def register(family: Family) -> Family:
    """Add a family (used by modules that define one, e.g. shardwise.hf.bert)."""
    FAMILIES[family.name] = family
    return family


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.model_types)


def family_for(hf_config: dict) -> Family | None:
    """The family of a config.json, or None (the caller may fall back to an automatic plan)."""
    model_type = hf_config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    return None
