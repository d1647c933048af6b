"""The compiled kernels (shardwise.kernels._native), and which of their ISA variants runs.

The module is built by the package's own build (setup.py); every ISA variant is in the one
binary. At import the highest level this CPU runs is chosen (portable < avx2 < avx512,
see csrc/sw.h); `use_isa` forces a lower one (tests run every path the machine can). Where
the extension did not build, `lib` is None and shardwise says so once, in one line, when a
block-format weight is first built: the PyTorch fallback (shardwise.kernels.block) then
computes the same arithmetic, much more slowly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardwise.log import get_logger

__all__ = ["lib", "ISAS", "isa", "isa_name", "use_isa", "available", "describe", "note_fallback"]

try:
    import shardwise.kernels._native as lib
except ImportError as e:  # not built (no compiler at install, or an unsupported platform)
    lib = None
    _WHY = str(e)
else:
    _WHY = ""

ISAS: tuple[str, ...] = tuple(lib.isas()) if lib is not None else ()
"""The ISA levels this CPU runs, lowest first ("portable", "avx2", "avx512")."""

_current = len(ISAS) - 1
_noted = False


def available() -> bool:
    return lib is not None


def isa() -> int:
    """The ISA level calls use now (an index into lib.ISA_NAMES)."""
    return _current


def isa_name() -> str:
    return ISAS[_current] if ISAS else "pytorch"


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels' `name` variant inside the block (tests force each path)."""
    global _current
    if name not in ISAS:
        raise ValueError(f"ISA {name!r} is not available here; this CPU runs: {', '.join(ISAS) or 'none (not built)'}")
    before, _current = _current, ISAS.index(name)
    try:
        yield
    finally:
        _current = before


def describe() -> str:
    """One line for logs and `info`: which kernels run block-format weights here."""
    if lib is None:
        return f"block-format kernels: PyTorch fallback (native extension not built: {_WHY})"
    return f"block-format kernels: native {isa_name()} (this CPU runs {', '.join(ISAS)})"


def note_fallback() -> None:
    """Say once, in one line, that block-format weights run on the PyTorch fallback."""
    global _noted
    if lib is None and not _noted:
        _noted = True
        get_logger().warning(
            "shardwise: native kernels are not built (%s); block-format weights run on the PyTorch fallback, "
            "several times slower (reinstall with a C compiler: pip install -e .)",
            _WHY,
        )
