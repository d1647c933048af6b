"""Name tables: where each of our parameters comes from in a Hugging Face checkpoint.

A name table maps (config, prefix) to {our parameter name: [checkpoint sources]}; the
prefix is the base model's ("model.", "transformer.", ... or "" for a base checkpoint).
One table per checkpoint naming scheme; families that name their tensors alike share one
(Llama, Mistral, Qwen2/3 and Gemma all use llama_names).
"""

from __future__ import annotations

from shardwise.hf.sources import Src
from shardwise.models.config import ModelConfig

__all__ = [
    "NameTable",
    "llama_names",
    "phi3_names",
    "gemma3_names",
    "mixtral_names",
    "qwen_moe_names",
    "gpt2_names",
    "neox_names",
    "bert_names",
]

NameTable = dict[str, list[Src]]


def llama_names(cfg: ModelConfig, prefix: str, *, fused: bool = False) -> NameTable:
    """Llama's names: separate q/k/v and gate/up projections (fused=True: Phi-3's)."""
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


def phi3_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """Phi-3's names: Llama's, with qkv_proj and gate_up_proj stored fused."""
    return llama_names(cfg, prefix, fused=True)


def gemma3_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """Gemma 3's names: Llama's, with a norm on each side of each sublayer. Its
    post_attention_layernorm follows attention (our attn_post_norm), and the MLP's input
    norm is pre_feedforward_layernorm (Llama's post_attention_layernorm)."""
    t = llama_names(cfg, prefix)
    for i in range(cfg.num_layers):
        p, q = f"{prefix}layers.{i}.", f"layers.{i}."
        t[q + "attn_post_norm.weight"] = [Src(f"{p}post_attention_layernorm.weight")]
        t[q + "mlp_norm.weight"] = [Src(f"{p}pre_feedforward_layernorm.weight")]
        t[q + "mlp_post_norm.weight"] = [Src(f"{p}post_feedforward_layernorm.weight")]
    return t


def _moe_names(t: NameTable, cfg: ModelConfig, prefix: str, block: str, gate: str, up: str, down: str) -> None:
    """Replace each MoE layer's dense MLP entries by the router and the stacked experts:
    up = [gate_0; up_0; gate_1; up_1; ...] and down = [down_0; down_1; ...] by rows
    (shardwise.models.moe), read per expert tensor."""
    inter = cfg.expert_size
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p, q = f"{prefix}layers.{i}.{block}.", f"layers.{i}.mlp."
        for k in ("up.weight", "down.weight", "up.bias", "down.bias"):
            t.pop(q + k, None)
        t[q + "gate.weight"] = [Src(p + "gate.weight")]
        ex = [f"{p}experts.{e}." for e in range(cfg.num_experts)]
        t[q + "experts.up"] = [Src(f"{x}{w}.weight", inter) for x in ex for w in (gate, up)]
        t[q + "experts.down"] = [Src(f"{x}{down}.weight") for x in ex]
        if cfg.shared_expert_size:
            s = f"{p}shared_expert."
            t[q + "shared.up.weight"] = [
                Src(s + "gate_proj.weight", cfg.shared_expert_size),
                Src(s + "up_proj.weight", cfg.shared_expert_size),
            ]
            t[q + "shared.down.weight"] = [Src(s + "down_proj.weight")]
            if cfg.shared_expert_gate:
                t[q + "shared_gate.weight"] = [Src(p + "shared_expert_gate.weight")]


def mixtral_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """Mixtral's names: Llama's attention; block_sparse_moe.gate and experts.{e}.w1 (gate),
    w3 (up), w2 (down)."""
    t = llama_names(cfg, prefix)
    _moe_names(t, cfg, prefix, "block_sparse_moe", "w1", "w3", "w2")
    return t


def qwen_moe_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """Qwen2-MoE / Qwen3-MoE names: Llama's; mlp.gate and mlp.experts.{e}.gate_proj/up_proj/
    down_proj, plus Qwen2-MoE's mlp.shared_expert and mlp.shared_expert_gate."""
    t = llama_names(cfg, prefix)
    _moe_names(t, cfg, prefix, "mlp", "gate_proj", "up_proj", "down_proj")
    return t


def gpt2_names(cfg: ModelConfig, prefix: str) -> NameTable:
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


def neox_names(cfg: ModelConfig, prefix: str) -> NameTable:
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


def bert_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """BERT's names; q, k and v are fused into our qkv. The pooler only when the model has one."""
    e = f"{prefix}embeddings."
    t: NameTable = {
        "embed.weight": [Src(e + "word_embeddings.weight")],
        "pos_embed.weight": [Src(e + "position_embeddings.weight")],
        "embed_norm.weight": [Src(e + "LayerNorm.weight")],
        "embed_norm.bias": [Src(e + "LayerNorm.bias")],
    }
    if cfg.type_vocab_size > 0:
        t["type_embed.weight"] = [Src(e + "token_type_embeddings.weight")]
    hidden = cfg.num_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        p, q = f"{prefix}encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [Src(f"{p}attention.self.{x}.{kind}", hidden) for x in ("query", "key", "value")]
            t[f"{q}attn.qkv.{kind}"] = qkv
            for ours, theirs in (
                ("attn.o", "attention.output.dense"),
                ("attn_norm", "attention.output.LayerNorm"),
                ("mlp.up", "intermediate.dense"),
                ("mlp.down", "output.dense"),
                ("mlp_norm", "output.LayerNorm"),
            ):
                t[f"{q}{ours}.{kind}"] = [Src(f"{p}{theirs}.{kind}")]
    if cfg.extra.get("pooler", True):
        t["pooler.weight"] = [Src(f"{prefix}pooler.dense.weight")]
        t["pooler.bias"] = [Src(f"{prefix}pooler.dense.bias")]
    return t
