"""The plan for DecoderLM (every decoder family): Megatron-LM's layout, as data.

The first matrix of each pair is split by columns and the second by rows, so each of
attention and MLP costs one all-reduce forward and one backward.

sequence_parallel=True (Korthikanti et al., 2022): each of those all-reduces becomes a
reduce-scatter and an all-gather along the sequence; the norms, the residual stream and
the embedding's output hold T / tp positions per rank (training only: every sequence
length must be a multiple of tp).

Mixture-of-experts layers (cfg.is_moe_layer) take the MixtureOfExperts style in place of
the MLP's pair: tensor-parallel experts, or expert_parallel=True (whole experts dealt
out over the tp group); either way one all-reduce, like the dense MLP.
"""

from __future__ import annotations

from shardwise.layers.partition import ShardError
from shardwise.models.config import ModelConfig
from shardwise.sharding.plan import Plan
from shardwise.sharding.styles import QKV, Colwise, MergedColwise, MixtureOfExperts, Rowwise, Vocab

__all__ = ["attention_plan", "mlp_plan", "layer_plan", "moe_layers_plan", "decoder_plan"]


def attention_plan(cfg: ModelConfig, prefix: str = "", *, sequence_parallel: bool = False) -> Plan:
    """An Attention (models/modules.py): the fused qkv by whole heads, o by rows of the same heads."""
    sp = sequence_parallel
    qkv = QKV(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, sequence_parallel=sp)
    return {
        f"{prefix}qkv": qkv,
        f"{prefix}o": Rowwise(head_dim=cfg.head_dim, sequence_parallel=sp, num_kv_heads=cfg.num_kv_heads),
    }


def mlp_plan(cfg: ModelConfig, prefix: str = "", *, sequence_parallel: bool = False) -> Plan:
    """An MLP (models/modules.py): up by columns (gate and up each, when gated), down by rows."""
    sp = sequence_parallel
    unit = cfg.weight_block if cfg.weight_block > 1 else None  # NOTE: cut on whole blocks of a GGUF file's down
    if not sp and unit is None:
        return {f"{prefix}up": "merged_colwise" if cfg.gated_mlp else "colwise", f"{prefix}down": "rowwise"}
    up = (
        MergedColwise(sequence_parallel=sp, unit=unit)
        if cfg.gated_mlp
        else Colwise(sequence_parallel=sp, head_dim=unit)
    )
    return {f"{prefix}up": up, f"{prefix}down": Rowwise(sequence_parallel=sp, head_dim=unit)}


def layer_plan(cfg: ModelConfig, prefix: str = "", *, sequence_parallel: bool = False) -> Plan:
    """One layer (DecoderLayer or BertLayer): attention by heads, MLP by its intermediate dim.

    Its norms stay replicated; with sequence_parallel they run on the sequence shard
    ("sequence": their gradients are summed over tp)."""
    sp = sequence_parallel
    plan = attention_plan(cfg, f"{prefix}attn.", sequence_parallel=sp) | mlp_plan(
        cfg, f"{prefix}mlp.", sequence_parallel=sp
    )
    if sp:
        plan |= {f"{prefix}attn_norm": "sequence", f"{prefix}mlp_norm": "sequence"}
        if cfg.sandwich_norm:
            plan |= {f"{prefix}attn_post_norm": "sequence", f"{prefix}mlp_post_norm": "sequence"}
    return plan


def moe_layers_plan(cfg: ModelConfig, *, expert_parallel: bool = False) -> Plan:
    """Every layer of a model with mixture-of-experts layers: attention by heads, each MoE
    block by MixtureOfExperts, each dense MLP (Qwen2-MoE's mlp_only_layers) as mlp_plan."""
    plan = dict(attention_plan(cfg, "layers.*.attn."))
    moe = MixtureOfExperts(expert_parallel=expert_parallel)
    for i in range(cfg.num_layers):
        plan |= {f"layers.{i}.mlp": moe} if cfg.is_moe_layer(i) else mlp_plan(cfg, f"layers.{i}.mlp.")
    return plan


def decoder_plan(
    cfg: ModelConfig, *, gather_logits: bool = True, sequence_parallel: bool = False, expert_parallel: bool = False
) -> Plan:
    """Embedding and head by vocabulary; every layer as layer_plan.

    Norms, q/k norms and learned position embeddings stay replicated. gather_logits=False
    keeps the logits vocab-parallel, for vocab_parallel_cross_entropy.

    sequence_parallel=True: the embedding ends in a reduce-scatter, learned positions are
    cut to the shard, every norm runs on the shard and the head all-gathers its input (see
    the module docstring). For training: a decode step's single position cannot be split.

    expert_parallel: MoE layers hold whole experts per rank instead of every expert's slice.
    """
    if expert_parallel and not cfg.num_experts:
        raise ShardError(f"expert parallelism needs a mixture-of-experts model; this {cfg.family} model has no experts")
    if cfg.num_experts:
        if sequence_parallel:
            raise ShardError("sequence parallelism is not supported for mixture-of-experts models")
        layers = moe_layers_plan(cfg, expert_parallel=expert_parallel)
        return {"embed": "vocab", **layers, "lm_head": Vocab(gather_output=gather_logits)}
    if not sequence_parallel:
        return {"embed": "vocab", **layer_plan(cfg, "layers.*."), "lm_head": Vocab(gather_output=gather_logits)}
    if cfg.family == "bert" or not cfg.causal:
        raise ShardError(f"sequence parallelism is for decoder models; {cfg.family!r} is an encoder")
    plan = {"embed": Vocab(sequence_parallel=True)}
    if cfg.positions == "learned":
        plan["pos_embed"] = "sequence_scatter"
    return plan | {
        **layer_plan(cfg, "layers.*.", sequence_parallel=True),
        "norm": "sequence",
        "lm_head": Vocab(gather_output=gather_logits, sequence_parallel=True),
    }
