"""`shardwise train` and `shardwise checkpoint` end to end, in subprocesses, as a user runs
them: train at tp=3 on the shipped corpus (4 heads: split 2/1/1, one KV head on two ranks),
reshard the checkpoint to tp=4, export it to a Hugging Face directory that transformers loads
(the same bytes as the tp=3 checkpoint's own export) and that `shardwise generate` runs at tp=3; train in two pipeline stages from `--layout`, losses equal
to one process's; and bad input, pipeline input included, fails with one line before any
rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processes import run_cli, run_cli_inline
from shardwise.checkpoint import CheckpointReader
from train_helpers import CORPUS, TINY_MODEL, TOKENIZER, write_tiny_tokens


def _toml(tmp: Path) -> Path:
    model = "\n".join(f"{k} = {v}" for k, v in TINY_MODEL.items())
    text = f"""
[model]
{model}
tokenizer = "{TOKENIZER}"
bos_token_id = 0
eos_token_id = 1

[data]
text = "{CORPUS}"
seq_len = 32
global_batch_size = 8
micro_batch_size = 4

[optim]
lr = 1e-2
warmup_steps = 2

[parallel]
tp = 3  # uneven: 4 heads, 2 KV heads, vocabulary 515
backend = "gloo"  # the default ("auto") picks MPI where installed; tests/multiproc covers MPI

[run]
steps = 8
log_every = 4
out_dir = "run"
"""
    path = tmp / "tiny.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    out = run_cli("train", "--config", str(_toml(tmp)))
    assert out.returncode == 0, out.stderr
    return tmp, out


@pytest.mark.gate
def test_train_prints_progress_summary_checkpoint_and_plot(trained):
    tmp, out = trained
    assert "tp=3 x pp=1 x dp=1 (gloo), steps to 8" in out.stdout
    assert "trained steps 1..8: loss " in out.stdout and "tokens/s" in out.stdout
    assert "step 4/8  loss " in out.stderr and "tok/s" in out.stderr  # the log line (and tqdm) on stderr
    ckpt = tmp / "run" / "checkpoints" / "step-00000008"
    assert f"checkpoint: {ckpt}" in out.stdout
    png = tmp / "run" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    losses = [loss for _, loss in CheckpointReader(ckpt).manifest.extra["history"]]
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_reshard_export_transformers_and_generate(trained):
    transformers = pytest.importorskip("transformers")
    tmp, _ = trained
    src, dst, hf = tmp / "run" / "checkpoints", tmp / "tp4", tmp / "hf"
    out = run_cli("checkpoint", "reshard", str(src), str(dst), "--tp", "4", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert (stats["tp_from"], stats["tp_to"]) == (3, 4) and stats["peak_chunk_bytes"] < stats["total_tensor_bytes"]
    assert CheckpointReader(dst).manifest.layout == {"tp": 4, "pp": 1, "dp": 1}

    out = run_cli("checkpoint", "export-hf", str(dst), str(hf))
    assert out.returncode == 0, out.stderr
    assert {p.name for p in hf.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    from shardwise.checkpoint.export import export_hf

    own = export_hf(src, tmp / "hf-tp3")  # the uneven checkpoint's own export: the same bytes
    assert (own / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    model = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    reader = CheckpointReader(src)
    from shardwise.layers import ShardSpec

    def weight(name):
        entry = reader.entry(f"param/{name}")
        return reader.read(f"param/{name}", ShardSpec.replicated(entry.global_shape))

    assert torch.equal(model.model.embed_tokens.weight, weight("embed.weight"))
    q_rows = TINY_MODEL["hidden_size"]
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, weight("layers.1.attn.qkv.weight")[:q_rows])

    out = run_cli(
        "generate", "--model", str(hf), "--tp", "3", "--prompt", "It is a truth", "--max-new-tokens", "6", "--json"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tp"] == 3 and len(result["tokens"][0]) >= 1


@pytest.mark.gate
def test_info_and_bad_input_fail_with_one_line(trained, tmp_path):
    tmp, _ = trained
    out = run_cli_inline("checkpoint", "info", str(tmp / "run" / "checkpoints"), "--verify")
    assert out.returncode == 0 and "step 8, saved at tp=3 x dp=1" in out.stdout and "verified" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\ntokens = 'x'\n[parallel]\ntp = 64\n")
    out = run_cli_inline("train", "--config", str(bad))
    assert out.returncode == 2 and out.stderr.startswith("shardwise: error: ") and "tp=64" in out.stderr
    out = run_cli_inline("checkpoint", "reshard", str(tmp_path / "nothing"), str(tmp_path / "x"), "--tp", "2")
    assert out.returncode == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1


# ---- pipeline parallelism ---------------------------------------------------------------

PP_STEPS = 6
LOSS_TOL = 2e-5  # as tests/multiproc/test_train_equivalence.py


def _pp_toml(tmp: Path, tokens: Path, *, pretrained: Path | None = None) -> Path:
    """TINY_MODEL with 4 layers in 2 stages (1f1b, m=4 micro-batches of 2 sequences)."""
    sizes = {**TINY_MODEL, "num_layers": 4}
    model = f'pretrained = "{pretrained}"' if pretrained else "\n".join(f"{k} = {v}" for k, v in sizes.items())
    path = tmp / "pp.toml"
    path.write_text(f"""
