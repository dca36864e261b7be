"""Hosts made of Linux network namespaces, for tests that cross a real network interface.

`hosts()` builds two hosts joined by a veth pair (a cable), each with its own loopback,
routing table and ports, the cable's ends addressed on a private /30 inside the hosts
only (nothing is added to this machine's own namespace). `service=True` adds a third host
on a second network: a bridge (a switch) in that host with one veth to each of the two, a
/29 between the three. Processes started through `Host.argv()` see only their host's
interfaces; the filesystem is this machine's, which stands in for a shared (parallel)
filesystem. Names are unique per run, and teardown kills every process left in each host
and deletes it, also after a failure. Where namespaces cannot be made (not root, no `ip`,
no permission), `skip_reason()` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

CABLE = "10.231.0.{}/30"  # host A .1, host B .2
SERVICE_NET = "10.231.1.{}/29"  # service host .1 (the bridge), host A .2, host B .3


@dataclasses.dataclass
class Host:
    name: str  # the namespace
    addr: str  # its address on the cable (or on the service network, for the service host)
    ifname: str  # the interface that address is on
    service_addr: str | None = None  # its address on the service network, where there is one

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def pids(self) -> list[int]:
        p = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False
        )
        return [int(x) for x in p.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this host, as its power failing would; returns them."""
        killed = []
        for _ in range(20):  # a process forking while it is killed: until none is left
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += pids
            time.sleep(0.05)
        return killed


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if p.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"ckprobe{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except OSError as e:
        return f"cannot make a network namespace: {e}"
    with contextlib.suppress(OSError):
        _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def hosts(*, service: bool = False) -> Iterator[list[Host]]:
    """[A, B] joined by a veth pair; with service=True, [A, B, S] (S on a bridge to both)."""
    tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
    names = [f"ck{tag}{x}" for x in ("a", "b", "s")[: 3 if service else 2]]
    made: list[str] = []
    try:
        for n in names:
            _ip("netns", "add", n)
            made.append(n)
            _ip("-n", n, "link", "set", "lo", "up")
        a, b = names[0], names[1]
        # Created straight inside the namespaces: both ends are called veth0, each in its host.
        _ip("-n", a, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", b)
        out = [Host(a, CABLE.format(1).split("/")[0], "veth0")]
        out.append(Host(b, CABLE.format(2).split("/")[0], "veth0"))
        for i, h in enumerate(out):
            _ip("-n", h.name, "addr", "add", CABLE.format(i + 1), "dev", "veth0")
            _ip("-n", h.name, "link", "set", "veth0", "up")
        if service:
            s = names[2]
            _ip("-n", s, "link", "add", "br0", "type", "bridge")
            _ip("-n", s, "addr", "add", SERVICE_NET.format(1), "dev", "br0")
            _ip("-n", s, "link", "set", "br0", "up")
            for i, h in enumerate(out):
                port = f"port{i}"
                _ip(
                    "-n",
                    s,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "svc0",
                    "netns",
                    h.name,
                )
                _ip("-n", s, "link", "set", port, "master", "br0")
                _ip("-n", s, "link", "set", port, "up")
                _ip("-n", h.name, "addr", "add", SERVICE_NET.format(i + 2), "dev", "svc0")
                _ip("-n", h.name, "link", "set", "svc0", "up")
                h.service_addr = SERVICE_NET.format(i + 2).split("/")[0]
            addr = SERVICE_NET.format(1).split("/")[0]
            out.append(Host(s, addr, "br0", service_addr=addr))
        yield out
    finally:
        for n in reversed(made):
            Host(n, "", "").kill_all()
            with contextlib.suppress(OSError):
                _ip("netns", "del", n)
