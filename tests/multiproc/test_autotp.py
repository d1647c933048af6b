"""The automatic plan: architectures without shardwise model code (OPT, Granite), loaded
sharded through load_pretrained, against transformers on the same checkpoint: logits on
2 unequal-length left-padded prompts and 16 greedy tokens, at tp = 1, 2, 4, and OPT (MHA)
at tp=3, which splits its 4 heads unevenly (in make test-more). And the
refusals: structures the plan cannot shard safely, and indivisible KV heads."""

from __future__ import annotations

import pytest
import torch

from helpers import NoCollectives, tp_group
from hf_models import INIT_STD, greedy, prompts
from shardwise.comm import LocalCommunicator
from shardwise.layers import ShardError

transformers = pytest.importorskip("transformers")

# arch -> (config class, model class, config kwargs)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "opt": (  # MHA, learned positions, biases, fc1/fc2 on the layer, tied LM head, self.num_heads in view()
        "OPTConfig",
        "OPTForCausalLM",
        dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=101,
             word_embed_proj_dim=64, max_position_embeddings=64),
    ),
    "granite": (  # GQA (8 q / 4 kv heads), RoPE, gated MLP, untied head, multipliers
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=122, attention_bias=True, embedding_multiplier=2.0,
             attention_multiplier=0.25, logits_scaling=2.0),
    ),
    "granite_kv2": ("GraniteConfig", "GraniteForCausalLM", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, vocab_size=64)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, vocab_size=64, eos_token_id=0)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=1, n_head=4, vocab_size=64)),
}  # fmt: skip


def _save(arch: str, root) -> tuple[str, torch.nn.Module]:
    cfg_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs, initializer_range=INIT_STD))
    with torch.no_grad():  # norms and biases start at 1 and 0; perturb them so they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(root / arch)
    return str(root / arch), model.eval()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """arch -> (checkpoint dir, logits (2, 7, V), greedy tokens (2, 16), parameter bytes)."""
    root, cache = tmp_path_factory.mktemp("auto"), {}

    def get(arch: str):
        if arch not in cache:
            path, model = _save(arch, root)
            ids, mask = prompts(model.config.vocab_size)
            fwd = lambda i, m, pos: model(input_ids=i, attention_mask=m, position_ids=pos).logits
            with torch.no_grad():
                logits, tokens = fwd(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)), greedy(fwd, ids, mask)
            cache[arch] = (path, logits, tokens, sum(p.numel() * 4 for p in model.parameters()))
        return cache[arch]

    return get


def _auto_case(world, path: str, vocab: int) -> dict:
    from shardwise.hf import load_pretrained

    model, report = load_pretrained(path, comm=tp_group(world))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ids, mask = prompts(vocab)
    fwd = lambda i, m, pos: model(input_ids=i, attention_mask=m, position_ids=pos).logits
    with torch.no_grad():
        logits, tokens = fwd(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)), greedy(fwd, ids, mask)
    return {"logits": logits, "tokens": tokens, "family": report.family, "bytes_read": report.bytes_read}


CASES = [(arch, tp) for arch in ("opt", "granite") for tp in (1, 2, 4)] + [("opt", 3)]  # MHA: 4 heads, 2/1/1 at tp=3


FULL = {("opt", 2), ("opt", 3), ("opt", 4), ("granite", 4)}  # make test keeps tp 1 of opt, tp 1 and 2 of granite
PARAMS = [pytest.param(a, t, id=f"{a}-tp{t}", marks=[pytest.mark.full] if (a, t) in FULL else []) for a, t in CASES]


@pytest.mark.parametrize("arch,tp", PARAMS)
def test_auto_plan_matches_transformers(rank_pool, reference, arch, tp):
    path, ref_logits, ref_tokens, full_bytes = reference(arch)
    results = rank_pool.run(_auto_case, tp, args=(path, ref_logits.shape[-1]))
    real = prompts(ref_logits.shape[-1])[1].bool()  # compare real tokens only
    scale = ref_logits[real].abs().max().item()
    for rank, r in enumerate(results):
        err = (r["logits"][real] - ref_logits[real]).abs().max().item()
        print(f"{arch} tp={tp} rank {rank}: max |logits error| {err:.2e} (scale {scale:.1f})")
        assert r["family"] == f"auto:{arch}"
        assert err <= 1e-4 * max(scale, 1.0), f"rank {rank}: logits differ by {err:.2e} (scale {scale:.1f})"
        assert torch.equal(r["tokens"], ref_tokens), f"rank {rank}: {r['tokens'].tolist()} != {ref_tokens.tolist()}"
        assert (r["bytes_read"] < full_bytes) == (tp > 1), "each rank reads only its slices"
    assert len(set(ref_tokens.flatten().tolist())) > 4, "greedy tokens should vary (init scale too small?)"


def test_indivisible_kv_heads_refused_before_reading(reference, monkeypatch):
    from shardwise.hf import Checkpoint, load_pretrained

    path = reference("granite_kv2")[0]

    def no_read(*a, **k):
        raise AssertionError("checkpoint data was read before the tp check")

    monkeypatch.setattr(Checkpoint, "read", no_read)
    with pytest.raises(ShardError, match=r"num_key_value_heads=2 cannot be split over tp=4.*valid tp sizes: 1, 2$"):
        load_pretrained(path, comm=NoCollectives(size=4))


def _meta_model(arch: str) -> tuple[torch.nn.Module, object]:
    cfg_cls, model_cls, kwargs = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    with torch.device("meta"):
        return getattr(transformers, model_cls)(cfg), cfg


def _conv1d_down(model: torch.nn.Module) -> None:
    from transformers.pytorch_utils import Conv1D

    model.model.layers[0].mlp.down_proj = Conv1D(64, 96)


def _fused_gate_up(model: torch.nn.Module) -> None:
    mlp = model.model.layers[0].mlp
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(64, 192), torch.nn.Identity()


@pytest.mark.parametrize(
    "arch,mutate,blamed",
    [
        (
            "granite_kv2",
            _conv1d_down,
            r"model\.layers\.0\.mlp\.down_proj: Conv1D\[\(96, 64\), \(64,\)\] is neither an nn\.Linear",
        ),
        ("granite_kv2", _fused_gate_up, r"model\.layers\.0: expected an MLP .* found mlp\.gate_proj Linear\(64->192\)"),
        # q_norm normalises over all heads at once: a rank would see only its own heads
        ("olmo2", None, r"model\.layers\.0\.self_attn\.q_norm: Olmo2RMSNorm\[\(64,\)\] in the attention"),
    ],
    ids=["conv1d", "fused-gate-up", "olmo2-whole-width-qk-norm"],
)
def test_unrecognisable_structure_refused(arch, mutate, blamed):
    from shardwise.hf.auto import auto_plan

    model, cfg = _meta_model(arch)
    if mutate is not None:
        mutate(model)
    with pytest.raises(ShardError, match=blamed) as e:
        auto_plan(model, cfg, 2)
    assert "cannot shard this safely" in str(e.value) and "gpt_neox, llama" in str(e.value)


def test_fused_qkv_checkpoint_refused(reference):
    from shardwise.hf import load_pretrained

    with pytest.raises(ShardError, match=r"transformer\.h\.0: found 0 attention modules.*query_key_value") as e:
        load_pretrained(reference("bloom")[0], comm=LocalCommunicator())
    assert "shardwise has model code for: " in str(e.value)
