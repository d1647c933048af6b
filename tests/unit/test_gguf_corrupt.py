"""Corrupt GGUF files are refused in one line that names the file and what is wrong: a
header cut anywhere, bytes and 64-bit counts, lengths and offsets overwritten with any
value (hypothesis draws them), bad UTF-8 in keys and strings, wrong magic and version.
Nothing a corrupt file holds may surface as Python's struct or decoding errors, hang,
or allocate what a count claims."""

from __future__ import annotations

import struct

import pytest

from gguf_files import write_gguf
from hf_models import save_tiny

pytest.importorskip("gguf")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shardwise.hf import CheckpointError, resolve_model  # noqa: E402
from shardwise.layers import ShardError  # noqa: E402

REFUSALS = (CheckpointError, ShardError, NotImplementedError)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A small Q8_0 llama file (its path): 21 metadata entries (a 128-token vocabulary), 12 tensors."""
    root = tmp_path_factory.mktemp("gguf_corrupt")
    hf = save_tiny("llama2", root, overrides={"vocab_size": 128, "num_hidden_layers": 1})
    return write_gguf(hf, root / "good.gguf", "Q8_0")


def _header_end(tmp_path, data: bytes) -> int:
    """Where the first tensor's data starts: the header is everything before."""
    from shardwise.gguf import GGUFFile

    path = tmp_path / "good.gguf"
    path.write_bytes(data)
    return min(t.offset for t in GGUFFile(path).tensors.values())


def _load(path) -> str | None:
    """Open, resolve and read every tensor of `path`: None if it loads, else the refusal (one line)."""
    from shardwise.gguf import GGUFFile

    try:
        resolve_model(path, tp=1)
        f = GGUFFile(path)
        for name in f.tensors:
            f.read_block_range(name)
    except REFUSALS as e:
        msg = str(e)
    except ValueError as e:  # GGUFError (a ValueError) from the reads
        if type(e).__name__ != "GGUFError":
            raise
        msg = str(e)
    else:
        return None
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    for python in ("unpack_from", "codec can't decode", "requires a buffer", "object of type"):
        assert python not in msg, msg
    return msg


def test_named_corruptions_say_what_is_wrong(tmp_path, good):
    """The cases of issue 37 one by one, each refused with what is wrong in its words."""
    good = good.read_bytes()
    kv_count = struct.unpack_from("<Q", good, 16)[0]
    first_key_len = struct.unpack_from("<Q", good, 24)[0]
    key = good[32 : 32 + first_key_len]
    cases = {
        "magic": (b"GGUX" + good[4:], "not a GGUF file"),
        "version": (good[:4] + struct.pack("<I", 7) + good[8:], "GGUF version 7"),
        "header": (good[:30], "truncated"),
        "tensors": (good[:8] + struct.pack("<Q", 2**62) + good[16:], "tensors cannot fit"),
        "entries": (good[:16] + struct.pack("<Q", 7947059781146026753) + good[24:], "metadata entries cannot fit"),
        "key length": (good[:24] + struct.pack("<Q", 2**60) + good[32:], "past the end of the file"),
        "key utf-8": (good[:33] + b"\xbe" + good[34:], "metadata key 0 at byte 24 is not UTF-8 (byte 0xbe at 1)"),
        "cut": (good[: len(good) - 64], "truncated: tensor"),
    }
    assert kv_count > 10 and key == b"general.architecture"
    arch_value = 32 + first_key_len + 4  # its type, then the string "llama"
    cases["value utf-8"] = (
        good[: arch_value + 8] + b"\xbe" + good[arch_value + 9 :],
        "metadata 'general.architecture' at byte",
    )
    failures = []
    for name, (data, want) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(data)
        msg = _load(path)
        if msg is None or want not in msg:
            failures.append(f"{name}: {msg!r} does not say {want!r}")
    assert not failures, "\n".join(failures)


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_corrupt_header_is_refused_in_one_line(tmp_path, good, data):
    """A cut anywhere, or any byte or aligned 64-bit field of the header overwritten: the file
    loads (the change was harmless) or is refused in one line naming it."""
    good = good.read_bytes()
    header = _header_end(tmp_path, good)
    kind = data.draw(st.sampled_from(["cut", "byte", "u64", "u32"]))
    if kind == "cut":
        out = good[: data.draw(st.integers(0, len(good) - 1))]
    else:
        width = {"byte": 1, "u64": 8, "u32": 4}[kind]
        at = data.draw(st.integers(4, header - width))
        value = data.draw(
            st.one_of(
                st.integers(0, 2 ** (8 * width) - 1),
                st.sampled_from([0, 1, 2 ** (8 * width - 1), 2 ** (8 * width) - 1]),
            )
        )
        out = good[:at] + value.to_bytes(width, "little") + good[at + width :]
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(out)
    _load(path)
