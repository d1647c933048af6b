"""The Hugging Face families shardwise runs with its own model code: one table, FAMILIES.

A family is one keyword entry: the config.json model_types it claims, a config reader
(config.json -> ModelConfig), a name table (shardwise.hf.names), where its tensors sit
(prefixes, a probe tensor, buffers to ignore), the model class and its sharding plan,
and its quirks as fields that the shared readers consult. To add a family that fits
DecoderLM (or BertEncoder), add an entry here and, when no reader fits, one reader
below; docs/models.md walks through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

from shardwise.hf.checkpoint import CheckpointError
from shardwise.hf.names import (
    NameTable,
    bert_names,
    gemma3_names,
    gpt2_names,
    llama_names,
    mixtral_names,
    neox_names,
    phi3_names,
    qwen_moe_names,
)
from shardwise.models.bert import BertEncoder
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.sharding.plan import Plan
from shardwise.sharding.plans import bert_plan, decoder_plan

__all__ = [
    "Family",
    "FAMILIES",
    "family_for",
    "supported_model_types",
    "llama_config",
    "gemma3_config",
    "gpt2_config",
    "neox_config",
    "bert_config",
    "mixtral_config",
    "qwen_moe_config",
]

_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True, kw_only=True)
class Family:
    """One family shardwise has model code for. Build entries with keywords."""

    name: str
    """Our name for it; ModelConfig.family and LoadReport.family."""
    model_types: tuple[str, ...]
    """config.json model_type values it claims."""
    reader: Callable[[dict, Family], ModelConfig]
    """(config.json as a dict, this entry) -> ModelConfig; call it through `config`."""
    names: Callable[[ModelConfig, str], NameTable]
    """(config, prefix) -> {our parameter name: [checkpoint sources]} (shardwise.hf.names)."""
    prefixes: tuple[str, ...]
    """Candidate prefixes of the base model's tensors, e.g. "model." (CausalLM) or "" (base)."""
    probe: str
    """A tensor every checkpoint of the family has, without prefix: finds the prefix."""
    ignore: tuple[str, ...] = ()
    """fnmatch patterns of checkpoint tensors that are not weights we use (buffers, task heads)."""
    model: Callable[[ModelConfig], nn.Module] = DecoderLM
    """The plain model class, built on the meta device."""
    plan: Callable[..., Plan] = decoder_plan
    """The sharding plan for that model: plan(cfg); a mixture of experts also takes
    plan(cfg, expert_parallel=True) (whole experts per tp rank)."""

    # Quirks: what sets this family apart from another one its reader also reads.
    act_keys: tuple[str, ...] = ("hidden_act",)
    """config.json keys naming the activation; the first one set wins (default silu)."""
    tie_default: bool = False
    """tie_word_embeddings when config.json does not say."""
    fixed: dict = field(default_factory=dict, hash=False)
    """ModelConfig fields that hold for every checkpoint of the family, whatever config.json
    says (Qwen2: qkv_bias=True; Qwen3: qk_norm=True; Gemma: norm_offset=1.0)."""
    scale_embeddings: bool = False
    """Token embeddings are multiplied by sqrt(hidden_size) (Gemma)."""
    window_switch: str | None = None
    """The config.json flag that turns `sliding_window` on (Qwen2/3: use_sliding_window,
    which shardwise refuses); None: `sliding_window` applies whenever it is set."""

    def config(self, raw: dict, *, where: str = "config.json") -> ModelConfig:
        """config.json (as a dict) -> ModelConfig; a missing field is a CheckpointError naming `where`."""
        try:
            cfg = self.reader(raw, self)
        except KeyError as e:
            raise CheckpointError(f"{where}: missing field {e} for a {self.name} config") from None
        return replace(cfg, **self.fixed) if self.fixed else cfg


def _act(d: dict, fam: Family) -> str:
    for k in fam.act_keys:
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


def _tie(d: dict, fam: Family) -> bool:
    return bool(d.get("tie_word_embeddings", fam.tie_default))


def llama_config(d: dict, fam: Family) -> ModelConfig:
    """Llama and the families shaped like it: RMSNorm, RoPE, a gated MLP, GQA."""
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    rope = _rope(d)
    bias = bool(d.get("attention_bias", False))
    window = d.get("sliding_window")
    if fam.window_switch is not None:
        if d.get(fam.window_switch):
            raise NotImplementedError(f"{fam.name} with {fam.window_switch}=True is not supported")
        window = None
    return ModelConfig(
        family=fam.name,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm="rms",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        act=_act(d, fam),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        positions="rope",
        max_positions=d.get("max_position_embeddings", 2048),
        rope_theta=rope["rope_theta"],
        rope_dim=int(head_dim * rope["partial"]),
        rope_scaling=rope["rope_scaling"],
        embed_scale=math.sqrt(d["hidden_size"]) if fam.scale_embeddings else 1.0,
        tie_embeddings=_tie(d, fam),
        sliding_window=window,
        dtype=_dtype(d),
    )


