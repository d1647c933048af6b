"""Memory said before it is spent: the host-memory readers on sample file contents, the
commands' pre-check refusing a model larger than a mocked allowance (with what would fit),
--force skipping it, and a rank killed by the out-of-memory killer reported as such.

Nothing here starts a rank: the allowance is mocked (shardwise.cli.memcheck.host_memory),
and the job a passing check would start is replaced by a stub."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from shardwise.cli import generate as generate_cli
from shardwise.cli import memcheck
from shardwise.cli import train as train_cli
from shardwise.cli.main import main
from shardwise.launch import failfast, local
from shardwise.launch.failfast import Outcomes
from shardwise.memory import (
    LIMIT_ENV,
    NEED_ENV,
    HostMemory,
    cgroup_room,
    host_memory,
    oom_kills,
    parse_meminfo,
    parse_oom_kill,
    parse_size,
)
from shardwise.planner.fit import Allowance, fits, inference_need, training_need

MIB = 2**20
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ---- readers -------------------------------------------------------------------------------
def test_parsers_on_sample_files():
    assert cgroup_room("max\n", "123456\n") is None  # v2 without a limit
    assert cgroup_room("8589934592\n", "1073741824\n") == 7 * 2**30  # v2
    assert cgroup_room("9223372036854771712\n", "9809633280\n") is None  # v1 without a limit
    assert cgroup_room("1000\n", "2000\n") == 0  # over the limit: nothing left
    meminfo = "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   20875152 kB\n"
    assert parse_meminfo(meminfo) == 20875152 * 1024
    assert parse_meminfo("MemTotal: 1 kB\n") is None
    events = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"  # v2 memory.events
    assert parse_oom_kill(events) == 2
    assert parse_oom_kill("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5  # v1 memory.oom_control
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512M") == 512 * MIB and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_host_memory_takes_the_smaller_of_cgroup_and_meminfo(tmp_path, monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    meminfo = _files(tmp_path, {"meminfo": "MemAvailable:   4194304 kB\n"}) / "meminfo"  # 4 GiB
    v2 = _files(tmp_path / "v2", {"memory.max": f"{3 * 2**30}\n", "memory.current": f"{2**30}\n"})
    assert host_memory(v2, meminfo) == HostMemory(2 * 2**30, "cgroup v2 limit (memory.max - memory.current)")
    v1 = _files(
        tmp_path / "v1", {"memory/memory.limit_in_bytes": f"{8 * 2**30}\n", "memory/memory.usage_in_bytes": "0\n"}
    )
    assert host_memory(v1, meminfo) == HostMemory(4 * 2**30, "MemAvailable")  # the cgroup allows more
    unlimited = _files(tmp_path / "max", {"memory.max": "max\n", "memory.current": "1\n"})
    assert host_memory(unlimited, meminfo).source == "MemAvailable"
    assert host_memory(tmp_path / "none", tmp_path / "absent") is None
    monkeypatch.setenv(LIMIT_ENV, "1GiB")
    assert host_memory(v2, meminfo) == HostMemory(2**30, LIMIT_ENV)
    events = _files(tmp_path / "ev", {"memory.events": "oom 1\noom_kill 1\n"})
    assert oom_kills(events) == 1 and oom_kills(tmp_path / "none") is None


def test_cgroup_of_this_process_and_its_ancestors(tmp_path, monkeypatch):
    """The limit may sit on an ancestor of the process's cgroup (/proc/self/cgroup names it)."""
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    meminfo = _files(tmp_path, {"meminfo": "MemAvailable:   67108864 kB\n"}) / "meminfo"  # 64 GiB
    v2 = _files(tmp_path / "v2", {
        "job.slice/memory.max": f"{8 * 2**30}\n", "job.slice/memory.current": f"{2**30}\n",
        "job.slice/run/memory.max": "max\n", "job.slice/run/memory.current": "5\n",
        "job.slice/run/memory.events": "oom 2\noom_kill 2\n",
    })  # fmt: skip
    own = _files(tmp_path, {"self_v2": "0::/job.slice/run\n"}) / "self_v2"
    assert host_memory(v2, meminfo, own) == HostMemory(7 * 2**30, "cgroup v2 limit (memory.max - memory.current)")
    assert oom_kills(v2, own) == 2
    v1 = _files(tmp_path / "v1", {
        "memory/docker/abc/memory.limit_in_bytes": f"{2**30}\n", "memory/docker/abc/memory.usage_in_bytes": "0\n",
        "memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
    })  # fmt: skip
    own = _files(tmp_path, {"self_v1": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"}) / "self_v1"
    assert host_memory(v1, meminfo, own).available == 2**30
    assert oom_kills(v1, own) == 4


# ---- the pre-check ---------------------------------------------------------------------------
@pytest.fixture
def allowed(monkeypatch):
    """allowed(bytes): the host allows that much (a mocked reader); no CUDA device."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv(NEED_ENV, raising=False)

    def set_to(n: int) -> None:
        monkeypatch.setattr(memcheck, "host_memory", lambda: HostMemory(n, "cgroup v2 limit (mocked)"))

    return set_to


def _run(argv: list[str]) -> int:
    """The command's exit status (a one-line error exits through CliError, a SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


class Started(Exception):
    """A stub job: the check let the ranks start."""


def _no_ranks(monkeypatch, module) -> None:
    def job(*a, **kw):
        raise Started

    monkeypatch.setattr(module, "job", job)


def test_generate_refused_with_the_options_that_fit(allowed, monkeypatch, capsys):
    _no_ranks(monkeypatch, generate_cli)
    allowed(300 * MIB)  # 2 ranks' runtime alone is 512 MiB; one rank fits
    assert _run(["generate", "--tp", "2", "--max-new-tokens", "4", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("shardwise: error: not enough memory: each rank needs about")
    assert "300.0 MiB (cgroup v2 limit (mocked)) for 2 ranks" in err
    assert "would fit: --tp 1 (" in err and "--force skips this check" in err
    with pytest.raises(Started):  # --force: no check, the ranks start
        main(["generate", "--tp", "2", "--max-new-tokens", "4", "--json", "--force"])
    allowed(2**40)
    with pytest.raises(Started):  # fits
        main(["generate", "--tp", "2", "--max-new-tokens", "4", "--json"])


def test_serve_sizes_its_pool_to_fit_or_is_refused_with_a_budget_that_fits(allowed, monkeypatch, capsys):
    monkeypatch.setattr("shardwise.cli.serve.job", lambda *a, **kw: (_ for _ in ()).throw(Started()))
    allowed(600 * MIB)
    # the default budget (0.9 of a rank's room) shrinks the pool below 256 x 512 tokens: it starts
    with pytest.raises(Started):
        main(["serve", "--port", "0", "--max-batch-size", "256"])
    # a pool of a given size (256 MiB per rank at tp 2, beside 5 MiB of weights) does not fit
    assert _run(["serve", "--port", "0", "--kv-cache-memory", "256MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "kv cache 256.0 MiB" in err and "for 2 ranks" in err
    assert "would fit: --kv-cache-memory " in err and "--max-model-len" not in err
    # the suggestion fits, and a pool 2 MiB larger would not
    size = int(err.split("--kv-cache-memory ")[1].split("MiB")[0])
    cfg = generate_cli.resolve_model(None, 2)[1]
    kw = dict(tp=2, pp_layers=None, dtype=None, quantize=None, expert_parallel=False, batch=1, prefill_batch=1)
    per_token = inference_need(cfg, prompt_len=512, kv_tokens=1, **kw).parts["kv cache"]
    allow = Allowance(600 * MIB, "mocked", 2)
    assert fits(inference_need(cfg, prompt_len=512, kv_tokens=int(size * MIB // per_token), **kw), allow)
    assert not fits(inference_need(cfg, prompt_len=512, kv_tokens=int((size + 2) * MIB // per_token), **kw), allow)
    with pytest.raises(Started):
        main(["serve", "--port", "0", "--kv-cache-memory", "256MiB", "--skip-memory-check"])


def test_train_refused_with_layouts_that_fit(allowed, monkeypatch, capsys):
    from shardwise.train import TrainConfig, model_config

    cfg = TrainConfig.from_toml(CONFIGS / "austen-tp2.toml")
    model_cfg = model_config(cfg)
    monkeypatch.setattr(train_cli, "prepare", lambda c: (model_cfg, "tokens.safetensors", "gloo"))  # no tokenizing
    _no_ranks(monkeypatch, train_cli)
    allowed(530 * MIB)
    assert _run(["train", "--config", str(CONFIGS / "austen-tp2.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "gradients" in err and "optimizer state" in err and "would fit: --layout tp=1,pp=1,dp=1" in err
    with pytest.raises(Started):
        main(["train", "--config", str(CONFIGS / "austen-tp2.toml"), "--force"])


def test_train_suggests_the_distributed_optimizer(allowed, capsys):
    """A model whose optimizer state dominates: at dp=4 the distributed optimizer divides it by 4."""
    from dataclasses import replace

    from shardwise.cli.common import CliError
    from shardwise.planner.fit import RUNTIME_BYTES
    from shardwise.train import TrainConfig, model_config

    cfg = TrainConfig.from_toml(CONFIGS / "austen-tp2.toml")
    big = replace(cfg.model, hidden_size=2048, intermediate_size=4096, num_heads=16, num_kv_heads=8)
    cfg = replace(
        cfg, model=big, data=replace(cfg.data, micro_batch_size=4), parallel=replace(cfg.parallel, tp=1, dp=4)
    )
    model_cfg = model_config(cfg)
    plain = training_need(model_cfg, tp=1, pp=1, dp=4, micro_batches=1, micro_batch=4, seq=128)
    dist = training_need(model_cfg, tp=1, pp=1, dp=4, micro_batches=1, micro_batch=4, seq=128,
                                  distributed=True)  # fmt: skip
    assert plain.parts["optimizer state"] == 4 * dist.parts["optimizer state"]  # 8 bytes a parameter vs 8 / 4
    allowed(int(4 * (dist.busiest + plain.busiest) / 2 + 4 * RUNTIME_BYTES))  # between the two
    with pytest.raises(CliError) as e:
        memcheck.check_training(cfg, model_cfg, force=False)
    assert e.value.code == 2
    assert "would fit: --distributed-optimizer (" in capsys.readouterr().err


# ---- a rank the OOM killer ended -------------------------------------------------------------
def test_death_names_the_oom_killer(monkeypatch):
    monkeypatch.setattr(
        failfast, "host_memory", lambda: HostMemory(8 * 2**30, "cgroup v2 limit (memory.max - memory.current)")
    )
    monkeypatch.setenv(NEED_ENV, str(int(11.3 * 2**30)))
    said = local.death(-signal.SIGKILL, 2, 0, 1)
    assert said == (
        "killed by the out-of-memory killer (cgroup oom_kill 0 -> 1); it needed about 11.30 GiB, "
        "the host allowed 8.00 GiB (cgroup v2 limit (memory.max - memory.current)) for 2 ranks"
    )
    assert local.death(-signal.SIGKILL, 2, 1, 1) == "killed by signal SIGKILL"  # someone else's kill
    assert local.death(-signal.SIGKILL, 2, None, None).endswith(
        "(possibly out of memory: the cgroup's OOM count is not readable)"
    )
    assert local.death(-signal.SIGSEGV, 2, 0, 1) == "killed by signal SIGSEGV"
    assert local.death(3, 2, 0, 1) == "exit code 3"


class _DeadRank:
    pid, exitcode, sentinel = 4242, -signal.SIGKILL, None

    def is_alive(self) -> bool:
        return False


def test_launcher_reports_an_oom_kill(monkeypatch):
    """_poll sees a SIGKILLed rank while the cgroup's oom_kill count went 0 -> 1."""
    monkeypatch.setattr(local, "oom_kills", lambda: 1)
    monkeypatch.setattr(failfast, "host_memory", lambda: None)
    monkeypatch.delenv(NEED_ENV, raising=False)
    outcomes = Outcomes(2, [4242, 4243])
    local._poll([_DeadRank()], {}, outcomes, 0.0, 0)
    assert outcomes.failures[0].summary == "process 4242 killed by the out-of-memory killer (cgroup oom_kill 0 -> 1)"
