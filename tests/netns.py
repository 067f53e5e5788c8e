"""Hosts as Linux network namespaces, for tests of runs across a network.

:class:`Hosts` makes a server host and learner hosts (namespaces named after this process),
joins each learner host to the server host by a veth pair on a bridge, assigns the addresses
(``10.77.0.1`` the server host, ``10.77.0.11`` … the learners), and deletes everything on
exit. A link can be shaped (tc ``tbf``: a rate and a queue; the kernels here have no
``netem``, so no latency, loss or reordering), cut and restored (``ip link set down/up``).
Needs root and iproute2: :func:`unavailable` says why not where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "10.77.0"
SERVER_ADDRESS = f"{PREFIX}.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not all(shutil.which(tool) for tool in ("ip", "tc", "ss")):
        return "iproute2 (ip, tc, ss) is not installed"
    probe = f"rdvprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "exec", probe, "ip", "link", "add", "b0", "type", "bridge")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot make a network namespace with a bridge: {getattr(exc, 'stderr', '') or exc}".strip()
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Hosts:
    """A server host and ``learners`` learner hosts; each learner host's link shaped to
    ``rate`` (tc tbf) in both directions, or not shaped (None)."""

    def __init__(self, learners: int, rate: str | None = "1gbit") -> None:
        tag = f"rdv{os.getpid()}"
        self.server = f"{tag}s"
        self.learners = [f"{tag}l{i}" for i in range(learners)]
        self.rate = rate

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.server)
            self._run(self.server, "ip", "link", "set", "lo", "up")
            self._run(self.server, "ip", "link", "add", "br0", "type", "bridge")
            self._run(self.server, "ip", "addr", "add", f"{SERVER_ADDRESS}/24", "dev", "br0")
            self._run(self.server, "ip", "link", "set", "br0", "up")
            for i, host in enumerate(self.learners):
                _ip("netns", "add", host)
                self._run(host, "ip", "link", "set", "lo", "up")
                _ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    host,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self._port(i),
                    "netns",
                    self.server,
                )
                self._run(self.server, "ip", "link", "set", self._port(i), "master", "br0", "up")
                self._run(host, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self._run(host, "ip", "link", "set", "eth0", "up")
                if self.rate:
                    self.shape(i, self.rate)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in [self.server, *self.learners]:  # a namespace takes its veth ends with it
            subprocess.run(["ip", "netns", "del", host], capture_output=True, timeout=30)

    def address(self, learner: int) -> str:
        return f"{PREFIX}.{11 + learner}"

    def on(self, host: str, *command: str) -> list[str]:
        """``command`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host, *command]

    def shape(self, learner: int, rate: str) -> None:
        """Learner ``learner``'s link at ``rate`` in both directions (tbf, 50 ms of queue)."""
        for host, dev in ((self.learners[learner], "eth0"), (self.server, self._port(learner))):
            self._run(host, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                      "latency", "50ms")  # fmt: skip

    def cut(self, learner: int) -> None:
        """Learner ``learner``'s link goes down (packets either way are lost)."""
        self._run(self.server, "ip", "link", "set", self._port(learner), "down")
        self._run(self.learners[learner], "ip", "link", "set", "eth0", "down")

    def restore(self, learner: int) -> None:
        self._run(self.server, "ip", "link", "set", self._port(learner), "up")
        self._run(self.learners[learner], "ip", "link", "set", "eth0", "up")

    def connections(self, learner: int) -> int:
        """Established TCP connections from learner ``learner``'s host to the server host."""
        out = subprocess.run(self.on(self.learners[learner], "ss", "-Htn", "state", "established", "dst", SERVER_ADDRESS),
                             check=True, capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return len(out.splitlines())

    @staticmethod
    def _port(learner: int) -> str:
        return f"port{learner}"

    def _run(self, host: str, *command: str) -> None:
        subprocess.run(self.on(host, *command), check=True, capture_output=True, text=True, timeout=30)