def gemma3_config(d: dict, fam: Family) -> ModelConfig:
    """Gemma 3 (text): Gemma's shapes with q/k norms, four norms a layer, a softmax scale of
    query_pre_attn_scalar ** -0.5, and local layers (layer_types, or every
    sliding_window_pattern-th layer global) that attend within sliding_window and rotate by
    their own unscaled base. Rope from transformers 5 (rope_parameters per layer type) or 4
    (rope_theta and rope_scaling for the global layers, rope_local_base_freq)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise NotImplementedError(f"Gemma 3 with {key}={d[key]} is not supported")
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention=True is not supported")
    rp = d.get("rope_parameters") or {}
    full, local = rp.get("full_attention"), rp.get("sliding_attention")
    if full is None:  # transformers 4: flat keys
        full = {"rope_theta": d.get("rope_theta", 1_000_000.0), **(d.get("rope_scaling") or {})}
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    if (local or {}).get("rope_type", "default") != "default":
        raise NotImplementedError(f"Gemma 3's local layers with rope_type {local['rope_type']!r} are not supported")
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise NotImplementedError(f"Gemma 3 layer_types {types} are not {n} of sliding_attention/full_attention")
    cfg = llama_config({**d, "rope_parameters": {"rope_theta": 1_000_000.0, **full}, "rope_scaling": None}, fam)
    window = d.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and not window:
        raise NotImplementedError(f"Gemma 3 with sliding_attention layers needs a sliding_window, got {window}")
    return replace(
        cfg,
        qk_norm=True,
        sandwich_norm=True,
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=window if sliding else None,
        sliding_layers=sliding or None,
        local_rope_theta=float((local or {}).get("rope_theta", 10_000.0)),
    )


def gpt2_config(d: dict, fam: Family) -> ModelConfig:
    hidden, heads = d["n_embd"], d["n_head"]
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
        raise NotImplementedError("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn")
    return ModelConfig(
        family=fam.name,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        num_layers=d["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm="layer",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        act=_act(d, fam),
        gated_mlp=False,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        positions="learned",
        max_positions=d.get("n_positions", 1024),
        tie_embeddings=_tie(d, fam),
        dtype=_dtype(d),
    )


def neox_config(d: dict, fam: Family) -> ModelConfig:
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    rope = _rope(d)
    head_dim = hidden // heads
    return ModelConfig(
        family=fam.name,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        norm="layer",
        norm_eps=d.get("layer_norm_eps", 1e-5),
        act=_act(d, fam),
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
        tie_embeddings=_tie(d, fam),
        dtype=_dtype(d),
    )


def mixtral_config(d: dict, fam: Family) -> ModelConfig:
    """Mixtral: Llama-like attention, every MLP a mixture of num_local_experts experts of width
    intermediate_size; the top-k routing weights are always renormalized."""
    cfg = llama_config(d, fam)
    return replace(
        cfg,
        num_experts=d["num_local_experts"],
        experts_per_token=d["num_experts_per_tok"],
        expert_size=d["intermediate_size"],
        norm_topk_prob=True,
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
    )


def qwen_moe_config(d: dict, fam: Family) -> ModelConfig:
    """Qwen2-MoE and Qwen3-MoE: layer i is an MoE block unless listed in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step (those keep a dense MLP of
    intermediate_size); Qwen2-MoE adds a shared expert with a sigmoid gate."""
    cfg = llama_config(d, fam)
    num = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
    step, dense = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or ())
    moe = tuple(i for i in range(cfg.num_layers) if i not in dense and (i + 1) % step == 0) if num else ()
    shared = d.get("shared_expert_intermediate_size", 0) or 0
    if fam.name == "qwen2_moe":  # q/k/v biases: config.json's qkv_bias (transformers 5), always before it
        cfg = replace(cfg, qkv_bias=bool(d.get("qkv_bias", True)))
    return replace(
        cfg,
        num_experts=num,
        experts_per_token=d["num_experts_per_tok"],
        expert_size=d["moe_intermediate_size"],
        shared_expert_size=shared,
        shared_expert_gate=bool(shared),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        moe_layers=None if len(moe) == cfg.num_layers else moe,
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
    )


# transformers builds these with add_pooling_layer=False: their checkpoints have no pooler.
_NO_POOLER = frozenset({"BertForMaskedLM", "BertLMHeadModel", "BertForTokenClassification", "BertForQuestionAnswering"})


def bert_config(d: dict, fam: Family) -> ModelConfig:
    """A BERT config.json (transformers 4 or 5); decoders are refused."""
    if d.get("is_decoder") or d.get("add_cross_attention"):
        raise NotImplementedError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    pos = d.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise NotImplementedError(f"BERT position_embedding_type {pos!r} is not supported; supported: absolute")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    archs = d.get("architectures") or []
    return ModelConfig(
        family=fam.name,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm="layer",
        norm_eps=d.get("layer_norm_eps", 1e-12),
        act=_act(d, fam),
        gated_mlp=False,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        positions="learned",
        max_positions=d.get("max_position_embeddings", 512),
        post_norm=True,
        causal=False,
        type_vocab_size=d.get("type_vocab_size", 2),
        dtype=_dtype(d),
        extra={"pooler": not archs or any(a not in _NO_POOLER for a in archs)},
    )


_LLAMA_LIKE = dict(reader=llama_config, names=llama_names, prefixes=("model.", ""), probe="embed_tokens.weight")
_ROTARY = ("*rotary_emb.inv_freq",)  # a buffer older transformers saved

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(name="llama", model_types=("llama",), **_LLAMA_LIKE, ignore=_ROTARY),
        Family(name="mistral", model_types=("mistral",), **_LLAMA_LIKE, ignore=_ROTARY),
        Family(
            name="qwen2", model_types=("qwen2",), **_LLAMA_LIKE, ignore=_ROTARY,
            fixed={"qkv_bias": True}, window_switch="use_sliding_window",
        ),
        Family(
            name="qwen3", model_types=("qwen3",), **_LLAMA_LIKE, ignore=_ROTARY,
            fixed={"qk_norm": True}, window_switch="use_sliding_window",
        ),
        Family(
            name="mixtral", model_types=("mixtral",), reader=mixtral_config, names=mixtral_names,
            prefixes=("model.", ""), probe="embed_tokens.weight", ignore=_ROTARY,
        ),
        Family(
            name="qwen2_moe", model_types=("qwen2_moe",), reader=qwen_moe_config, names=qwen_moe_names,
            prefixes=("model.", ""), probe="embed_tokens.weight", ignore=_ROTARY,
            window_switch="use_sliding_window",
        ),
        Family(
            name="qwen3_moe", model_types=("qwen3_moe",), reader=qwen_moe_config, names=qwen_moe_names,
            prefixes=("model.", ""), probe="embed_tokens.weight", ignore=_ROTARY,
            fixed={"qk_norm": True}, window_switch="use_sliding_window",
        ),
        Family(
            name="gemma", model_types=("gemma",), **_LLAMA_LIKE, ignore=_ROTARY,
            act_keys=("hidden_activation", "hidden_act"), tie_default=True, fixed={"norm_offset": 1.0},
            scale_embeddings=True,
        ),
        Family(
            name="gemma3", model_types=("gemma3_text",), reader=gemma3_config, names=gemma3_names,
            prefixes=("model.", ""), probe="embed_tokens.weight", ignore=_ROTARY,
            act_keys=("hidden_activation", "hidden_act"), tie_default=True, fixed={"norm_offset": 1.0},
            scale_embeddings=True,
        ),
        Family(
            name="phi3", model_types=("phi3",), reader=llama_config, names=phi3_names, prefixes=("model.", ""),
            probe="embed_tokens.weight", ignore=_ROTARY,
        ),
        Family(
            name="gpt2", model_types=("gpt2",), reader=gpt2_config, names=gpt2_names,
            prefixes=("transformer.", ""), probe="wte.weight", ignore=("*.attn.bias", "*.attn.masked_bias"),
            act_keys=("activation_function",), tie_default=True,
        ),
        Family(
            name="gpt_neox", model_types=("gpt_neox",), reader=neox_config, names=neox_names,
            prefixes=("gpt_neox.", ""), probe="embed_in.weight",
            ignore=("*.attention.bias", "*.attention.masked_bias", *_ROTARY),
        ),
        Family(
            name="bert", model_types=("bert",), reader=bert_config, names=bert_names,
            # BertModel checkpoints have no prefix; BertForPreTraining / BertForMaskedLM / ... have "bert."
            prefixes=("bert.", ""), probe="embeddings.word_embeddings.weight",
            ignore=(
                "*embeddings.position_ids",  # buffers that older transformers saved
                "*embeddings.token_type_ids",
                "cls.*",  # the MLM / next-sentence heads of BertForPreTraining and BertForMaskedLM
                # A pooler the config's architectures say is absent (bert-base-uncased is saved as
                # BertForMaskedLM but still carries one); when the model has a pooler it is read.
                "*pooler.dense.weight",
                "*pooler.dense.bias",
            ),
            model=BertEncoder, plan=bert_plan,
        ),
    )
}  # fmt: skip


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.model_types)


def family_for(hf_config: dict) -> Family | None:
    """The family of a config.json, or None (the caller may fall back to an automatic plan)."""
    model_type = hf_config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    return None
