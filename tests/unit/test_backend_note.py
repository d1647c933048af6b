"""`--backend auto` falling back to gloo on CPU for more than one rank says so, once."""

from __future__ import annotations

import sys

import pytest

from shardwise.launch import env

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture
def cpu_without_mpi(monkeypatch):
    """A CPU machine where `import mpi4py` fails, no launcher around, nothing noted yet."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # None in sys.modules: import raises ImportError
    monkeypatch.setattr(env, "_noted", False)
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)


def test_auto_on_gloo_prints_one_line_once(cpu_without_mpi, capsys):
    assert env.resolve_backend("auto", world_size=2) == "gloo"
    assert env.resolve_backend("auto", world_size=2) == "gloo"  # train resolves twice: still one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "gloo (mpi4py is not installed)" in err
    assert "pip install 'shardwise[mpi]'" in err and "mpich" in err


@pytest.mark.parametrize(
    ("name", "world_size", "environ"),
    [
        ("auto", 1, {}),  # one rank: no collectives to be slow
        ("gloo", 2, {}),  # asked for by name
        ("auto", 2, {"RANK": "1", "WORLD_SIZE": "2"}),  # torchrun's rank 1: rank 0 says it
    ],
)
def test_no_note(cpu_without_mpi, monkeypatch, capsys, name, world_size, environ):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert env.resolve_backend(name, world_size=world_size) == "gloo"
    assert capsys.readouterr().err == ""


def test_torchrun_rank0_takes_gloo_without_a_note(cpu_without_mpi, monkeypatch, capsys):
    # under torchrun MPI is no option (its ranks are not mpiexec's): nothing to suggest
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env.resolve_backend("auto", world_size=2) == "gloo"
    assert capsys.readouterr().err == ""


def test_mpi_installed_no_note(monkeypatch, capsys):
    import torch

    from shardwise.launch import mpi

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "mpi4py", type(sys)("mpi4py"))
    monkeypatch.setattr(mpi, "find_mpiexec", lambda: "/usr/bin/mpiexec")
    monkeypatch.setattr(env, "_noted", False)
    assert env.resolve_backend("auto", world_size=2) == "mpi"
    assert capsys.readouterr().err == ""


def test_mpi4py_without_mpiexec_names_it(cpu_without_mpi, monkeypatch, capsys):
    from shardwise.launch import mpi

    def no_mpiexec():
        raise RuntimeError("no mpiexec")

    monkeypatch.setitem(sys.modules, "mpi4py", type(sys)("mpi4py"))
    monkeypatch.setattr(mpi, "find_mpiexec", no_mpiexec)
    assert env.resolve_backend("auto", world_size=3) == "gloo"
    assert "no mpiexec was found" in capsys.readouterr().err


def test_under_torchrun_auto_is_gloo_even_where_mpi_is_installed(monkeypatch, capsys):
    import torch

    from shardwise.launch import mpi

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "mpi4py", type(sys)("mpi4py"))
    monkeypatch.setattr(mpi, "find_mpiexec", lambda: "/usr/bin/mpiexec")
    monkeypatch.setattr(env, "_noted", False)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert env.resolve_backend("auto", world_size=2, environ=torchrun) == "gloo"
    assert env.resolve_backend("auto", world_size=2, environ={}) == "mpi"
    assert capsys.readouterr().err == ""
