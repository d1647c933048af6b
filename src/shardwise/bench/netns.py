"""Hosts on this machine: network namespaces joined through a switch by links shaped to a rate.

    with make_hosts(2, rate="100mbit") as cluster:    # needs root and iproute2
        h0, h1 = cluster.hosts
        h0.name, h0.addr                              # 'host0', '10.201.0.1'
        p = h1.popen([sys.executable, "-c", "..."])   # a process on host 1
        cluster.tx_bytes()                            # {'host0': ..., 'host1': ...}: sent on each link
        cluster.cut(1)                                # host 1's link down; cluster.restore(1)
        probe(h0, h1)                                 # bits/s from host 0 to host 1, measured

Each host is a network namespace with its own loopback and one link, `eth0`, a veth pair
whose other end is a port of a bridge in a switch namespace (a star). Both directions of
every link are shaped with tc's token bucket (tbf) to `rate`; ranks on one host talk over
its loopback, unshaped. A process on a host also gets a hostname of its own (a UTS
namespace: `host0`, ...), and every host's /etc/hosts names all of them (ip netns exec
mounts /etc/netns/NS/hosts over /etc/hosts), so launchers address hosts by name as on a
real cluster.

Addresses (10.201.0.0/24) exist only on the veths made here, inside these namespaces:
nothing is routed to or from the machine's own network. close() (the context manager's
exit, and atexit) kills every process still in the namespaces and deletes them; make_hosts
first deletes the namespaces of this prefix whose creating process is gone (a run that was
killed). NOTE: stdlib only, so that this file also runs by itself, without shardwise:
`python netns.py up --hosts 2 --rate 1gbit` (see main()).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = [
    "Cluster",
    "Host",
    "make_hosts",
    "host_cores",
    "probe",
    "unavailable",
    "cleanup_stale",
    "rate_bits",
    "bucket_bytes",
    "PREFIX",
]

PREFIX = "swns"
"""Namespace names: PREFIX + creating pid + 'c' + cluster number + 'h' + host (or 's', the switch)."""
SUBNET = "10.201.0"
MAX_HOSTS = 4
_counter = itertools.count()
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")


def rate_bits(rate: str) -> float:
    """tc's rate words in bits per second: '100mbit' -> 1e8."""
    m = _RATE.match(rate.lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit (e.g. 100mbit, 1gbit, 10gbit)")
    return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def unavailable() -> str | None:
    """Why hosts cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"network namespaces need `{tool}` (iproute2, util-linux), not found"
    name = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its name and address on the cluster's network."""

    index: int
    name: str
    """Its hostname, resolvable on every host."""
    addr: str
    netns: str
    iface: str = "eth0"
    """Its link, inside its namespace (GLOO_SOCKET_IFNAME, hydra's -iface)."""
    cores: tuple[int, ...] = ()
    """The CPU cores its processes may run on (taskset; make_hosts(pin=True)); (): any."""
    started: list[subprocess.Popen] = field(default_factory=list, compare=False, repr=False)
    """What popen started here: close() kills these too, since one still entering the
    namespace is not yet among `ip netns pids` (seen on a busy machine: a sleeper outlived it)."""

    def command(self, argv: list[str]) -> list[str]:
        """argv run on this host: in its namespace, with its hostname (on its cores, if pinned)."""
        script = 'hostname "$0" && exec "$@"'
        pin = ["taskset", "-c", ",".join(map(str, self.cores))] if self.cores else []
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c", script, self.name, *pin, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        p = subprocess.Popen(self.command(argv), **kwargs)
        self.started.append(p)
        return p

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        """Every process in this host's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


@dataclass
class Cluster:
    """Hosts joined by a star of links of one rate (None: unshaped)."""

    hosts: list[Host]
    rate: str | None
    switch: str
    """The switch's namespace: a bridge, and port p<i> for host i's link."""
    rsh: str = ""
    """An ssh stand-in, `rsh HOST COMMAND...`: runs COMMAND on HOST (hydra's -launcher-exec)."""
    _closed: bool = field(default=False, repr=False)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_rate(self, rate: str | None) -> None:
        """Shape every link, both ways, to `rate` (tbf); None removes the shaping."""
        for h in self.hosts:
            for ns, dev in ((h.netns, h.iface), (self.switch, f"p{h.index}")):
                _shape(ns, dev, rate)
        self.rate = rate

    def tx_bytes(self) -> dict[str, int]:
        """Bytes each host has sent on its link (its eth0's counter, frames included)."""
        return {h.name: _stats(h.netns, h.iface)["tx"]["bytes"] for h in self.hosts}

    def rx_bytes(self) -> dict[str, int]:
        return {h.name: _stats(h.netns, h.iface)["rx"]["bytes"] for h in self.hosts}

    def cut(self, index: int) -> None:
        """Take host `index`'s link down (its end, as `ip link set eth0 down` on the host)."""
        h = self.hosts[index]
        _ip("-n", h.netns, "link", "set", h.iface, "down")

    def restore(self, index: int) -> None:
        h = self.hosts[index]
        _ip("-n", h.netns, "link", "set", h.iface, "up")
        _shape(h.netns, h.iface, self.rate)  # NOTE: the qdisc survives a down/up; set again all the same

    def env(self) -> dict[str, str]:
        """Environment a job on these hosts needs: gloo on each host's link, and MPICH's UCX
        over TCP only. NOTE: UCX would otherwise pass messages between hosts through shared
        memory (they are one machine), and no byte would cross the link."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}

    def mpiexec_args(self, ppn: int) -> list[str]:
        """mpiexec (MPICH hydra) options that start `ppn` ranks on each host, ranks numbered
        host by host: hydra reaches each host through `rsh`, as it would over ssh. Run
        mpiexec itself on host 0 (host0.popen), so that its proxies find it by name."""
        hosts = ",".join(h.name for h in self.hosts)
        n = ppn * len(self.hosts)
        return ["-launcher", "ssh", "-launcher-exec", self.rsh, "-hosts", hosts, "-ppn", str(ppn), "-n", str(n)]

    def torchrun(
        self, torchrun: str, per_host: int, argv: list[str], *, port: int = 29400, **popen
    ) -> list[subprocess.Popen]:
        """`torchrun --nnodes N --nproc-per-node per_host ... argv` on every host, one agent
        each, meeting at a c10d rendezvous on host 0 (`argv`: what follows torchrun's
        options, e.g. ['-m', 'shardwise', 'generate']); popen's keywords for every agent,
        with this cluster's env() added to popen['env'] (default os.environ)."""
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].name}:{port}", "--rdzv-id", "netns"]
        cmd = [torchrun, "--nnodes", str(len(self.hosts)), "--nproc-per-node", str(per_host), *rdzv, *argv]
        popen["env"] = {**popen.get("env", os.environ), **self.env()}
        return [h.popen(cmd, **popen) for h in self.hosts]

    def mpiexec(self, mpiexec: str, ppn: int, argv: list[str], **popen) -> subprocess.Popen:
        """`mpiexec <mpiexec_args(ppn)> argv` started on host 0; popen's keywords, env as torchrun's."""
        popen["env"] = {**popen.get("env", os.environ), **self.env()}
        return self.hosts[0].popen([mpiexec, *self.mpiexec_args(ppn), *argv], **popen)

    def close(self) -> None:
        """Kill every process left on the hosts, delete the namespaces and their /etc/netns files."""
        if self._closed:
            return
        self._closed = True
        for p in (p for h in self.hosts for p in h.started if p.poll() is None):
            with contextlib.suppress(ProcessLookupError):
                p.kill()  # ip netns exec execs into the command: the same pid from start to end
        _delete([h.netns for h in self.hosts] + [self.switch])
        if self.rsh:
            shutil.rmtree(os.path.dirname(self.rsh), ignore_errors=True)


