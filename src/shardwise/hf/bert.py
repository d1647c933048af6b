"""The BERT family: config.json -> ModelConfig, and our names -> Hugging Face tensor names.

Importing this module registers the family (shardwise.hf imports it), so
load_pretrained reads BertModel checkpoints ("" prefix) and the encoder of
BertForPreTraining / BertForMaskedLM / ... checkpoints ("bert." prefix). Their task
heads ("cls.*") are not part of the encoder and are skipped.
"""

from __future__ import annotations

from shardwise.hf.families import Family, NameTable, _act, _dtype, register
from shardwise.hf.sources import Src
from shardwise.models.bert import BertEncoder
from shardwise.models.config import ModelConfig
from shardwise.sharding.plans.bert import bert_plan

__all__ = ["BERT", "bert_config", "bert_names"]

# transformers builds these with add_pooling_layer=False: their checkpoints have no pooler.
_NO_POOLER = frozenset({"BertForMaskedLM", "BertLMHeadModel", "BertForTokenClassification", "BertForQuestionAnswering"})


def bert_config(d: dict) -> ModelConfig:
    """A BERT config.json (transformers 4 or 5) as a ModelConfig; decoders are refused."""
    if d.get("is_decoder") or d.get("add_cross_attention"):
        raise NotImplementedError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    pos = d.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise NotImplementedError(f"BERT position_embedding_type {pos!r} is not supported; supported: absolute")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    archs = d.get("architectures") or []
    return ModelConfig(
        family="bert",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm="layer",
        norm_eps=d.get("layer_norm_eps", 1e-12),
        act=_act(d, "hidden_act"),
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


def bert_names(cfg: ModelConfig, prefix: str) -> NameTable:
    """{our parameter name: [checkpoint sources]}; q, k and v are fused into our qkv."""
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


BERT = register(
    Family(
        name="bert",
        model_types=("bert",),
        config=bert_config,
        names=bert_names,
        prefixes=("bert.", ""),
        probe="embeddings.word_embeddings.weight",
        ignore=(
            "*embeddings.position_ids",  # buffers that older transformers saved
            "*embeddings.token_type_ids",
            "cls.*",  # the MLM / next-sentence heads of BertForPreTraining and BertForMaskedLM
            # A pooler the config's architectures say is absent (bert-base-uncased is saved as
            # BertForMaskedLM but still carries one); when the model has a pooler it is read.
            "*pooler.dense.weight",
            "*pooler.dense.bias",
        ),
        model=BertEncoder,
        plan=bert_plan,
    )
)
