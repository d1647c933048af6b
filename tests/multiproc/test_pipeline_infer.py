"""Inference across pipeline stages: greedy tokens at tp x pp in {1x2, 2x2, 1x4} equal tp=1
(one process, no stages) and transformers, for every family in TINY, given 4 layers so
that pp=4 is possible. One pooled job per world size runs every family."""

from __future__ import annotations

import pytest
import torch

from hf_models import TINY, greedy, prompts, save_tiny

transformers = pytest.importorskip("transformers")

STEPS = 12
LAYOUTS = [(1, 2), (2, 2), (1, 4)]  # (tp, pp)


def _save(family: str, root) -> str:
    """TINY[family] with 4 decoder layers, saved by transformers."""
    layers = "n_layer" if family == "gpt2" else "num_hidden_layers"
    overrides = {layers: 4}
    if "layer_types" in TINY[family][2]:  # Gemma 3's pattern, one entry a layer: repeated to 4
        types = TINY[family][2]["layer_types"]
        overrides["layer_types"] = [types[i % len(types)] for i in range(4)]
    return str(save_tiny(family, root, overrides=overrides))


def _prompt_lists(vocab: int) -> list[list[int]]:
    ids, mask = prompts(vocab)  # (2, 7), left-padded
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, int, torch.Tensor, list[list[int]]]]:
    """family -> (checkpoint dir, vocab, transformers' greedy tokens (2, STEPS), tp=1's)."""
    root = tmp_path_factory.mktemp("pp_infer")
    out = {}
    for family, (_, model_cls, _, _) in TINY.items():
        path = _save(family, root)
        model = getattr(transformers, model_cls).from_pretrained(path).eval()
        ids, mask = prompts(model.config.vocab_size)

        def fwd(i, m, pos, model=model):
            return model(input_ids=i, attention_mask=m, position_ids=pos).logits

        with torch.no_grad():
            ref = greedy(fwd, ids, mask, steps=STEPS)
        assert len(set(ref.flatten().tolist())) > 4, f"{family}: greedy tokens should vary"
        out[family] = (path, model.config.vocab_size, ref, _tp1_tokens(path, model.config.vocab_size))
    return out


def _generate_staged(world, cases: list[tuple[str, str, int]], tp: int, pp: int) -> dict:
    """Every family's greedy tokens at tp x pp, and this rank's stage layers and accounting."""
    from shardwise.comm import ParallelDims
    from shardwise.engine import StageForward, generate
    from shardwise.hf import load_pretrained
    from shardwise.pipeline.stage import StageLayout

    mesh = ParallelDims(world_size=world.size, tp=tp, pp=pp).build(world)
    out = {}
    for family, path, vocab in cases:
        model, report = load_pretrained(path, comm=mesh.tp, stage=(StageLayout.build(4, pp), mesh.pp_rank))
        res = generate(
            model,
            _prompt_lists(vocab),
            comm=mesh.tp,
            max_new_tokens=STEPS,
            stages=StageForward(model, mesh),
        )
        out[family] = {"tokens": res.tokens, "layers": model.layer_indices(), "comm": res.comm_per_step}
    return out


def _tp1_tokens(path: str, vocab: int) -> list[list[int]]:
    from shardwise.comm import LocalCommunicator
    from shardwise.engine import generate
    from shardwise.hf import load_pretrained

    model, _ = load_pretrained(path, comm=LocalCommunicator())
    return generate(model, _prompt_lists(vocab), comm=LocalCommunicator(), max_new_tokens=STEPS).tokens


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}xpp{p}" for t, p in LAYOUTS])
def test_greedy_tokens_across_stages_match_tp1_and_transformers(rank_pool, models, tp, pp):
    cases = [(f, path, vocab) for f, (path, vocab, _, _) in models.items()]
    results = rank_pool.run(_generate_staged, tp * pp, args=(cases, tp, pp))
    failures = []
    for family, (_, _, ref, tp1) in models.items():
        ref_tokens = ref.tolist()
        if tp1 != ref_tokens:
            failures.append(f"{family}: tp=1 {tp1} != transformers {ref_tokens}")
        for rank, r in enumerate(results):
            mine = r[family]
            if mine["tokens"] != ref_tokens:
                failures.append(f"{family} rank {rank}: {mine['tokens']} != transformers {ref_tokens}")
            stage = rank // tp
            want = list(range(stage * 4 // pp, (stage + 1) * 4 // pp))
            if mine["layers"] != want:
                failures.append(f"{family} rank {rank}: holds layers {mine['layers']}, stage {stage} should {want}")
            # one decode step: a hop in and/or out of this stage, and the tokens' broadcast
            comm = mine["comm"]
            hops = {"send/pp": stage < pp - 1, "recv/pp": stage > 0}
            for key, expected in hops.items():
                if (comm.get(key, {}).get("calls", 0) == 1) != expected:
                    failures.append(f"{family} rank {rank}: {key} {comm.get(key)} (stage {stage} of {pp})")
            if comm.get("broadcast/world", {}).get("calls") != 1:
                failures.append(f"{family} rank {rank}: tokens broadcast {comm.get('broadcast/world')}")
    assert not failures, "\n".join(failures)
