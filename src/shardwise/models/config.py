"""ModelConfig: one typed description of every transformer family shardwise runs.

The families differ in a handful of switches (norm kind, positions, MLP gating,
biases, q/k norm, residual layout), so one plain model class reads them all; the
per-family knowledge lives in these fields and in the Hugging Face adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and architectural switches of a decoder (or encoder) transformer."""

    family: str
    """Family name, e.g. "llama", "gpt2", "bert"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads: == num_heads for MHA, 1 for MQA, in between for GQA."""
    head_dim: int
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    """RMSNorm scales by (offset + weight): Gemma stores weight - 1, so offset 1.0."""
    act: Literal["silu", "gelu", "gelu_tanh", "relu"] = "silu"
    gated_mlp: bool = True
    """down(act(gate(x)) * up(x)) if True, else down(act(up(x)))."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    positions: Literal["rope", "learned"] = "rope"
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rope_dim: int | None = None
    """Rotated dims per head (partial rotary, GPT-NeoX); None = head_dim."""
    rope_scaling: dict | None = None
    """None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...}."""
    parallel_residual: bool = False
    """x + attn(ln1(x)) + mlp(ln2(x)) in one step (GPT-NeoX)."""
    post_norm: bool = False
    """Norm after each residual add (BERT) instead of before each sublayer."""
    embed_scale: float = 1.0
    """Multiply token embeddings by this (Gemma: sqrt(hidden_size))."""
    tie_embeddings: bool = False
    sliding_window: int | None = None
    """Attend to the last sliding_window positions only (the query's own included)."""
    sliding_layers: tuple[int, ...] | None = None
    """The layers that attend within sliding_window (Gemma 3's local layers; the others
    attend to everything); None: every layer, when sliding_window is set (Mistral)."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding layers, unscaled (Gemma 3: 10000); None: every layer uses
    rope_theta and rope_scaling."""
    sandwich_norm: bool = False
    """A norm after each sublayer too, before its residual add (Gemma 3: four norms a layer)."""
    attn_scale: float | None = None
    """Softmax scale of q k^T; None: 1 / sqrt(head_dim) (Gemma 3: query_pre_attn_scalar ** -0.5)."""
    causal: bool = True
    type_vocab_size: int = 0
    """Token-type (segment) embeddings, BERT only."""
    dtype: str = "float32"
    """The checkpoint's dtype: float32, bfloat16 or float16."""
    num_experts: int = 0
    """Mixture of experts: routed experts per MoE layer (0: every MLP is dense)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_size: int = 0
    """Each routed expert's intermediate size (gated MLP, the model's activation)."""
    shared_expert_size: int = 0
    """A shared expert every token goes through (Qwen2-MoE), 0 for none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(a learned (hidden -> 1) projection)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing probabilities to sum to 1 (Mixtral: yes)."""
    moe_layers: tuple[int, ...] | None = None
    """Layers whose MLP is an MoE block; None: every layer (when num_experts > 0)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in training (Switch Transformer; transformers' own)."""
    weight_block: int = 1
    """The block, in weights, a row-parallel cut of the MLP's input must fall on: a GGUF
    file's largest block along its down projections (32, or 256 for the K-quants), so that
    every rank holds whole blocks; 1 for float weights."""
    stored_bytes_per_weight: float = 0.0
    """Bytes per weight of the matrices (projections, experts, embedding, head) as a GGUF file
    computed in its own block formats holds them (Q4_K 0.5625, Q8_0 1.0625; a mix averages);
    0: in the model's dtype. For the planner's memory and time models."""
    stored_formats: tuple[tuple[str, float], ...] = ()
    """With stored_bytes_per_weight: each format of those matrices and its share of their
    weights, (("Q4_K", 0.83), ("Q6_K", 0.17)); float matrices as "F32". The planner times each
    share on its format's measured kernel where the device has one."""
    extra: dict = field(default_factory=dict)
    """Family-specific values carried through from the source config."""

    def __post_init__(self) -> None:
        if not self.stored_bytes_per_weight >= 0:
            raise ValueError(f"stored_bytes_per_weight must be >= 0, got {self.stored_bytes_per_weight}")
        object.__setattr__(self, "stored_formats", tuple((str(f), float(x)) for f, x in self.stored_formats))
        if any(not 0 <= x <= 1 for _, x in self.stored_formats):
            raise ValueError(f"stored_formats shares must be in [0, 1], got {self.stored_formats}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        rot = self.rotary_dim
        if self.positions == "rope" and (rot % 2 or not 0 < rot <= self.head_dim):
            raise ValueError(f"rope_dim={rot} must be even and in (0, head_dim={self.head_dim}]")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
                )
            if self.expert_size < 1:
                raise ValueError(f"expert intermediate size must be >= 1, got {self.expert_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError(f"sliding_layers={list(self.sliding_layers)} needs a sliding_window")
            bad = [i for i in self.sliding_layers if i < 0]  # NOTE: indices past num_layers are ignored, as moe_layers'
            if bad:
                raise ValueError(f"sliding_layers {bad} must be layer indices >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def debug(cls, **overrides) -> ModelConfig:
        """A tiny Llama-like model for tests and `shardwise demo`: 2 layers of width 32,
        8 query and 4 KV heads (grouped-query), a gated SiLU MLP of 64, RoPE, tied
        embeddings, a vocabulary of 250. Any field can be overridden; head_dim follows
        hidden_size / num_heads unless given."""
        fields = dict(
            family="debug", vocab_size=250, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
            num_kv_heads=4, tie_embeddings=True,
        )  # fmt: skip
        fields.update(overrides)
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
        return cls(**fields)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim if self.rope_dim is not None else self.head_dim

    def is_sliding_layer(self, i: int) -> bool:
        """Layer i attends within sliding_window."""
        return self.sliding_window is not None and (self.sliding_layers is None or i in self.sliding_layers)

    @property
    def mixed_attention(self) -> bool:
        """Some layers slide and others do not, or they rotate by different bases: each
        kind then gets its own mask and rotary tables (DecoderLM.prelude)."""
        return self.sliding_layers is not None or self.local_rope_theta is not None

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or i in self.moe_layers)

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