[model]
{model}

[data]
tokens = "{tokens}"
seq_len = 32
global_batch_size = 8
microbatches = 4

[optim]
lr = 1e-2
warmup_steps = 2

[parallel]
pp = 2
backend = "gloo"

[run]
steps = {PP_STEPS}
log_every = 3
out_dir = "run"
""")
    return path


@pytest.fixture(scope="module")
def pp_tokens(tmp_path_factory):
    return write_tiny_tokens(tmp_path_factory.mktemp("pp-tokens") / "tokens.safetensors")


def _one_process_losses(config: Path, steps: int, **parallel) -> list[float]:
    """The same job's losses trained in this process at tp = pp = dp = 1."""
    from shardwise.comm import LocalCommunicator
    from shardwise.train import TrainConfig, setup, train_step

    cfg = TrainConfig.from_toml(config)
    cfg = cfg.replace(parallel={"tp": 1, "pp": 1, "dp": 1, "schedule": "1f1b", "virtual_stages": 1, **parallel})
    tr = setup(LocalCommunicator(), cfg)
    return [train_step(tr).loss for _ in range(steps)]


def test_train_in_two_pipeline_stages_from_a_layout(pp_tokens, tmp_path):
    """One real pipeline run (2 ranks, uneven split, p2p_check on): its JSON summary, its log
    lines and what the command prints from that summary; losses equal one process's."""
    from shardwise.cli import train as cli
    from shardwise.train import TrainConfig, model_config

    config = _pp_toml(tmp_path, pp_tokens)
    args = ["--layout", "tp=1,pp=2,dp=1", "--pp-layers", "3,1", "--p2p-check"]
    out = run_cli("train", "--config", config, *args, "--no-progress", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    expect = {"tp": 1, "pp": 2, "dp": 1, "layout": "tp=1,pp=2,dp=1", "schedule": "1f1b", "virtual_stages": 1}
    expect |= {"microbatches": 4, "micro_batch_size": 2, "pp_layers": [3, 1], "p2p_check": True, "backend": "gloo"}
    assert {k: summary[k] for k in expect} == expect
    assert summary["bubble"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert "tp=1 x pp=2 x dp=1, 4 micro-step(s) of 2 x 32 tokens" in out.stderr
    assert "pipeline: 1f1b schedule, 4 micro-batches; stage 0: layers 0-2 + embed; stage 1: layers 3 + norm" in (
        out.stderr
    )
    assert f"step 3/{PP_STEPS}  loss " in out.stderr

    ckpt = tmp_path / "run" / "checkpoints" / f"step-{PP_STEPS:08d}"
    assert summary["checkpoint"] == str(ckpt) and summary["steps_run"] == PP_STEPS
    losses = [loss for _, loss in CheckpointReader(ckpt).manifest.extra["history"]]
    assert losses[0] == summary["first_loss"] and losses[-1] == summary["loss"] < summary["first_loss"]
    ref = _one_process_losses(config, PP_STEPS)
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < LOSS_TOL, (losses, ref)

    cfg = TrainConfig.from_toml(config).replace(parallel={"pp_layers": [3, 1]})
    first = cli.startup_line(cfg, model_config(cfg), pp_tokens, "gloo")
    assert f"tp=1 x pp=2 x dp=1 (gloo), 1f1b schedule, m=4 micro-batches of 2, layers [3, 1], steps to {PP_STEPS}" in (
        first
    )
    lines = cli.summary_lines(summary, cfg)
    assert lines[0].startswith(f"trained steps 1..{PP_STEPS}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, ")
    assert lines[1:] == [
        "pipeline: tp=1,pp=2,dp=1, 1f1b schedule, m=4, layers [3, 1]; bubble at equal stage times 0.20",
        f"checkpoint: {ckpt}",
        f"loss curve: {tmp_path / 'run' / 'loss.png'}",
    ]


_TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
_LAYOUT_FORM = "the form is tp=N,pp=N,dp=N (any of the three, as `shardwise plan` prints), e.g. tp=2,pp=2,dp=1"


@pytest.mark.gate
@pytest.mark.smoke  # no rank starts: as cheap as a unit test
@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--pp", "5"], {}, "parallel: pp=5 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"),
        (
            ["--pp", "4", "--virtual-stages", "2", "--schedule", "interleaved", "--microbatches", "4"],
            {},
            "parallel: pp=4 x virtual_stages=2 = 8 stages is more than the model's 4 layers; "
            "valid pp sizes at virtual_stages=2: 1, 2",
        ),
        (["--pp-layers", "3,2"], {}, "parallel: pp_layers=[3, 2] adds up to 5 layers, but the model has 4"),
        (["--pp-layers", "1,1,2"], {}, "parallel.pp_layers=[1, 1, 2] has 3 entries; pp=2 x virtual_stages=1 needs 2"),
        (["--pp-layers", "4,0"], {}, "--pp-layers '4,0': give the decoder layers of each stage as positive "
         "integers separated by commas, e.g. 5,3 for pp=2"),  # fmt: skip
        (
            ["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "1"],
            {},
            "parallel.schedule='interleaved' needs the micro-batches per step (m=1) to be a multiple of pp=2; "
            "valid data.microbatches for global_batch_size=8 at dp=1: 2, 4, 8; or use '1f1b', which takes any",
        ),
        (
            ["--virtual-stages", "2"],
            {},
            "parallel.schedule: schedule '1f1b' runs one model chunk per rank: virtual_stages must be 1, got 2; "
            "use 'interleaved' for more",
        ),
        (
            ["--pp", "1", "--schedule", "interleaved", "--virtual-stages", "2"],
            {},
            "parallel.schedule='interleaved' with virtual_stages=2 needs pp > 1; at pp=1 there is no pipeline",
        ),
        (
            ["--microbatches", "3"],
            {},
            "data.global_batch_size=8 does not split into dp=1 x data.microbatches=3 micro-batches; "
            "valid microbatches: 1, 2, 4, 8",
        ),
        (["--layout", "tp=2,pp=two"], {}, f"--layout 'tp=2,pp=two': pp must be a positive integer, got 'two'; {_LAYOUT_FORM}"),
        (["--layout", "tp=2,ep=2"], {}, f"--layout 'tp=2,ep=2': unknown key 'ep'; valid keys: tp, pp, dp; {_LAYOUT_FORM}"),
        (["--layout", "tp2"], {}, f"--layout 'tp2': 'tp2' is not key=value; {_LAYOUT_FORM}"),
        (
            ["--layout", "tp=2,pp=2,dp=1", "--tp", "4"],
            {},
            "--layout tp=2,pp=2,dp=1 sets tp=2 but --tp 4 sets tp=4; give one of them, or make them agree",
        ),
        (
            ["--layout", "tp=2,pp=2"],
            _TORCHRUN_2,
            "tp=2 x pp=2 x dp=1 = 4 ranks, but torchrun started 2; layouts for 2 ranks (--layout): "
            "tp=1,pp=1,dp=2; tp=1,pp=2,dp=1; tp=2,pp=1,dp=1",
        ),
        (
            ["--layout", "pp=2", "--dp", "2"],
            {"PMI_RANK": "0", "PMI_SIZE": "3"},
            "tp=1 x pp=2 x dp=2 = 4 ranks, but mpiexec started 3; layouts for 3 ranks (--layout): "
            "tp=1,pp=1,dp=3; tp=1,pp=3,dp=1; tp=3,pp=1,dp=1",
        ),
    ],
)  # fmt: skip
def test_bad_pipeline_input_fails_with_one_line_before_any_rank(tmp_path, args, env, message):
    out = run_cli_inline("train", "--config", _pp_toml(tmp_path, tmp_path / "none.safetensors"), *args, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"shardwise: error: {message}\n")
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is checked"


@pytest.mark.gate
@pytest.mark.smoke
def test_a_pretrained_models_layers_bound_pp_before_any_rank(tmp_path):
    from shardwise.engine.text import DEFAULT_MODEL  # 4 layers, read from its config.json

    config = _pp_toml(tmp_path, tmp_path / "none.safetensors", pretrained=DEFAULT_MODEL)
    out = run_cli_inline("train", "--config", config, "--pp", "8")
    message = "parallel: pp=8 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4"
    assert (out.returncode, out.stderr) == (2, f"shardwise: error: {message}\n")
    out = run_cli_inline("train", "--config", config, "--pp-layers", "1,2")
    message = "parallel: pp_layers=[1, 2] adds up to 3 layers, but the model has 4"
    assert (out.returncode, out.stderr) == (2, f"shardwise: error: {message}\n")
