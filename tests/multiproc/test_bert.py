"""BERT, loaded sharded from checkpoints that transformers wrote, against transformers'
BertModel: last hidden state, pooler output and mean-pooled embeddings on 2 right-padded
inputs of unequal length with both token types, at tp = 1, 2, 3, 4; a vocabulary tp
does not divide; and a BertForMaskedLM checkpoint ("bert." prefix, cls.* heads, no pooler)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import tp_group
from shardwise.models.pooling import mean_pool

transformers = pytest.importorskip("transformers")

# checkpoint id -> (transformers class, config overrides)
TINY: dict[str, tuple[str, dict]] = {
    "base": ("BertModel", dict(vocab_size=101)),
    "vocab30522": ("BertModel", dict(vocab_size=30522)),  # 30522 % 4 != 0: the embedding is padded
    "mlm": ("BertForMaskedLM", dict(vocab_size=101)),
}
CONFIG = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=12,  # 3 and 4 both divide the heads and the intermediate size
    max_position_embeddings=32,
    type_vocab_size=2,
    initializer_range=0.3,
)
CASES = [("base", 1), ("base", 2), ("base", 3), ("base", 4), ("vocab30522", 4), ("mlm", 2)]


def inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention_mask, token_type_ids, each (2, 9); the second input is 5 tokens, right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    ids[1, 5:] = 0
    types = torch.zeros(2, 9, dtype=torch.long)
    types[0, 4:] = 1  # sentence pairs: [A A A A B B B B B] and [A A A B B | pad]
    types[1, 3:5] = 1
    return ids, mask, types


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """checkpoint id -> (dir, last hidden state (2, 9, H), pooler output (2, H) or None)."""
    root = tmp_path_factory.mktemp("bert")
    cache: dict[str, tuple[Path, torch.Tensor, torch.Tensor | None]] = {}

    def get(name: str):
        if name not in cache:
            cls, overrides = TINY[name]
            torch.manual_seed(0)
            model = getattr(transformers, cls)(transformers.BertConfig(**CONFIG, **overrides)).eval()
            with torch.no_grad():  # norms and biases start at 1 and 0; perturb them so they matter
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.2)
            path = root / name
            model.save_pretrained(path)
            bert = transformers.BertModel.from_pretrained(path).eval() if cls == "BertModel" else model.bert
            ids, mask, types = inputs(overrides["vocab_size"])
            with torch.no_grad():
                out = bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
            cache[name] = (path, out.last_hidden_state, out.pooler_output)
        return cache[name]

    return get


def _shardwise_case(world, path: str, vocab: int) -> dict:
    from shardwise.hf import load_pretrained

    model, report = load_pretrained(path, comm=tp_group(world))
    ids, mask, types = inputs(vocab)
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask, token_type_ids=types)  # (B, T, H)
        pooled = model.pooled(hidden) if model.pooler is not None else None
    return {
        "family": report.family,
        "hidden": hidden,
        "pooled": pooled,
        "mean": mean_pool(hidden, mask, normalize=True),
        "embed_rows": model.embed.weight.shape[0],
    }


def _err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    return (actual - expected).abs().max().item(), expected.abs().max().item()


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_bert_matches_transformers(rank_pool, reference, name, tp):
    path, ref_hidden, ref_pooled = reference(name)
    vocab = TINY[name][1]["vocab_size"]
    _, mask, _ = inputs(vocab)
    real = mask.bool()  # padded rows are never used, and differ by design
    ref_mean = mean_pool(ref_hidden, mask, normalize=True)
    results = rank_pool.run(_shardwise_case, tp, args=(str(path), vocab))
    for rank, r in enumerate(results):
        assert r["family"] == "bert"
        assert r["embed_rows"] == -(-vocab // tp), f"rank {rank}: {r['embed_rows']} embedding rows"
        err, scale = _err(r["hidden"][real], ref_hidden[real])
        assert err <= 1e-4 * max(scale, 1.0), f"rank {rank}: hidden states differ by {err:.2e} (scale {scale:.1f})"
        err, scale = _err(r["mean"], ref_mean)
        assert err <= 1e-4 * max(scale, 1.0), f"rank {rank}: mean-pooled embeddings differ by {err:.2e}"
        if ref_pooled is None:  # BertForMaskedLM has no pooler; its cls.* tensors were skipped
            assert r["pooled"] is None
        else:
            err, scale = _err(r["pooled"], ref_pooled)
            assert err <= 1e-4 * max(scale, 1.0), f"rank {rank}: pooler outputs differ by {err:.2e}"


def test_mean_pool_is_the_masked_mean():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 6, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    manual = torch.stack([hidden[b, : int(mask[b].sum())].mean(0) for b in range(3)])  # (B, H)
    torch.testing.assert_close(mean_pool(hidden, mask, normalize=False), manual)
    unit = mean_pool(hidden, mask, normalize=True)
    torch.testing.assert_close(unit, manual / manual.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(3))
    hidden[1, 3:] = 1e6  # padded positions must not leak in
    torch.testing.assert_close(mean_pool(hidden, mask, normalize=False)[1], manual[1])
    torch.testing.assert_close(mean_pool(hidden, None, normalize=False), hidden.mean(1))
    half = mean_pool(hidden[:2, :3].bfloat16(), mask[:2, :3], normalize=False)
    assert half.dtype == torch.bfloat16