def host_cores(n: int, cores: list[int]) -> list[tuple[int, ...]]:
    """This machine's `cores` dealt out to n hosts, an equal run of them each (one each at
    least, round the cores when there are fewer cores than hosts): [(0,), (1,)] for 2 hosts of a
    2-core machine, [(0, 1)] for one."""
    cores = sorted(cores)
    k = max(1, len(cores) // n)
    return [tuple(cores[(i * k + j) % len(cores)] for j in range(k)) for i in range(n)]


def make_hosts(n: int, rate: str | None = "1gbit", *, prefix: str = PREFIX, pin: bool = False) -> Cluster:
    """n hosts (2 to MAX_HOSTS), each linked to one switch at `rate` ('100mbit', '1gbit',
    '10gbit'; None: unshaped). Use it as a context manager: it deletes everything on exit.

    pin: each host's processes on cores of its own (host_cores, taskset), as separate machines'
    are. NOTE: unpinned, gloo across the link ran in a fast or a slow regime fixed per launch
    (tp=2 decode across an unshaped veth, 5 launches each, interleaved, 2026-12-05: unpinned
    10.6-19.5 ms a token, pinned 21.4-27.4): the scheduler may put both hosts' ranks on one core,
    which separate hosts never share; pinned, each launch is the same case."""
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"hosts: {n}; between 1 and {MAX_HOSTS}")
    if rate is not None:
        rate_bits(rate)  # a bad rate is refused before anything is made
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"cannot make hosts: {why}")
    cleanup_stale(prefix)
    base = f"{prefix}{os.getpid()}c{next(_counter)}"
    cores = host_cores(n, sorted(os.sched_getaffinity(0))) if pin else [()] * n
    hosts = [Host(i, f"host{i}", f"{SUBNET}.{i + 1}", f"{base}h{i}", cores=cores[i]) for i in range(n)]
    cluster = Cluster(hosts, None, f"{base}s")
    atexit.register(cluster.close)
    try:
        _ip("netns", "add", cluster.switch)
        _ip("-n", cluster.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", cluster.switch, "link", "set", "br0", "up")
        etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in hosts)
        for h in hosts:
            _ip("netns", "add", h.netns)
            os.makedirs(f"/etc/netns/{h.netns}", exist_ok=True)
            with open(f"/etc/netns/{h.netns}/hosts", "w") as f:
                f.write(etc_hosts)
            port = f"p{h.index}"
            _ip(
                "link",
                "add",
                "name",
                h.iface,
                "netns",
                h.netns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                cluster.switch,
            )
            _ip("-n", cluster.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.iface)
            _ip("-n", h.netns, "link", "set", h.iface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        cluster.rsh = _write_rsh(hosts)
        cluster.set_rate(rate)
    except BaseException:
        cluster.close()
        raise
    return cluster


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces named `prefix<pid>...` whose pid is gone (a run killed before its
    clean-up); the names deleted."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{re.escape(prefix)}(\d+)c\d+[hs]\d*$", name)
        if m and not _alive(int(m.group(1))):
            stale.append(name)
    _delete(stale)
    return stale


