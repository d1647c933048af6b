"""Activation memory a decoder layer keeps for backward, per rank: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4) adapted to
shardwise's layer.

The paper counts, for a GPT layer in 16-bit with dropout, s*b*h*(34 + 5*a*s/h) bytes:
attention 11*s*b*h + 5*a*s^2*b, MLP 19*s*b*h, the two LayerNorms 4*s*b*h. Tensor
parallelism divides all but 10*s*b*h (norm inputs, the inputs of the first matmul of
each block, the dropout masks), sequence parallelism divides those too, selective
recomputation drops the 5*a*s^2*b of the attention core, full recomputation keeps only
the layer's 2*s*b*h input.

shardwise's layer (models/modules.py, run by torch on CPU) differs, term by term:

- no dropout (no masks, no dropout outputs);
- a gated MLP: [gate | up] (2*I), act(gate) (I) and act(gate) * up (I) instead of 4h+4h+4h;
- grouped-query attention: the fused [q | k | v] output is (a + 2*kv)*d wide and the
  rotated q, k (a + kv)*d, instead of 3h and 2h;
- a fused attention kernel (scaled_dot_product_attention): no s x s scores or softmax
  kept; it keeps its output (laid out so that it is also o's input, one tensor), a
  log-sum-exp per head and position (fp32), and a float copy of the boolean mask (s x s,
  the same for every row and head, so not divided by tp); selective recomputation drops
  the last two (o still keeps its input) and keeps the core's inputs q, k, v, which the
  projection and RoPE produced anyway;
- RMSNorm, computed in fp32, keeps fp32 copies of its input and of its normalized input,
  plus a per-position statistic (LayerNorm: its input, in the residual stream's dtype, and
  two statistics);
- dtypes: matmul inputs and outputs in the activation dtype (`act_bytes`: 2 under bf16
  autocast, else 4), the residual stream in `stream_bytes` (4 in shardwise training: the
  weights are fp32 and autocast leaves the adds in fp32), which is what full
  recomputation keeps;
- `flash=False` (the unfused "math" attention, which shardwise does not run in training)
  adds the softmax output, a*s*s per row in the activation dtype (on CPU the math path
  keeps about 0.6 of that more than the fused kernel; not measured further);
- a column-parallel layer under sequence parallelism keeps its input's sequence shard
  (and all-gathers it again in backward, as Megatron-LM does), so the inputs of qkv and
  of the MLP are divided by tp with the norms.

`layer_activation_terms` lists the terms; benchmarks/bench_activations.py measures each
mode with saved-tensor hooks and prints both beside `paper_layer_bytes`.
"""

from __future__ import annotations

from shardwise.layers.partition import HeadLayout, largest_share
from shardwise.models.config import ModelConfig

__all__ = ["RECOMPUTE", "recompute_mode", "layer_activation_terms", "layer_activation_bytes", "paper_layer_bytes"]

RECOMPUTE = ("none", "selective", "full")


def recompute_mode(value: str | bool) -> str:
    """A recompute mode from a mode name, or from a bool (True = "full", False = "none")."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in RECOMPUTE:
        raise ValueError(f"recompute {value!r} is unknown; choose one of {', '.join(RECOMPUTE)}")
    return value


def layer_activation_terms(
    cfg: ModelConfig,
    *,
    tp: int,
    micro_batch: int,
    seq: int,
    sequence_parallel: bool = False,
    recompute: str | bool = "none",
    act_bytes: int = 4,
    stream_bytes: int = 4,
    flash: bool = True,
) -> dict[str, float]:
    """Bytes one rank keeps for backward of one decoder layer and one micro-batch of
    micro_batch x seq tokens, by term (see the module docstring)."""
    recompute = recompute_mode(recompute)
    sb, h, d, e, f = seq * micro_batch, cfg.hidden_size, cfg.head_dim, act_bytes, stream_bytes
    shard = tp if sequence_parallel else 1  # what runs on the sequence shard
    if recompute == "full":
        return {"layer input": sb * h * f / shard}
    heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, tp)
    a, kv, inter = heads.max_heads, heads.max_kv_heads, largest_share(cfg.intermediate_size, tp)  # busiest rank
    # RMSNorm (models.modules.Norm) computes in fp32: it keeps fp32 copies of its input and of
    # the normalized input, and one statistic; LayerNorm keeps its input and two statistics
    norm = sb * (2 * h * 4 + 4) if cfg.norm == "rms" else sb * (h * f + 8)
    terms = {
        "attention norm": norm / shard,
        "qkv input": sb * h * e / shard,
        "qkv output": sb * (a + 2 * kv) * d * e,
        "rotated q, k": sb * (a + kv) * d * e if cfg.positions == "rope" else 0.0,
        "attention output (o input)": sb * a * d * e,
        "log-sum-exp": sb * a * 4,
        "mask copy": seq * seq * e,
        "mlp norm": norm / shard,
        "mlp input": sb * h * e / shard,
        "mlp": sb * inter * e * (4 if cfg.gated_mlp else 2),  # [gate | up], act, product / up output, act
    }
    if not flash:
        terms["scores (unfused attention)"] = micro_batch * a * seq * seq * e
    if cfg.qk_norm:
        terms["q, k norms"] = sb * (a + kv) * (d * 4 + 4)  # fp32 normalized copy and statistic (approximate: untested)
    if recompute == "selective":  # the core's inputs (q, k, v) and o's input stay; statistics, mask, scores go
        for name in ("log-sum-exp", "mask copy", "scores (unfused attention)"):
            if name in terms:
                terms[name] = 0.0
    return terms


def layer_activation_bytes(cfg: ModelConfig, **kwargs) -> float:
    """The sum of layer_activation_terms(cfg, **kwargs)."""
    return sum(layer_activation_terms(cfg, **kwargs).values())


def paper_layer_bytes(
    cfg: ModelConfig,
    *,
    tp: int,
    micro_batch: int,
    seq: int,
    sequence_parallel: bool = False,
    recompute: str | bool = "none",
) -> float:
    """The paper's per-layer bytes (16-bit, with dropout), Table 2: for comparison only."""
    s, b, h, a, t = seq, micro_batch, cfg.hidden_size, cfg.num_heads, tp
    recompute = recompute_mode(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + scores) / t
    return sbh * (10 + (24 + scores) / t)
