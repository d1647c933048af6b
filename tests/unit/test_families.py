"""The family table: every entry is consistent with its model, plan and name table, a new
family is one entry plus one config reader (the example in docs/models.md), and
resolve_model decides between family code and the automatic plan."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from helpers import NoCollectives
from hf_models import save_tiny
from shardwise.comm import LocalCommunicator
from shardwise.hf import FAMILIES, CheckpointError, Family, family_for, load_pretrained, read_config, resolve_model
from shardwise.hf.families import llama_config
from shardwise.hf.names import llama_names
from shardwise.layers import ShardError, model_shard_specs
from shardwise.models import ModelConfig
from shardwise.sharding import parallelize
from shardwise.sharding.plans import model_tp_sizes

transformers = pytest.importorskip("transformers")

CONFIG_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def test_entries_are_keyed_by_name_and_claim_distinct_model_types():
    claimed = [t for fam in FAMILIES.values() for t in fam.model_types]
    assert len(claimed) == len(set(claimed)), f"a model_type claimed twice: {sorted(claimed)}"
    for key, fam in FAMILIES.items():
        assert key == fam.name and fam.model_types and fam.prefixes
        assert set(fam.fixed) <= CONFIG_FIELDS, f"{fam.name}: fixed names no ModelConfig field"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_name_table_covers_exactly_the_sharded_model(name):
    """For transformers' default config of each model_type: our reader, model, plan and
    name table agree on every parameter, for every prefix, at a tp > 1."""
    fam = FAMILIES[name]
    for model_type in fam.model_types:
        raw = transformers.CONFIG_MAPPING[model_type]().to_dict()
        assert family_for(raw) is fam
        cfg = dataclasses.replace(fam.config(raw), num_layers=1)  # the default configs are large
        assert cfg.family == fam.name
        for key, value in fam.fixed.items():
            assert getattr(cfg, key) == value, f"{name}: {key}"
        tp = model_tp_sizes(cfg)[1]
        with torch.device("meta"):
            model = parallelize(fam.model(cfg), fam.plan(cfg), comm=NoCollectives(rank=tp - 1, size=tp))
        specs = model_shard_specs(model)
        for prefix in fam.prefixes:
            table = fam.names(cfg, prefix)
            assert table.keys() == specs.keys(), f"{name} ({prefix!r}): {sorted(table.keys() ^ specs.keys())}"
            sources = {src.name for srcs in table.values() for src in srcs}
            assert prefix + fam.probe in sources, f"{name}: probe {prefix + fam.probe!r} is read by no parameter"


def toy_config(d: dict, fam: Family) -> ModelConfig:
    """The config reader of the docs' example: a Llama whose config.json says d_model and n_layers."""
    return llama_config({**d, "hidden_size": d["d_model"], "num_hidden_layers": d["n_layers"]}, fam)


TOY = Family(
    name="toy",
    model_types=("toy",),
    reader=toy_config,
    names=llama_names,
    prefixes=("model.", ""),
    probe="embed_tokens.weight",
    ignore=("*rotary_emb.inv_freq",),
)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    """(a Llama checkpoint, the same weights under model_type "toy" with renamed fields)."""
    root = tmp_path_factory.mktemp("toy")
    llama = save_tiny("llama3", root)
    toy = shutil.copytree(llama, root / "toy")
    raw = json.loads((toy / "config.json").read_text())
    raw["model_type"] = "toy"
    raw["d_model"], raw["n_layers"] = raw.pop("hidden_size"), raw.pop("num_hidden_layers")
    (toy / "config.json").write_text(json.dumps(raw))
    return llama, toy


def test_a_new_family_is_one_entry_and_one_reader(toy_checkpoint, monkeypatch):
    llama, toy = toy_checkpoint
    with pytest.raises(CheckpointError, match=r"model_type 'toy' has no shardwise model code"):
        resolve_model(toy)
    monkeypatch.setitem(FAMILIES, TOY.name, TOY)

    family, cfg = read_config(toy)
    assert family is TOY and cfg == dataclasses.replace(read_config(llama)[1], family="toy")
    full, report = load_pretrained(toy, comm=LocalCommunicator())
    assert report.family == "toy"
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = transformers.LlamaForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        torch.testing.assert_close(full(ids), reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    whole = dict(full.named_parameters())
    for tp in (t for t in model_tp_sizes(cfg) if t > 1):
        for rank in range(tp):  # each rank reads exactly its shard of every unsharded tensor
            sharded, _ = load_pretrained(toy, comm=NoCollectives(rank=rank, size=tp))
            specs = model_shard_specs(sharded)
            for name, p in sharded.named_parameters():
                assert torch.equal(p, specs[name].take(whole[name])), f"tp={tp} rank {rank}: {name}"


def test_resolve_model_sends_other_model_types_to_the_automatic_plan(tmp_path):
    """The one dispatch: a model_type outside FAMILIES is refused, or with auto=True checked
    on transformers' meta model, so a tp it cannot split fails before any rank starts."""
    cfg = transformers.GraniteConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=64,
    )  # fmt: skip
    transformers.GraniteForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'granite' has no shardwise model code"):
        resolve_model(tmp_path, tp=2)
    resolved = resolve_model(tmp_path, tp=2, auto=True)
    assert resolved.family is None and resolved.config is None and resolved.path == tmp_path
    with pytest.raises(
        ShardError, match=r"config\.json: .*num_key_value_heads=2 cannot be split over tp=4.*valid tp sizes: 1, 2$"
    ):
        resolve_model(tmp_path, tp=4, auto=True)