def probe(src: Host, dst: Host, seconds: float = 2.0, *, port: int = 5201) -> float:
    """Bits per second that one TCP stream from src to dst carries (an iperf-like check of
    the shaping): dst counts what it receives after the first byte."""
    me = os.path.abspath(__file__)
    sink = dst.popen([sys.executable, me, "_sink", dst.addr, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(100):  # until it listens
            if dst.run(["sh", "-c", f"grep -qi ':{port:04X} ' /proc/net/tcp"], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        src.run([sys.executable, me, "_source", dst.addr, str(port), str(seconds)], check=True, timeout=seconds + 30)
        out, _ = sink.communicate(timeout=30)
    finally:
        sink.kill()
        sink.wait()
    return float(out.split()[0])


# ---- iproute2 -------------------------------------------------------------------------------
def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def bucket_bytes(rate: str) -> int:
    """The token bucket of a link shaped to `rate`: 1 ms at the rate, at least two full frames.
    NOTE: a larger one lets a decode step's small messages pass at memory speed, a smaller one
    cannot reach the rate."""
    return max(3200, int(rate_bits(rate) / 8 / 1000))


def _shape(netns: str, dev: str, rate: str | None) -> None:
    subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate is None:
        return
    burst = bucket_bytes(rate)
    cmd = ["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
    done = subprocess.run([*cmd, "burst", str(burst), "latency", "400ms"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc qdisc add dev {dev} (netns {netns}) tbf rate {rate}: {done.stderr.strip()}")


def _write_rsh(hosts: list[Host]) -> str:
    """A script that does what `ssh HOST CMD...` would: ssh's options skipped, CMD joined
    by spaces and run by a shell on HOST."""
    cases = "".join(f"  {h.name}) ns={h.netns} ;;\n" for h in hosts)
    script = f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}  *) echo "rsh: no host $host here" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""
    path = os.path.join(tempfile.mkdtemp(prefix="shardwise-netns-"), "rsh")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    return path


def _stats(netns: str, dev: str) -> dict:
    out = subprocess.run(["ip", "-j", "-s", "-n", netns, "link", "show", "dev", dev], capture_output=True, text=True)
    return json.loads(out.stdout)[0]["stats64"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(names: list[str]) -> None:
    for name in names:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        for pid in map(int, out.split()):  # processes on a host of ours: started on it by its user
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            if not subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                break
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


# ---- the probe's two ends, and a command line -------------------------------------------------
def _sink(addr: str, port: int) -> None:
    srv = socket.create_server((addr, port), reuse_port=False)
    conn, _ = srv.accept()
    n, t0 = 0, None
    while chunk := conn.recv(1 << 20):
        if t0 is None:
            t0 = time.perf_counter()
        else:
            n += len(chunk)
    print(n * 8 / max(time.perf_counter() - (t0 or 0), 1e-9), flush=True)


def _source(addr: str, port: int, seconds: float) -> None:
    conn = socket.create_connection((addr, port), timeout=30)
    buf, end = b"\0" * (1 << 20), time.monotonic() + seconds
    while time.monotonic() < end:
        conn.sendall(buf)
    conn.close()


def main(argv: list[str] | None = None) -> int:
    """`up`: make hosts, print them, measure the link, and keep them until Ctrl-C; `clean`:
    delete stale namespaces of this prefix."""
    p = argparse.ArgumentParser(prog="netns.py", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help="tc rate of every link, or 'none'")
    sub.add_parser("clean")
    sink = sub.add_parser("_sink")
    sink.add_argument("addr")
    sink.add_argument("port", type=int)
    source = sub.add_parser("_source")
    source.add_argument("addr")
    source.add_argument("port", type=int)
    source.add_argument("seconds", type=float)
    a = p.parse_args(argv)
    if a.cmd == "_sink":
        _sink(a.addr, a.port)
    elif a.cmd == "_source":
        _source(a.addr, a.port, a.seconds)
    elif a.cmd == "clean":
        print("deleted:", " ".join(cleanup_stale()) or "nothing")
    else:
        with make_hosts(a.hosts, None if a.rate == "none" else a.rate) as cluster:
            for h in cluster.hosts:
                print(
                    f"{h.name} {h.addr}: ip netns exec {h.netns} ...  (its link {h.iface}, {cluster.rate or 'unshaped'})"
                )
            if len(cluster.hosts) > 1:
                print(f"measured host0 -> host1: {probe(cluster.hosts[0], cluster.hosts[1]) / 1e6:.1f} Mbit/s")
            print("Ctrl-C deletes them", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
