"""Training config (TOML, validation naming fields and numbers, the pipeline fields and
the `--layout` form), the token file, the dp-aware sampler (the same global batches at any
dp), the RNG seeds and the LR schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.train import (
    ConfigError,
    DataError,
    DPSampler,
    OptimSection,
    TokenFile,
    TrainConfig,
    lr_at,
    tokenize_text,
    write_token_file,
)
from train_helpers import ROOT

_PP = "[model]\nnum_layers = 4\n[parallel]\n"
"""A config's [model] (4 layers) and the start of its [parallel]; the data section follows."""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_shipped_configs_parse_and_resolve_paths(name):
    cfg = TrainConfig.from_toml(ROOT / "configs" / name)
    assert Path(cfg.data.text).is_file() and Path(cfg.model.tokenizer).is_file()
    assert cfg.data.grad_accum(cfg.parallel.dp) >= 1


def test_paths_are_relative_to_the_config_file(tmp_path):
    cfg = TrainConfig.from_toml(_write(tmp_path, '[data]\ntokens = "t.safetensors"\n[run]\nout_dir = "out"\n'))
    assert cfg.data.tokens == str(tmp_path / "t.safetensors") and cfg.run.out_dir == str(tmp_path / "out")
    assert cfg.optim.lr == 3e-3 and cfg.parallel.tp == 1  # defaults


@pytest.mark.parametrize(
    "text,message",
    [
        ('[data]\ntokens = "t"\n[optim]\nlrr = 1.0\n', "unknown field optim.lrr"),
        ('[data]\ntokens = "t"\n[trainer]\n', r"unknown section\(s\) \[trainer\]"),
        ('[data]\ntokens = "t"\n[parallel]\ntp = "two"\n', "parallel.tp must be an integer, got 'two'"),
        ('[data]\ntokens = "t"\n[run]\nbf16 = 1\n', "run.bf16 must be true or false"),
        ("[data]\nseq_len = 8\n", "set exactly one of data.tokens and data.text"),
        (
            '[data]\ntokens = "t"\nglobal_batch_size = 12\nmicro_batch_size = 4\n[parallel]\ndp = 2\n',
            r"global_batch_size=12 is not a multiple of data.micro_batch_size=4 \* dp=2 \(= 8\)",
        ),
        ('[data]\ntokens = "t"\n[model]\nnum_kv_heads = 3\n', "num_heads=8 is not a multiple of model.num_kv_heads=3"),
        ('[data]\ntokens = "t"\n[optim]\nmin_lr = 1.0\n', r"optim.min_lr=1.0 must be in \[0, optim.lr=0.003\]"),
        ('[data]\ntokens = "t"\n[parallel]\ndp_sync = "nccl"\n', "parallel.dp_sync must be one of"),
        ('[data]\ntokens = "t"\nseq_len = 600\n', "data.seq_len=600 exceeds model.max_positions=512"),
        ("[data\n", "invalid TOML"),
        # the pipeline fields: one line naming the numbers and the valid choices
        (_PP + "pp = 5\n", r"parallel: pp=5 is more than the model's 4 layers; valid pp sizes: 1, 2, 3, 4$"),
        (_PP + "pp = 2\npp_layers = [3, 2]\n", r"pp_layers=\[3, 2\] adds up to 5 layers, but the model has 4$"),
        (_PP + "pp = 2\npp_layers = [4]\n", r"pp_layers=\[4\] has 1 entries; pp=2 x virtual_stages=1 needs 2$"),
        (
            _PP + 'pp = 2\nschedule = "interleaved"\nvirtual_stages = 2\n[data]\ntokens = "t"\nmicrobatches = 1\n',
            r"\(m=1\) to be a multiple of pp=2; valid data.microbatches for global_batch_size=\d+ at dp=1: [\d, ]+; "
            r"or use '1f1b'",
        ),
        (
            _PP + "pp = 2\nvirtual_stages = 2\n",
            "schedule '1f1b' runs one model chunk per rank: virtual_stages must be 1",
        ),
        (_PP + 'schedule = "interleaved"\nvirtual_stages = 2\n', "virtual_stages=2 needs pp > 1; at pp=1 there is no"),
        (_PP + 'pp = 2\ndp_sync = "ddp"\n', "dp_sync='ddp' runs forward through DistributedDataParallel"),
        (
            '[data]\ntokens = "t"\nglobal_batch_size = 12\nmicrobatches = 5\n',
            "global_batch_size=12 does not split into dp=1 x data.microbatches=5 micro-batches; valid microbatches: "
            "1, 2, 3, 4, 6, 12$",
        ),
    ],
)
def test_bad_configs_name_the_field(tmp_path, text, message):
    if text.startswith(_PP) and "[data]" not in text:
        text += '[data]\ntokens = "t"\n'
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_toml(_write(tmp_path, text))


def test_pipeline_fields_the_stages_and_micro_batches():
    raw = {"data": {"tokens": "t", "global_batch_size": 8, "microbatches": 4}, "model": {"num_layers": 5}}
    cfg = TrainConfig.from_dict({**raw, "parallel": {"pp": 2, "dp": 2}})
    assert cfg.data.micro_batch_size == 1 and cfg.data.grad_accum(2) == 4  # m = microbatches, per dp rank
    assert cfg.check_stages(5).layers == (3, 2) and cfg.parallel.world_size == 4
    cfg = TrainConfig.from_dict({**raw, "parallel": {"pp": 2, "pp_layers": [1, 4], "tp": 2}})
    assert cfg.check_stages(5).layers == (1, 4) and cfg.data.micro_batch_size == 2
    with pytest.raises(ConfigError, match=r"pp=2 is more than the model's 1 layers; valid pp sizes: 1$"):
        TrainConfig.from_dict({**raw, "parallel": {"pp": 2}}).check_stages(1)  # a pretrained model's count


