"""Building on the meta device (shardwise.models.meta.on_meta) and sharding a meta model:
the same shapes, dtypes and names as sharding a real model, without running an initialiser
or any computation on meta tensors (which would import torch._dynamo in every rank)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from torch import nn

from shardwise.comm.dryrun import DryRunCommunicator
from shardwise.models import BertEncoder, DecoderLM, ModelConfig
from shardwise.models.meta import on_meta
from shardwise.sharding import parallelize
from shardwise.sharding.plans import bert_plan, decoder_plan

CONFIGS = {
    "gqa-gated-tied": ModelConfig.debug(hidden_size=48, num_heads=12, num_kv_heads=4, intermediate_size=96),
    "mha-gelu-biases-untied": ModelConfig.debug(
        hidden_size=48,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=96,
        gated_mlp=False,
        act="gelu",
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        tie_embeddings=False,
        norm_offset=1.0,
    ),
}


def _shapes(model: nn.Module) -> dict[str, tuple]:
    return {n: (tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_on_meta_builds_the_same_shapes_and_skips_and_restores_initialisers():
    cfg = CONFIGS["gqa-gated-tied"]
    real = DecoderLM(cfg)
    normal = nn.init.normal_
    with on_meta():
        assert nn.init.normal_ is not normal  # skipped inside
        meta = DecoderLM(cfg)
    assert nn.init.normal_ is normal and nn.init.kaiming_uniform_.__module__ == "torch.nn.init"
    assert all(p.is_meta for p in meta.parameters())
    assert _shapes(meta) == _shapes(real)
    with pytest.raises(RuntimeError, match="boom"), on_meta():
        raise RuntimeError("boom")
    assert nn.init.normal_ is normal, "initialisers restored after an error"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_a_meta_model_shards_like_a_real_one(name, tp):
    cfg = CONFIGS[name]
    real = DecoderLM(cfg)
    with on_meta():
        meta = DecoderLM(cfg)
    for rank in range(tp):
        a = parallelize(copy.deepcopy(real), decoder_plan(cfg), comm=DryRunCommunicator(tp, rank))
        b = parallelize(copy.deepcopy(meta), decoder_plan(cfg), comm=DryRunCommunicator(tp, rank))
        assert _shapes(b) == _shapes(a), f"rank {rank} of {tp}"
        assert all(p.is_meta for p in b.parameters()) and not any(p.is_meta for p in a.parameters())
        assert (b.lm_head.weight is b.embed.weight) == cfg.tie_embeddings


def test_a_meta_encoder_shards_like_a_real_one():
    cfg = ModelConfig.debug(
        family="bert",
        causal=False,
        post_norm=True,
        positions="learned",
        norm="layer",
        gated_mlp=False,
        act="gelu",
        type_vocab_size=2,
    )
    real = BertEncoder(cfg)
    with on_meta():
        meta = BertEncoder(cfg)
    a = parallelize(real, bert_plan(cfg), comm=DryRunCommunicator(2, 1))
    b = parallelize(meta, bert_plan(cfg), comm=DryRunCommunicator(2, 1))
    assert _shapes(b) == _shapes(a)


def test_loading_a_checkpoint_imports_no_dynamo():
    """In a fresh interpreter, as in a rank: load the default model and decode a token."""
    code = (
        "import sys, torch\n"
        "from shardwise.comm import LocalCommunicator\n"
        "from shardwise.engine import generate\n"
        "from shardwise.engine.text import DEFAULT_MODEL\n"
        "from shardwise.hf import load_pretrained\n"
        "model, _ = load_pretrained(DEFAULT_MODEL, comm=LocalCommunicator())\n"
        "generate(model, [[1, 2, 3]], comm=LocalCommunicator(), max_new_tokens=2)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"torch._dynamo was imported: {out.stdout[:300]}"
