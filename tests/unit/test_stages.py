"""Pipeline stages: the layer split (balanced, explicit, virtual stages), cutting a
DecoderLM to one rank's part (global names, embedding first, norm and head last, the
tied copy), and the errors of the split and of the training config's pp fields, each
one line naming the numbers."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.models import ModelConfig
from shardwise.models.decoder import DecoderLM
from shardwise.pipeline.stage import StageError, StageLayout, keep_stage
from shardwise.train import ConfigError, TrainConfig

# --- the split -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers,pp,v,layers",
    [
        (8, 1, 1, (8,)),
        (8, 2, 1, (4, 4)),
        (10, 4, 1, (3, 3, 2, 2)),  # leftovers to the earlier stages
        (5, 4, 1, (2, 1, 1, 1)),
        (4, 4, 1, (1, 1, 1, 1)),
        (8, 2, 2, (2, 2, 2, 2)),
        (5, 2, 2, (2, 1, 1, 1)),
        (7, 3, 2, (2, 1, 1, 1, 1, 1)),
    ],
)
def test_balanced_split(num_layers, pp, v, layers):
    layout = StageLayout.build(num_layers, pp, virtual_stages=v)
    assert layout.layers == layers and layout.stages == pp * v


def test_every_balanced_split_covers_each_layer_once():
    for n in range(1, 13):
        for v in (1, 2, 3):
            for pp in range(1, n // v + 1):
                layout = StageLayout.build(n, pp, virtual_stages=v)
                assert sum(layout.layers) == n and max(layout.layers) - min(layout.layers) <= 1
                assert list(layout.layers) == sorted(layout.layers, reverse=True)
                held = sorted(i for r in range(pp) for i in layout.layers_of(r))
                assert held == list(range(n)), (n, pp, v)
                assert all(i in layout.layers_of(layout.rank_of_layer(i)) for i in range(n))


def test_explicit_split():
    layout = StageLayout.build(8, 2, pp_layers=[5, 3])
    assert layout.layers == (5, 3) and layout.ranges() == [range(0, 5), range(5, 8)]
    assert layout.layers_of(0) == [0, 1, 2, 3, 4] and layout.layers_of(1) == [5, 6, 7]
    assert layout.rank_of_layer(4) == 0 and layout.rank_of_layer(5) == 1
    assert layout.describe() == "stage 0: layers 0-4 + embed; stage 1: layers 5-7 + norm, head, loss"
    assert layout.to_dict() == {"pp": 2, "virtual_stages": 1, "layers": [5, 3]}


def test_virtual_stages_go_round_the_ranks():
    """Virtual stage s lives on rank s % pp: with 8 layers over pp=2 x 2 chunks rank 0
    holds layers 0-1 and 4-5, rank 1 holds 2-3 (and 6-7, the last stage: the head)."""
    layout = StageLayout.build(8, 2, virtual_stages=2)
    assert layout.stages_of(0) == [0, 2] and layout.stages_of(1) == [1, 3]
    assert layout.layers_of(0) == [0, 1, 4, 5] and layout.layers_of(1) == [2, 3, 6, 7]
    assert [layout.rank_of_layer(i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert not layout.holds_head(0) and layout.holds_head(1)
    assert layout.holds_embedding(0) and not layout.holds_embedding(1)
    assert layout.holds_embedding(1, tied=True)
    assert layout.describe() == "stage 0: layers 0-1, 4-5 + embed; stage 1: layers 2-3, 6-7 + norm, head, loss"
    uneven = StageLayout.build(5, 2, virtual_stages=2, pp_layers=[1, 2, 1, 1])
    assert uneven.layers_of(0) == [0, 3] and uneven.layers_of(1) == [1, 2, 4]
    assert uneven.describe() == "stage 0: layers 0, 3 + embed; stage 1: layers 1-2, 4 + norm, head, loss"


def test_one_stage_holds_everything():
    layout = StageLayout.build(3, 1)
    assert layout.layers_of(0) == [0, 1, 2] and layout.holds_head(0) and layout.holds_embedding(0)
    assert layout.describe() == "stage 0: layers 0-2 + embed + norm, head, loss"


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((4, 6), {}, "pp=6 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"),
        (
            (4, 3),
            {"virtual_stages": 2},
            "pp=3 x virtual_stages=2 = 6 stages is more than the model's 4 layers; "
            "valid pp sizes at virtual_stages=2: 1, 2",
        ),
        ((8, 2), {"pp_layers": [5, 4]}, "pp_layers=[5, 4] adds up to 9 layers, but the model has 8"),
        ((8, 2), {"pp_layers": [8]}, "pp_layers=[8] has 1 entries; pp=2 needs 2 (one per stage)"),
        (
            (8, 2),
            {"virtual_stages": 2, "pp_layers": [4, 4]},
            "pp_layers=[4, 4] has 2 entries; pp=2 x virtual_stages=2 needs 4 (one per stage)",
        ),
        ((8, 2), {"pp_layers": [8, 0]}, "pp_layers=[8, 0]: every stage needs at least one layer"),
        ((0, 2), {}, "num_layers must be a positive int, got 0"),
        ((8, 0), {}, "pp must be a positive int, got 0"),
        ((8, 2), {"virtual_stages": True}, "virtual_stages must be a positive int, got True"),
    ],
)
def test_bad_splits_are_one_line_naming_the_numbers(args, kwargs, message):
    with pytest.raises(StageError) as err:
        StageLayout.build(*args, **kwargs)
    assert str(err.value) == message


def test_a_layer_outside_the_model_is_named():
    with pytest.raises(StageError, match="^layer 8 is outside the model's 8 layers$"):
        StageLayout.build(8, 2).rank_of_layer(8)


# --- cutting a model to a stage ---------------------------------------------------------------


def _model(num_layers: int = 5, **overrides) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig.debug(num_layers=num_layers, **{"tie_embeddings": False, **overrides})
    return DecoderLM(cfg).eval()


def _layer_ids(model) -> set[int]:
    return {int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("layers.")}


@pytest.mark.parametrize("tied", [False, True])
def test_keep_stage_keeps_global_names_embedding_first_head_last(tied):
    full = _model(tie_embeddings=tied)
    layout = StageLayout.build(5, 3)  # [2, 2, 1]
    stages = [keep_stage(copy.deepcopy(full), layout, r) for r in range(3)]
    names = [dict(s.named_parameters()) for s in stages]
    assert [_layer_ids(s) for s in stages] == [{0, 1}, {2, 3}, {4}]
    assert [s.layer_indices() for s in stages] == [[0, 1], [2, 3], [4]]
    assert "layers.4.attn.qkv.weight" in names[2] and "layers.0.attn.qkv.weight" in names[0]
    assert "embed.weight" in names[0] and stages[0].lm_head is None and stages[0].norm is None
    assert stages[1].embed is None and stages[1].lm_head is None and stages[1].norm is None  # middle: layers only
    assert "norm.weight" in names[2] and stages[2].lm_head is not None
    if tied:  # the last stage keeps the embedding only as its head's weight, under its first name
        assert stages[2].lm_head.weight is stages[2].embed.weight
        assert "embed.weight" in names[2] and "lm_head.weight" not in names[2]
    else:
        assert stages[2].embed is None and "lm_head.weight" in names[2]
    # every parameter of the full model is on exactly one stage (a tied one also on the last), unchanged
    every = [n for stage in names for n in stage]
    copies = ["embed.weight"] if tied else []
    assert sorted(every) == sorted(list(dict(full.named_parameters())) + copies)
    for stage in names:
        for n, p in stage.items():
            assert torch.equal(p, dict(full.named_parameters())[n]), n


def test_keep_stage_with_virtual_stages_holds_non_contiguous_layers():
    layout = StageLayout.build(5, 2, virtual_stages=2)  # [2, 1, 1, 1]: rank 0 holds 0-1 and 3
    stages = [keep_stage(_model(), layout, r) for r in range(2)]
    assert _layer_ids(stages[0]) == {0, 1, 3} and _layer_ids(stages[1]) == {2, 4}
    assert stages[0].embed is not None and stages[0].lm_head is None and stages[1].lm_head is not None


@pytest.mark.parametrize("v,positions", [(1, "rope"), (2, "rope"), (1, "learned")])
def test_the_stages_in_order_compute_the_full_model(v, positions):
    """Embedding on the first stage, each virtual stage's layers in pipeline order, the
    head on the last: the full model's logits (learned positions stay on the first stage)."""
    full = _model(positions=positions, max_positions=16)
    layout = StageLayout.build(5, 2, virtual_stages=v)
    stages = [keep_stage(copy.deepcopy(full), layout, r) for r in range(2)]
    assert (stages[1].pos_embed is None) and ((stages[0].pos_embed is not None) == (positions == "learned"))
    ids = torch.randint(0, 250, (2, 7))
    with torch.no_grad():
        x = None
        for s, layers in enumerate(layout.ranges()):
            stage = stages[s % 2]
            h, rope, mask = stage.prelude(ids, hidden=x)
            x = stage.run_layers(h, rope, mask, layers=layers)
        logits = stages[(layout.stages - 1) % 2].head(x)
        torch.testing.assert_close(logits, full(ids), rtol=0, atol=1e-6)


