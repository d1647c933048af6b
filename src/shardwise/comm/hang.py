"""Which rank a hang waits for: read the progress board (shardwise.comm.progress) and name it.

    hang = diagnose(records, now=time.time(), origin=rank)   # None: nobody is stuck
    hang.ranks      # (3,): the ranks the others waited for
    hang.summary    # "stuck: never arrived at all_reduce/tp #41 (rank 2 waited 20.0 s for it); ..."

Each waiting rank's record says which operation it is in (a channel and a sequence number)
and with whom. A peer whose count on that channel is lower never arrived; a peer that did
arrive but is stopped (/proc state T, on this host) or sends no heartbeat never finished its
part. Following these "waits for" edges from the rank that timed out leads to the ranks
that are not waiting for anyone: stuck outside communication (a sleep, a deadlock in Python,
a slow disk), stopped, frozen, finished or gone. If the edges only lead around a cycle, the
ranks wait for each other: a deadlock (they issued different operations).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Hang", "Wait", "Culprit", "diagnose", "proc_state", "STALE_S"]

STALE_S = 3.0
"""A record whose heartbeat is older than this belongs to a frozen or stopped process."""


def proc_state(pid: int) -> str | None:
    """The state letter of a process on this host (R, S, D, T = stopped, t = traced, Z), None if gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


@dataclass(frozen=True)
class Wait:
    """A rank waiting in an operation."""

    rank: int
    op: str
    group: str
    seq: int
    waited_s: float

    @property
    def where(self) -> str:
        return f"{self.op}/{self.group} #{self.seq}"


@dataclass(frozen=True)
class Culprit:
    """A rank the others waited for, and what it was doing."""

    rank: int
    kind: str
    """stopped, frozen, outside (running, outside communication), done, gone or unknown."""
    missed: tuple[tuple[Wait, bool], ...]
    """The waits of the ranks that waited for it directly; True where it had arrived."""
    state: str
    """How it is: "stopped (process 4242, state T; no heartbeat for 21.3 s)"."""

    def describe(self) -> str:
        waits: dict[tuple[str, bool], list[Wait]] = {}
        for w, entered in self.missed:
            waits.setdefault((w.where, entered), []).append(w)
        missed, parts = [], []
        for (where, entered), ws in waits.items():
            for_it = f"{_ranks(w.rank for w in ws)} waited {max(w.waited_s for w in ws):.1f} s for it"
            if entered:
                parts.append(f"entered {where} but never finished it ({for_it})")
            else:
                missed.append(f"{where} ({for_it})")
        if missed:
            parts.insert(0, f"never arrived at {' nor at '.join(missed)}")
        return "; ".join(parts + [self.state])


