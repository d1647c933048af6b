"""Failing together: every rank learns whether any rank failed a local step, and why.

    result = agree(world, lambda: check_files(...))

runs the function on every rank, then one all-reduce of an error flag per rank tells
all of them whether anyone failed. If so, the lowest failing rank broadcasts its error
message and every rank raises the same exception type with that message, so no rank is
left waiting in a later collective and every rank's log names the real cause (the file,
the key). Exceptions other than `catch` propagate at once (a bug, not bad input).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from shardwise.comm.communicator import Communicator

__all__ = ["agree", "AgreedError"]

T = TypeVar("T")
_MSG_BYTES = 4096


class AgreedError(RuntimeError):
    """Raised on every rank when another rank's local step failed with a non-standard type."""


def agree(
    comm: Communicator,
    fn: Callable[[], T],
    *,
    catch: tuple[type[BaseException], ...] = (Exception,),
    what: str = "",
) -> T:
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except catch as e:
        error = e
    if comm.size == 1:
        if error is not None:
            raise error
        return result
    flags = torch.zeros(comm.size, dtype=torch.int32)
    flags[comm.rank] = int(error is not None)
    flags = comm.all_reduce(flags)
    failed = [r for r in range(comm.size) if flags[r]]
    if not failed:
        return result
    src = failed[0]
    msg = torch.zeros(_MSG_BYTES + 1, dtype=torch.uint8)
    if comm.rank == src:
        text = f"{type(error).__name__}\n{error}".encode()[:_MSG_BYTES]
        msg[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    text = bytes(comm.broadcast(msg, src=src).tolist()).rstrip(b"\0").decode(errors="replace")
    kind, _, message = text.partition("\n")
    if error is not None and comm.rank == src:
        raise error
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    exc_type = next((t for t in catch if t.__name__ == kind and t is not Exception), None)
    if exc_type is None and error is not None and type(error).__name__ == kind:
        exc_type = type(error)
    message = f"{message} [raised on rank {src}{others}{f', {what}' if what else ''}]"
    if exc_type is not None:
        raise exc_type(message)
    raise AgreedError(f"{kind}: {message}")
