"""Export a checkpoint's weights as a Hugging Face model directory.

    export_hf("runs/x/checkpoints", "out/model")
    -> config.json, generation_config.json, model.safetensors, tokenizer.json (if saved)

Parameter names go through the same name table the loader uses (shardwise.hf.families),
in reverse: each of our tensors is rebuilt whole, one at a time, from its chunks, and
split into the Hugging Face tensors it came from ([q; k; v] into q_proj, k_proj,
v_proj; [gate; up] into gate_proj, up_proj). config.json is a LlamaConfig, so
transformers' LlamaForCausalLM and `shardwise generate --model` both load the result.
A Mixtral checkpoint (trained with [model] num_experts, at any tp x ep) is written as a
MixtralConfig with per-expert w1/w3/w2 tensors, the names transformers saves Mixtral with.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from shardwise.checkpoint.files import SafetensorsWriter, dtype_from_name, fsync_dir, write_atomic
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.offline import model_config
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.hf.families import FAMILIES
from shardwise.layers import ShardSpec
from shardwise.models.config import ModelConfig

__all__ = ["export_hf", "llama_hf_config", "mixtral_hf_config"]

_LLAMA_DEFAULTS = {
    "norm": "rms",
    "norm_offset": 0.0,
    "act": "silu",
    "gated_mlp": True,
    "qkv_bias": False,
    "o_bias": False,
    "qk_norm": False,
    "positions": "rope",
    "rope_dim": None,
    "parallel_residual": False,
    "post_norm": False,
    "embed_scale": 1.0,
    "sliding_window": None,
    "causal": True,
}


def llama_hf_config(cfg: ModelConfig, *, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """A transformers LlamaConfig dict for a Llama-shaped ModelConfig."""
    allowed = {k: (v,) for k, v in _LLAMA_DEFAULTS.items()} | {"rope_dim": (None, cfg.head_dim)}
    odd = [f"{k}={getattr(cfg, k)!r}" for k, ok in allowed.items() if getattr(cfg, k) not in ok]
    if cfg.family != "llama" or odd:
        what = f"family {cfg.family!r}" + (f" with {', '.join(odd)}" if odd else "")
        raise CheckpointError(f"export-hf writes Llama checkpoints; this checkpoint is {what}")
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": cfg.dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def mixtral_hf_config(cfg: ModelConfig, *, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """A transformers MixtralConfig dict for a Mixtral ModelConfig (every layer an MoE block)."""
    if cfg.family != "mixtral" or cfg.moe_layers is not None or cfg.shared_expert_size or not cfg.norm_topk_prob:
        raise CheckpointError(
            f"export-hf writes Mixtral for mixture-of-experts checkpoints; this one is family {cfg.family!r} "
            f"(shared_expert_size={cfg.shared_expert_size}, norm_topk_prob={cfg.norm_topk_prob})"
        )
    dense = llama_hf_config(replace(cfg, family="llama"), bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    for key in ("mlp_bias", "pretraining_tp", "head_dim"):
        dense.pop(key)
    return dense | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": cfg.expert_size,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "sliding_window": None,
    }


def export_hf(src: str | Path, out: str | Path) -> Path:
    """Write the checkpoint at `src` as a Hugging Face directory `out` (which must not exist)."""
    reader = CheckpointReader(src)
    reader.verify()
    m = reader.manifest
    cfg = model_config(m)
    ids = {"bos_token_id": m.extra.get("bos_token_id"), "eos_token_id": m.extra.get("eos_token_id")}
    family = "mixtral" if cfg.num_experts else "llama"
    config = mixtral_hf_config(cfg, **ids) if cfg.num_experts else llama_hf_config(cfg, **ids)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    table = FAMILIES[family].names(cfg, "model.")  # our name -> [Src(hf name, rows)]
    entries, jobs = [], []
    for name, sources in table.items():
        entry = reader.entry(f"param/{name}")
        dtype = dtype_from_name(entry.dtype)
        even = entry.global_shape[0] // len(sources)  # e.g. one expert's down rows of the stacked ones
        rows = [s.rows if s.rows is not None else even for s in sources]
        if sum(rows) != entry.global_shape[0]:
            raise CheckpointError(f"param/{name}: {entry.global_shape[0]} rows do not split into {rows}")
        for src_, n in zip(sources, rows, strict=True):
            entries.append((src_.name, dtype, (n, *entry.global_shape[1:])))
        jobs.append((name, entry, [s.name for s in sources], rows))
    with SafetensorsWriter(tmp / "model.safetensors", entries, metadata={"format": "pt"}) as w:
        for name, entry, hf_names, rows in jobs:
            full = reader.read(f"param/{name}", ShardSpec.replicated(entry.global_shape))  # one tensor at a time
            for hf_name, part in zip(hf_names, full.split(rows), strict=True):
                w.write(hf_name, part)
    reader_files = set(m.files)
    if "tokenizer.json" in reader_files:
        shutil.copyfile(reader.dir / "tokenizer.json", tmp / "tokenizer.json")
    write_atomic(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    write_atomic(tmp / "generation_config.json", (json.dumps(generation, indent=2) + "\n").encode())
    reader.close()
    fsync_dir(tmp)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.rename(tmp, out)
    return out