def test_keep_stage_refuses_a_wrong_layout_or_a_second_cut():
    model = _model(num_layers=5)
    with pytest.raises(StageError, match="^the layout splits 4 layers, the model has 5$"):
        keep_stage(model, StageLayout.build(4, 2), 0)
    keep_stage(model, StageLayout.build(5, 2), 0)
    with pytest.raises(StageError, match="already cut to a stage"):
        keep_stage(model, StageLayout.build(5, 2), 0)


# --- the training config's pp fields -----------------------------------------------------------


def _config(parallel: dict | None = None, data: dict | None = None, layers: int = 4) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "data": {"tokens": "t", "global_batch_size": 8, "micro_batch_size": 2, **(data or {})},
            "model": {"num_layers": layers},
            "parallel": parallel or {},
        }
    )


@pytest.mark.parametrize(
    "parallel,data,message",
    [
        (
            {"pp": 2, "dp_sync": "ddp"},
            {},
            "parallel.dp_sync='ddp' runs forward through DistributedDataParallel, which a pipeline stage does "
            "not (pp=2); use 'auto' or 'bucketed'",
        ),
        (
            {"schedule": "interleaved", "virtual_stages": 2},
            {},
            "parallel.schedule='interleaved' with virtual_stages=2 needs pp > 1; at pp=1 there is no pipeline",
        ),
        (
            {"pp": 2, "pp_layers": [2, 1, 1]},
            {},
            "parallel.pp_layers=[2, 1, 1] has 3 entries; pp=2 x virtual_stages=1 needs 2",
        ),
        (
            {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "pp_layers": [3, 1]},
            {},
            "parallel.pp_layers=[3, 1] has 2 entries; pp=2 x virtual_stages=2 needs 4",
        ),
        ({"pp": 2, "pp_layers": [3, 2]}, {}, "parallel: pp_layers=[3, 2] adds up to 5 layers, but the model has 4"),
        ({"pp": 6}, {}, "parallel: pp=6 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"),
        (
            {"pp": 2},
            {"microbatches": 3},
            "data.global_batch_size=8 does not split into dp=1 x data.microbatches=3 micro-batches; "
            "valid microbatches: 1, 2, 4, 8",
        ),
        (
            {"pp": 2, "dp": 2},
            {"microbatches": 3},
            "data.global_batch_size=8 does not split into dp=2 x data.microbatches=3 micro-batches; "
            "valid microbatches: 1, 2, 4",
        ),
        (
            {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
            {"global_batch_size": 6},  # 3 micro-batches of 2
            "parallel.schedule='interleaved' needs the micro-batches per step (m=3) to be a multiple of pp=2; "
            "valid data.microbatches for global_batch_size=6 at dp=1: 2, 6; or use '1f1b', which takes any",
        ),
        (
            {"pp": 2, "schedule": "gpipe", "virtual_stages": 2},
            {},
            "parallel.schedule: schedule 'gpipe' runs one model chunk per rank: virtual_stages must be 1, got 2; "
            "use 'interleaved' for more",
        ),
        (
            {"pp": 4, "schedule": "interleaved", "virtual_stages": 2},
            {"microbatches": 4},
            "parallel: pp=4 x virtual_stages=2 = 8 stages is more than the model's 4 layers; "
            "valid pp sizes at virtual_stages=2: 1, 2",
        ),
    ],
)
def test_bad_pp_configs_are_one_line_naming_the_numbers(parallel, data, message):
    with pytest.raises(ConfigError) as err:
        _config(parallel, data)
    assert str(err.value) == message


def test_microbatches_set_the_micro_batch_size():
    cfg = _config({"pp": 2, "dp": 2}, {"microbatches": 2})
    assert cfg.data.micro_batch_size == 2 and cfg.data.grad_accum(2) == 2
    assert cfg.parallel.world_size == 4 and cfg.parallel.layout() == "tp=1,pp=2,dp=2"
    assert cfg.check_stages(4).layers == (2, 2)
    split = _config({"pp": 2, "pp_layers": [3, 1]})
    assert split.check_stages(4).describe() == "stage 0: layers 0-2 + embed; stage 1: layers 3 + norm, head, loss"


def _best_by_brute_force(costs, pp, first, last):
    """The smallest largest-stage cost over every contiguous split (for the weighted split)."""
    import itertools

    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stage = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        stage[0] += first
        stage[-1] += last
        best = max(stage) if best is None else min(best, max(stage))
    return best


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 20), min_size=1, max_size=9),
    pp=st.integers(1, 4),
    first=st.integers(0, 30),
    last=st.integers(0, 60),
)
def test_weighted_split_minimizes_the_largest_stage(costs, pp, first, last):
    if pp > len(costs):
        with pytest.raises(StageError, match=f"pp={pp} is more than the model's {len(costs)} layers"):
            StageLayout.weighted(costs, pp, first, last)
        return
    layout = StageLayout.weighted(costs, pp, first, last)
    assert sum(layout.layers) == len(costs) and len(layout.layers) == pp and min(layout.layers) >= 1
    bounds = [0, *itertools.accumulate(layout.layers)]
    stage = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    stage[0] += first
    stage[-1] += last
    assert max(stage) == _best_by_brute_force(costs, pp, first, last)


def test_the_inference_split_counts_the_head_on_the_last_stage():
    from shardwise.engine.pipeline import stage_layout
    from shardwise.pipeline.stage import layer_weights

    # the benchmark model's shape: the 32000 x 1024 head weighs about 2.9 of its layers
    cfg = ModelConfig.debug(
        hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816, num_layers=8, vocab_size=32000
    )
    assert 2.5 < cfg.vocab_size * cfg.hidden_size / layer_weights(cfg, 0) < 3.5
    assert stage_layout(cfg, 2).layers == (5, 3)
    assert stage_layout(cfg, 2, [4, 4]).layers == (4, 4)  # --pp-layers as given
    tiny_vocab = ModelConfig.debug(num_layers=8, vocab_size=8)
    assert stage_layout(tiny_vocab, 2).layers == (4, 4)