@dataclass(frozen=True)
class Hang:
    """The ranks a hang waits for (culprits), or a cycle of ranks waiting for each other."""

    culprits: tuple[Culprit, ...] = ()
    behind: tuple[Wait, ...] = ()
    """Ranks that waited for the culprits' waiters (behind them in a chain)."""
    cycle: tuple[tuple[Wait, int], ...] = ()
    """A deadlock: each rank waits in its operation for the next."""
    cut_off: tuple[Wait, tuple[int, ...], str, str] | None = None
    """Every member arrived and is alive, on more than one host: (the waiting rank's wait,
    the ranks on other hosts, the waiting rank's host, theirs): the link between them."""
    behind_cut: tuple[Wait, ...] = ()
    """With cut_off: members on the far side still inside an earlier operation of the same
    group, one the waiting rank finished (its last messages to them never arrived)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        if self.cut_off is not None:
            return self.cut_off[1]
        return tuple(c.rank for c in self.culprits) or tuple(sorted(w.rank for w, _ in self.cycle))

    @property
    def summary(self) -> str:
        """One line without the rank as subject: "stuck: never arrived at ...", for "rank 3 failed: ..."."""
        if self.cut_off is not None:
            w, far, here, there = self.cut_off
            link = (
                f"but its messages do not get through between {here} and {there} in {w.waited_s:.1f} s: "
                f"the link between the hosts is down or unreachable"
            )
            if self.behind_cut:
                still = "; ".join(f"rank {b.rank} still inside {b.where} ({b.waited_s:.1f} s)" for b in self.behind_cut)
                return (
                    f"cut off: {_ranks(far)} on {there} and rank {w.rank} on {here} are alive (fresh heartbeats); "
                    f"rank {w.rank} finished what {still} waits for and waits in {w.where}, {link}"
                )
            return (
                f"cut off: {_ranks(far)} on {there} and rank {w.rank} on {here} all entered {w.where} and are alive "
                f"(fresh heartbeats), {link}"
            )
        if self.cycle:
            (w, peer), *rest = self.cycle
            chain = [f"rank {w.rank} waits in {w.where} for rank {peer}"]
            chain += [f"which waits in {w.where} for rank {peer}" for w, peer in rest]
            return f"deadlock: {', '.join(chain)} (they issued different operations)"
        first, *others = self.culprits
        text = f"{_KIND_WORD[first.kind]}: {first.describe()}"
        for c in others:
            text += f"; rank {c.rank} is {_KIND_WORD[c.kind]} too: {c.describe()}"
        if self.behind:
            where = ", ".join(sorted({w.where for w in self.behind}))
            text += f"; {_ranks(w.rank for w in self.behind)} waited in turn ({where})"
        return text

    def sentence(self) -> str:
        """One line with the rank as subject: "rank 3 is stuck: never arrived at ..."."""
        if self.cycle:
            return self.summary
        if self.cut_off is not None:
            return f"{_ranks(self.cut_off[1])} {'is' if len(self.cut_off[1]) == 1 else 'are'} {self.summary}"
        return f"rank {self.culprits[0].rank} is {self.summary}"


_KIND_WORD = {
    "stopped": "stuck",
    "frozen": "stuck",
    "outside": "stuck",
    "unknown": "stuck",
    "done": "finished early",
    "gone": "gone",
}


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def diagnose(
    records: dict[int, dict[str, Any]],
    *,
    now: float,
    origin: int | None = None,
    host: str | None = None,
    state_of: Callable[[int], str | None] = proc_state,
) -> Hang | None:
    """The ranks the waiting ranks waited for (those `origin` waited for first); None if every
    rank they wait for is itself waiting and responsive. `state_of(pid)` gives the state of a
    process on this host (`host`, default this one): proc_state, or a fake in tests."""
    host = socket.gethostname() if host is None else host
    health = {r: _health(rec, now, host, state_of) for r, rec in records.items()}
    waits = {r: _wait_of(rec, now) for r, rec in records.items()}
    waits = {r: w for r, w in waits.items() if w is not None}
    edges = {r: _blockers(records, r, health) for r in waits}

    def blocked(r: int) -> list[tuple[int, bool]]:
        # a waiting rank that is itself stopped or frozen waits for nobody: it is the culprit
        return [] if health.get(r, ("",))[0] in ("stopped", "frozen") else edges.get(r, [])

    def reachable(starts: list[int]) -> list[int]:
        seen: dict[int, None] = {}
        stack = list(reversed(starts))
        while stack:
            r = stack.pop()
            if r not in seen:
                seen[r] = None
                stack.extend(m for m, _ in reversed(blocked(r)))
        return list(seen)

    order = reachable(sorted(waits))
    mine = set(reachable([origin])) if origin in waits else set(order)
    culprits = []
    for r in (r for r in order if not (r in waits and blocked(r))):
        kind, state = health.get(r, ("unknown", _no_record(r, origin)))
        rec = records.get(r, {})
        if (rec.get("op") or rec.get("pending")) and kind not in ("stopped", "frozen", "gone"):
            continue  # waits in an operation every peer has reached: not what holds the others
        if kind == "ok":
            kind, state = "outside", _outside(records[r], now)
        elif kind in ("stopped", "frozen"):
            state = f"{state}; its last heartbeat found it {_position(records[r], None)}"
        missed = tuple((waits[w], entered) for w in sorted(waits) for m, entered in blocked(w) if m == r)
        if missed:
            culprits.append(Culprit(r, kind, missed, state))
    if culprits:
        direct = {w.rank for c in culprits for w, _ in c.missed}
        behind = tuple(waits[r] for r in sorted(waits) if r not in direct and blocked(r))
        return Hang(tuple(sorted(culprits, key=lambda c: (c.rank not in mine, c.rank))), behind)
    cycle = _find_cycle([origin] if origin in waits else sorted(waits), blocked)
    if cycle:
        return Hang(cycle=tuple((waits[r], nxt) for r, nxt in cycle))
    return _cut_off(records, waits, health, origin)


def _cut_off(records, waits: dict[int, Wait], health, origin: int | None) -> Hang | None:
    """Hang(cut_off=...) when `origin` waits in an operation every member entered, every one
    responsive, and the members run on more than one host (_RANK_HOSTS): their link carries nothing."""
    if origin not in waits or not _RANK_HOSTS:
        return None
    entry = _waiting_in(records[origin])
    members = [entry["peer"]] if entry.get("peer") is not None else list(entry["members"])
    if any(m >= len(_RANK_HOSTS) or m not in records for m in members):
        return None
    here = _RANK_HOSTS[origin]
    late = [m for m in members if records[m]["counts"].get(entry["chan"], 0) < entry["seq"]]
    # a member that has not arrived may still be inside an earlier operation (of this group or
    # another it shares with `origin`) that `origin` finished: an all-reduce can complete on one
    # side and not the other when the link goes down between its last messages. On another
    # host, alive, it is cut off too.
    behind = [m for m in late if m in waits and _passed(records[origin], _waiting_in(records[m]))]
    arrived = all(m in behind and _RANK_HOSTS[m] != here for m in late)
    alive = all(health[m][0] == "ok" for m in members)
    far = tuple(sorted(m for m in members if _RANK_HOSTS[m] != here))
    if not (arrived and alive and far):
        return None
    there = ", ".join(dict.fromkeys(_RANK_HOSTS[m] for m in far))
    return Hang(cut_off=(waits[origin], far, here, there), behind_cut=tuple(waits[m] for m in behind))


def _passed(rec: dict[str, Any], entry: dict[str, Any]) -> bool:
    """Whether the rank of `rec` has entered the operation `entry` (of another rank) and left it."""
    mine = rec.get("op") or {}
    count = rec["counts"].get(entry["chan"], 0)
    return count > entry["seq"] or (count == entry["seq"] and mine.get("chan") != entry["chan"])


_NO_RECORD = "it published no progress record (it never started, or it runs on another host: see SHARDWISE_BOARD)"
_RANK_HOSTS: tuple[str, ...] = ()
"""Every rank's host label, by rank, once the launcher gathered them (several hosts only)."""