@pytest.mark.parametrize("text", ["tp=2,pp=2,dp=1", "pp=2", " dp=4 , tp=1 ", "tp=8,pp=1,dp=1"])
def test_layout_strings_round_trip(text):
    from shardwise.cli.train import parse_layout
    from shardwise.train import ParallelSection

    layout = parse_layout(text)
    assert parse_layout(ParallelSection(**layout).layout()) == {"tp": 1, "pp": 1, "dp": 1, **layout}


@pytest.mark.parametrize(
    "text,message",
    [
        ("tp=2,ep=2", "unknown key 'ep'; valid keys: tp, pp, dp; the form is tp=N,pp=N,dp=N"),
        ("tp=0", "tp must be a positive integer, got '0'"),
        ("tp=2,pp=-1", "pp must be a positive integer, got '-1'"),
        ("tp=2,tp=2", "tp is given twice"),
        ("tp2", "'tp2' is not key=value"),
        ("", "'' is not key=value"),
        ("tp=2,", "'' is not key=value"),
    ],
)
def test_bad_layout_strings_are_refused_naming_the_form(text, message):
    from shardwise.cli.train import parse_layout

    with pytest.raises(ValueError, match=message) as e:
        parse_layout(text)
    assert str(e.value).startswith(f"--layout {text!r}: ") and str(e.value).endswith("e.g. tp=2,pp=2,dp=1")


def test_pp_layers_flag():
    from shardwise.cli.train import parse_pp_layers

    assert parse_pp_layers("5,3") == [5, 3] and parse_pp_layers(" 1, 2 ,1") == [1, 2, 1]
    for bad in ("5;3", "5,0", "5,", "a"):
        with pytest.raises(ValueError, match=f"--pp-layers {bad!r}: give the decoder layers of each stage"):
            parse_pp_layers(bad)


def test_every_config_field_is_documented():
    import inspect

    from shardwise.train import config as mod

    for cls in (mod.ModelSection, mod.DataSection, mod.OptimSection, mod.ParallelSection, mod.RunSection):
        src = inspect.getsource(cls)
        for name in cls.__dataclass_fields__:
            after = src.split(f"    {name}:", 1)[1].split("\n", 2)
            assert after[1].strip().startswith('"""'), f"{cls.__name__}.{name} has no docstring"


def test_token_file_round_trip_and_windows(tmp_path):
    ids = torch.arange(100) % 37
    path = write_token_file(tmp_path / "t.safetensors", ids, vocab_size=37)
    data = TokenFile(path, seq_len=8)
    assert (data.num_tokens, data.num_samples, data.vocab_size) == (100, 12, 37)
    x, y = data.batch([0, 11])
    assert torch.equal(x[1], ids[88:96]) and torch.equal(y[1], ids[89:97]) and x.dtype == torch.int64
    with pytest.raises(DataError, match=r"token ids must lie in \[0, vocab_size=10\)"):
        write_token_file(tmp_path / "bad.safetensors", ids, vocab_size=10)
    with pytest.raises(DataError, match="3 tokens make no sample of seq_len=8"):
        TokenFile(write_token_file(tmp_path / "short.safetensors", ids[:3], vocab_size=37), seq_len=8)
    with pytest.raises(DataError, match="does not exist"):
        TokenFile(tmp_path / "missing.safetensors", seq_len=8)


def test_tokenize_text_caches(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("It is a truth universally acknowledged.\n\nHowever little known.\n")
    from shardwise.engine.text import DEFAULT_MODEL

    out = tokenize_text(text, DEFAULT_MODEL / "tokenizer.json", tmp_path / "t.safetensors", vocab_size=512)
    mtime, before = out.stat().st_mtime_ns, TokenFile(out, seq_len=1).num_tokens
    assert tokenize_text(text, DEFAULT_MODEL / "tokenizer.json", out, vocab_size=512).stat().st_mtime_ns == mtime
    text.write_text("changed")
    tokenize_text(text, DEFAULT_MODEL / "tokenizer.json", out, vocab_size=512)
    assert TokenFile(out, seq_len=1).num_tokens < before  # re-tokenized: the text changed


@pytest.mark.parametrize("dp,micro", [(1, 8), (1, 2), (2, 2), (4, 1), (8, 1)])
def test_sampler_gives_the_same_global_batches_at_any_dp(dp, micro):
    ref = DPSampler(50, global_batch=8, micro_batch=8, dp=1, dp_rank=0, seed=3)
    samplers = [DPSampler(50, global_batch=8, micro_batch=micro, dp=dp, dp_rank=r, seed=3) for r in range(dp)]
    for step in (0, 5, 6, 7, 30):  # 50 samples: step 6 spans the first epoch boundary
        got = [i for s in samplers for mb in s.micro_batches(step) for i in mb]
        assert got == ref.micro_batches(step)[0]
        assert all(len(mb) == micro for s in samplers for mb in s.micro_batches(step))
    first_epoch = [i for step in range(6) for i in ref.global_indices(step)]
    assert len(set(first_epoch)) == 48  # no repeats within an epoch


def test_lr_schedule():
    cfg = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 14) == 1.0 and lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(9, cfg, 14) == pytest.approx(0.55)
    assert lr_at(9, OptimSection(lr=1.0, min_lr=0.1, schedule="constant"), 14) == 1.0
