"""Sequence parallelism and recompute, in one process: the config fields and their
refusals (one line, before any rank starts), the CLI flags, the plans as data, and
recomputation on an unsharded model (the same gradients, fewer saved bytes), and the
activation formula against the bytes autograd really keeps."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from processes import run_cli_inline
from shardwise.cli import train as cli
from shardwise.layers import ShardError
from shardwise.models import DecoderLM, ModelConfig
from shardwise.planner.activations import layer_activation_bytes
from shardwise.sharding import SequenceScatter, SequenceSharded, as_style
from shardwise.sharding.plans import decoder_plan
from shardwise.train import ConfigError, TrainConfig, model_config
from shardwise.train.recompute import Recomputed, apply_recompute
from shardwise.train.saved import SavedBytes
from train_helpers import TINY_MODEL


def _cfg(tmp_path, *, tp=2, seq_len=32, sp=True, recompute="none") -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": dict(TINY_MODEL),
            "data": {"tokens": str(tmp_path / "t.safetensors"), "seq_len": seq_len},
            "parallel": {"tp": tp, "sequence_parallel": sp},
            "run": {"recompute": recompute, "out_dir": str(tmp_path / "run")},
        }
    )


def test_config_fields_and_defaults(tmp_path):
    cfg = _cfg(tmp_path, recompute="selective")
    assert cfg.parallel.sequence_parallel and cfg.run.recompute == "selective"
    plain = TrainConfig.from_dict({"data": {"tokens": "t"}})
    assert not plain.parallel.sequence_parallel and plain.run.recompute == "none"
    assert _cfg(tmp_path, tp=1, seq_len=31).parallel.sequence_parallel  # no effect at tp=1, not refused


@pytest.mark.parametrize(
    "tp,seq_len,message",
    [
        (4, 30, "data.seq_len=30 is not a multiple of 4; use data.seq_len=28 or 32, or sequence_parallel = false"),
        (3, 2, "data.seq_len=2 is not a multiple of 3; use data.seq_len=3, or sequence_parallel = false"),
    ],
)
def test_a_seq_len_tp_does_not_divide_is_refused_in_one_line(tmp_path, tp, seq_len, message):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, tp=tp, seq_len=seq_len)
    assert str(err.value) == f"parallel.sequence_parallel splits each sequence over tp={tp} ranks, but {message}"
    _cfg(tmp_path, tp=tp, seq_len=seq_len, sp=False)  # fine without sequence parallelism


def test_an_unknown_recompute_mode_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="run.recompute must be one of 'none', 'selective', 'full', got 'partial'"):
        _cfg(tmp_path, recompute="partial")


def _toml(tmp_path, seq_len: int = 30):
    sizes = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    path = tmp_path / "c.toml"
    path.write_text(
        f'[model]\n{sizes}\n[data]\ntokens = "{tmp_path / "none.safetensors"}"\nseq_len = {seq_len}\n'
        f'[run]\nout_dir = "{tmp_path / "run"}"\n'
    )
    return path


def test_cli_refuses_before_any_rank_starts(tmp_path):
    out = run_cli_inline("train", "--config", _toml(tmp_path), "--tp", "4", "--sequence-parallel")
    message = (
        "parallel.sequence_parallel splits each sequence over tp=4 ranks, but data.seq_len=30 is not a multiple "
        "of 4; use data.seq_len=28 or 32, or sequence_parallel = false"
    )
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"shardwise: error: {message}\n")
    out = run_cli_inline("train", "--config", _toml(tmp_path), "--recompute", "most")
    assert out.returncode == 2 and "--recompute: invalid choice: 'most'" in out.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is checked"


def test_cli_flags_set_the_config_and_the_startup_line(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--config", str(_toml(tmp_path, 32)), "--tp", "2"])
    cfg = cli.load_config(args)
    assert not cfg.parallel.sequence_parallel and cfg.run.recompute == "none"
    line = cli.startup_line(cfg, model_config(cfg), "t", "gloo")
    assert "sequence parallel" not in line and "recompute" not in line
    args = parser.parse_args(
        ["train", "--config", str(_toml(tmp_path, 32)), "--tp", "2", "--sequence-parallel", "--recompute", "full"]
    )
    cfg = cli.load_config(args)
    assert cfg.parallel.sequence_parallel and cfg.run.recompute == "full"
    line = cli.startup_line(cfg, model_config(cfg), "t", "gloo")
    assert "tp=2 x pp=1 x dp=1 (gloo), sequence parallel (16 of 32 positions per tp rank), recompute full" in line


def test_the_sequence_parallel_plan_is_data():
    cfg = ModelConfig.debug()
    plan = decoder_plan(cfg, gather_logits=False, sequence_parallel=True)
    assert plan == decoder_plan(cfg, gather_logits=False) | plan  # the same modules, and the norms
    assert {k for k, v in plan.items() if as_style(v) == SequenceSharded()} == {
        "layers.*.attn_norm",
        "layers.*.mlp_norm",
        "norm",
    }
    for pattern in ("embed", "layers.*.attn.qkv", "layers.*.attn.o", "layers.*.mlp.up", "layers.*.mlp.down", "lm_head"):
        assert as_style(plan[pattern]).sequence_parallel, pattern
    assert "pos_embed" not in plan
    learned = decoder_plan(ModelConfig.debug(positions="learned"), sequence_parallel=True)
    assert as_style(learned["pos_embed"]) == SequenceScatter()
    with pytest.raises(ShardError, match="sequence parallelism is for decoder models; 'bert' is an encoder"):
        decoder_plan(ModelConfig.debug(family="bert", causal=False), sequence_parallel=True)


def _grads_and_saved(model, ids, target):
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, saved


def test_recompute_gives_the_same_gradients_and_saves_less():
    torch.manual_seed(0)
    base = DecoderLM(ModelConfig.debug(num_layers=3, vocab_size=64))
    ids = torch.randint(0, 64, (2, 16))
    target = torch.roll(ids, -1, dims=1)
    loss0, grads0, saved0 = _grads_and_saved(copy.deepcopy(base), ids, target)
    saved = {}
    for mode in ("selective", "full"):
        model = copy.deepcopy(base)
        paths = apply_recompute(model, mode)
        assert paths == (
            [f"layers.{i}" for i in range(3)] if mode == "full" else [f"layers.{i}.attn" for i in range(3)]
        )
        loss, grads, saved[mode] = _grads_and_saved(model, ids, target)
        assert torch.equal(loss, loss0), mode
        for name, g in grads.items():
            torch.testing.assert_close(
                g, grads0[name], rtol=0, atol=1e-7, msg=lambda m, n=name, k=mode: f"{k} {n}: {m}"
            )
        assert model.state_dict().keys() == base.state_dict().keys()
        with pytest.raises(ValueError, match=r"layers\.0(\.attn)? is already recomputed"):
            apply_recompute(model, "full")
    # hooks outside a checkpoint see only what is saved outside it: full saves the least
    assert saved["full"] < saved["selective"] < saved0, (saved, saved0)


def test_recomputed_runs_directly_without_autograd():
    model = DecoderLM(ModelConfig.debug(vocab_size=64))
    apply_recompute(model, "full")
    assert isinstance(model.layers[0].__dict__["forward"], Recomputed)
    assert repr(model.layers[0].__dict__["forward"]) == "Recomputed(layers.0.forward)"
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        out = model(ids)
    assert out.shape == (1, 5, 64) and out.grad_fn is None
    with pytest.raises(ValueError, match="recompute mode 'some' is unknown; choose one of none, selective, full"):
        apply_recompute(model, "some")
    assert apply_recompute(DecoderLM(ModelConfig.debug(vocab_size=64)), "none") == []


GPT2_LIKE = dict(
    family="gpt2", positions="learned", max_positions=32, norm="layer", gated_mlp=False, act="gelu",
    qkv_bias=True, o_bias=True, mlp_bias=True, num_kv_heads=8,
)  # fmt: skip


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
@pytest.mark.parametrize("bf16", [False, True])
def test_saved_bytes_per_layer_equal_the_formula(shape, bf16):
    """What autograd keeps per layer at tp=1 (measured with SavedBytes) is what
    shardwise.planner.activations counts, in each recompute mode and dtype."""
    cfg = ModelConfig.debug(num_layers=3, vocab_size=64, **(GPT2_LIKE if shape == "gpt2" else {}))
    torch.manual_seed(0)
    base = DecoderLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        apply_recompute(model, mode)
        with SavedBytes(model) as saved, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(ids).float().sum().backward()
        formula = layer_activation_bytes(cfg, tp=1, micro_batch=2, seq=16, recompute=mode, act_bytes=2 if bf16 else 4)
        assert saved.mean_layer() == pytest.approx(formula, rel=0.02), (mode, saved.per_layer, formula)
    assert len(saved.per_layer) == 3


def test_the_planner_takes_both_options():
    from shardwise.planner.footprint import training_memory
    from shardwise.planner.specs import PlannerError, TrainingWorkload

    assert TrainingWorkload(recompute=True).recompute == "full" and TrainingWorkload().recompute == "none"
    with pytest.raises(PlannerError, match="recompute 'some' is unknown; choose one of none, selective, full"):
        TrainingWorkload(recompute="some")
    cfg = ModelConfig.debug(hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1376, num_layers=4)
    kw = dict(micro_batches=1, micro_batch=2, seq=512, width=4, weight_bytes=4, optimizer="adam")
    kw |= dict(flash=True, budget=2**40)
    act = {
        (tp, sp, rc): training_memory(cfg, tp, 1, recompute=rc, sequence_parallel=sp, **kw).activations
        for tp in (1, 2)
        for sp in (False, True)
        for rc in ("none", "selective", "full")
    }
    assert act[2, True, "none"] < act[2, False, "none"] < act[1, False, "none"]
    assert act[2, True, "selective"] < act[2, True, "none"] and act[2, True, "full"] < act[2, True, "selective"]
    out = run_cli_inline(
        "plan", "--model", "llama-3-8b", "--cluster", "dgx-h100", "--train", "--sequence-parallel", "--recompute",
        "selective",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "recomputation selective, sequence parallel" in out.stdout
    # with a pipeline schedule too: the line that runs the recommendation (tp > 1) carries both options
    args = ("plan", "--model", "llama-3-8b", "--cluster", "dgx-h100", "--train", "--global-batch", "64", "--schedule",
            "gpipe", "--sequence-parallel", "--recompute", "selective")  # fmt: skip
    rec = json.loads(run_cli_inline(*args, "--json").stdout)["recommended"]
    assert rec["tp"] > 1 and rec["train_config"]["parallel"]["sequence_parallel"] is True
    assert rec["train_config"]["run"] == {"recompute": "selective"}
    (line,) = [x for x in run_cli_inline(*args).stdout.splitlines() if x.startswith("  shardwise train ")]
    m = rec["microbatches"]
    assert line.endswith(f"--layout {rec['layout']} --microbatches {m} --sequence-parallel --recompute selective")