def set_rank_hosts(labels: tuple[str, ...]) -> None:
    """Record which host each rank runs on (shardwise.launch.run, after its rendezvous), so a
    rank whose progress board this host cannot read is still named with its host."""
    global _RANK_HOSTS
    _RANK_HOSTS = tuple(labels)


def _no_record(rank: int, origin: int | None) -> str:
    if rank < len(_RANK_HOSTS) and (
        origin is None or origin >= len(_RANK_HOSTS) or _RANK_HOSTS[origin] != _RANK_HOSTS[rank]
    ):
        return (
            f"it runs on host {_RANK_HOSTS[rank]}, whose progress records this host cannot read "
            f"(a host down or cut off, or its rank never started)"
        )
    return _NO_RECORD


def _health(rec: dict[str, Any], now: float, host: str, state_of) -> tuple[str, str]:
    """(kind, words): ok, stopped, frozen, gone or done."""
    age = now - rec["beat"]
    pid = rec["pid"]
    if rec.get("state") == "done":
        return "done", "its job function had returned (the ranks issued different operations)"
    letter = state_of(pid) if rec.get("host") == host else "?"
    if letter is None:
        return "gone", f"its process {pid} is gone"
    if letter in ("T", "t"):
        how = "stopped" if letter == "T" else "stopped by a debugger"
        return "stopped", f"{how} (process {pid}, state {letter}; no heartbeat for {age:.1f} s)"
    if age > STALE_S:
        where = f"process {pid}, state {letter}" if letter != "?" else f"process {pid} on {rec.get('host')}"
        return "frozen", f"not responding ({where}; no heartbeat for {age:.1f} s)"
    return "ok", ""


def _waiting_in(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The operation a rank waits in: the one it is in; else its oldest asynchronous one in
    flight (DDP's bucket all-reduces, which backward's end waits for); else under NCCL, whose
    operations return once queued, the last one it queued."""
    if rec.get("state") == "done":
        return None
    pending = rec.get("pending") or [None]
    return rec.get("op") or pending[0] or (rec.get("last") if rec.get("backend") == "nccl" else None)


def _wait_of(rec: dict[str, Any], now: float) -> Wait | None:
    entry = _waiting_in(rec)
    if entry is None:
        return None
    return Wait(rec["rank"], entry["op"], entry["group"], entry["seq"], now - entry["start"])


def _blockers(records: dict[int, dict[str, Any]], rank: int, health) -> list[tuple[int, bool]]:
    """The peers `rank` waits for: (peer, whether it arrived)."""
    entry = _waiting_in(records[rank])
    peers = [entry["peer"]] if entry.get("peer") is not None else [m for m in entry["members"] if m != rank]
    out = []
    for m in peers:
        peer = records.get(m)
        if peer is None or peer["counts"].get(entry["chan"], 0) < entry["seq"]:
            out.append((m, False))
        elif health[m][0] in ("stopped", "frozen", "gone"):
            out.append((m, True))
    return out


def _outside(rec: dict[str, Any], now: float) -> str:
    return f"running {_position(rec, now)} (heartbeat {max(now - rec['beat'], 0.0):.1f} s ago)"


def _position(rec: dict[str, Any], now: float | None) -> str:
    """Where a record says its rank is; how long for, as of `now` (None: no durations, for
    the last record of a stopped rank, up to a heartbeat older than its stop)."""
    e = rec.get("op") or rec.get("last")
    since = rec.get("idle_since") if e is None else e["start"] if rec.get("op") else e["end"]
    took = f" for {now - since:.1f} s" if now is not None else ""
    if rec.get("op"):
        return f"inside {e['op']}/{e['group']} #{e['seq']}{took}"
    if e is not None:
        after = "since" if now is not None else "after"
        return f"outside communication{took}, {after} {e['op']}/{e['group']} #{e['seq']}"
    return f"outside communication{took}, before its first operation"


def _find_cycle(starts: list[int], blocked) -> list[tuple[int, int]]:
    """[(rank, the rank it waits for), ...] around a cycle reachable from `starts`, or []."""
    for start in starts:
        path, seen, r = [], {}, start
        while r not in seen:
            nxt = [m for m, _ in blocked(r)]
            if not nxt:
                break
            seen[r] = len(path)
            path.append((r, nxt[0]))
            r = nxt[0]
        else:
            return path[seen[r] :]
    return []
