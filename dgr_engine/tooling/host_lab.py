"""Hosts on one machine, to test what happens between hosts (``docs/reliability.md``, "Between
hosts").

A :class:`HostLab` makes one network namespace per host, each with one veth into a bridge in a
hub namespace of its own, and one veth from the caller's namespace into that bridge (the
client's side). Every address is in 198.18.0.0/15, the range set aside for benchmarks (RFC
2544): never a private or a public network. A fault is made with iptables in the host's own
namespace, on its one interface:

* :meth:`~HostLab.silence`: every packet in and out is dropped: no reset, no FIN, no ICMP,
  what a host that lost power, or a link that drops everything, looks like from outside;
* :meth:`~HostLab.lose`: each packet in and out is dropped at random with a given probability;
* :meth:`~HostLab.refuse_port`: connections to one port are refused (a reset);
* :meth:`~HostLab.delay`: every packet a host sends waits (netem, where the kernel has it);
* :meth:`~HostLab.heal`: the host's faults are lifted.

:meth:`~HostLab.close` removes everything the lab made (deleting a namespace deletes its veths),
each step bounded in time; the names carry the lab's own id, so two labs never meet. It needs
root, iproute2's ``ip`` and ``iptables``: :func:`unavailable` says why a machine cannot, or
``None``. A worker runs on a host by running its command under :meth:`~HostLab.runner` and
listening on :meth:`~HostLab.address`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType

import attrs

from dgr_session.errors import DgrError

__all__ = ["HostLab", "HostLabError", "unavailable"]

BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
"""RFC 2544's range for benchmarks: the lab takes one /24 of it."""
COMMAND_SECONDS = 15.0
"""The longest any one ``ip`` or ``iptables`` command may take."""
_FAULT_RULES = ("DGR_LAB_IN", "DGR_LAB_OUT")
_labs = itertools.count()


class HostLabError(DgrError, RuntimeError):
    """A command that makes, faults or removes the lab failed: which, and what it said."""


def unavailable() -> str | None:
    """Why this machine cannot make a lab (not root, no ``ip``, no ``iptables``), or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for program in ("ip", "iptables"):
        if shutil.which(program) is None:
            return f"no `{program}` on PATH (Debian's iproute2 and iptables)"
    return None


def _run(args: Sequence[str]) -> None:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        raise HostLabError(f"`{' '.join(args)}` took over {COMMAND_SECONDS} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise HostLabError(f"`{' '.join(args)}` failed: {said[-1] if said else done.returncode}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of the benchmark range that no interface of this namespace is on."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10
    ).stdout
    taken = [
        ipaddress.ip_interface(word).network
        for line in shown.splitlines()
        for word in line.split()
        if "/" in word and word[0].isdigit()
    ]
    subnets = [ipaddress.IPv4Network(s) for s in BENCHMARK_RANGE.subnets(new_prefix=24)]
    start = os.getpid() % len(subnets)
    for k in range(len(subnets)):
        subnet = subnets[(start + k) % len(subnets)]
        if not any(subnet.overlaps(network) for network in taken):
            return subnet
    raise HostLabError("every /24 of 198.18.0.0/15 is in use here")


@attrs.define(eq=False)
class HostLab:
    """``n_hosts`` hosts on one bridge with the caller (see the module's text). Use as a
    context manager, or call :meth:`close` in a ``finally``."""

    n_hosts: int
    lab_id: str = attrs.field(factory=lambda: f"{os.getpid() % 100000:x}{next(_labs):x}")
    subnet: ipaddress.IPv4Network = attrs.field(factory=_free_subnet)
    _made: list[str] = attrs.field(factory=list, init=False)

    @property
    def hub(self) -> str:
        return f"dgr{self.lab_id}hub"

    @property
    def client_address(self) -> str:
        """This namespace's address in the lab (the client's side)."""
        return str(self.subnet.network_address + 1)

    def namespace(self, host: int) -> str:
        """Host ``host``'s network namespace."""
        self._check(host)
        return f"dgr{self.lab_id}h{host}"

    def address(self, host: int) -> str:
        """Host ``host``'s address: what a worker there listens on."""
        self._check(host)
        return str(self.subnet.network_address + 10 + host)

    def runner(self, host: int) -> tuple[str, ...]:
        """The command prefix that runs a program on host ``host``."""
        return ("ip", "netns", "exec", self.namespace(host))

    def __enter__(self) -> HostLab:
        self.make()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def make(self) -> None:
        """Makes the hub, the client's veth and every host; on a failure, removes what it
        made and raises :class:`HostLabError`."""
        why = unavailable()
        if why is not None:
            raise HostLabError(f"no host lab here: {why}")
        if not 1 <= self.n_hosts <= 200:
            raise ValueError(f"a lab has 1 to 200 hosts, not {self.n_hosts}")
        prefix = self.subnet.prefixlen
        client = f"dgr{self.lab_id}c"
        try:
            self._namespace(self.hub)
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
            self._ip("link", "add", client, "type", "veth", "peer", "name", "c", "netns", self.hub)
            self._made.append(f"link:{client}")
            self._ip("-n", self.hub, "link", "set", "c", "master", "br0", "up")
            self._ip("addr", "add", f"{self.client_address}/{prefix}", "dev", client)
            self._ip("link", "set", client, "up")
            for host in range(self.n_hosts):
                ns, port = self.namespace(host), f"p{host}"
                self._namespace(ns)
                self._ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name",
                         "eth0", "netns", ns)  # fmt: skip
                self._ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
                self._ip("-n", ns, "addr", "add", f"{self.address(host)}/{prefix}", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                for chain, hook, side in zip(
                    _FAULT_RULES, ("INPUT", "OUTPUT"), ("-i", "-o"), strict=True
                ):
                    self._iptables(host, "-N", chain)
                    self._iptables(host, "-A", hook, side, "eth0", "-j", chain)
        except BaseException:
            self.close()
            raise

    def silence(self, host: int) -> None:
        """Drops every packet host ``host`` sends or receives, without a word."""
        for chain in _FAULT_RULES:
            self._iptables(host, "-A", chain, "-j", "DROP")

    def lose(self, host: int, probability: float) -> None:
        """Drops each packet host ``host`` sends or receives with ``probability``."""
        if not 0.0 < probability < 1.0:
            raise ValueError(f"a loss probability is in (0, 1), not {probability}")
        for chain in _FAULT_RULES:
            self._iptables(host, "-A", chain, "-m", "statistic", "--mode", "random",
                           "--probability", f"{probability:.6f}", "-j", "DROP")  # fmt: skip

    def delay(self, host: int, milliseconds: float) -> None:
        """Delays every packet host ``host`` sends by ``milliseconds`` (netem);
        :class:`HostLabError` where the kernel has no netem."""
        _run([*self.runner(host), "tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
              "delay", f"{milliseconds}ms"])  # fmt: skip

    def undelay(self, host: int) -> None:
        """Lifts :meth:`delay` (nothing to lift: nothing done)."""
        with contextlib.suppress(HostLabError):
            _run([*self.runner(host), "tc", "qdisc", "del", "dev", "eth0", "root"])

    def refuse_port(self, host: int, port: int) -> None:
        """Refuses every connection to ``port`` of host ``host`` (a reset, as a closed port
        answers); the rest of the host is untouched."""
        self._iptables(host, "-A", _FAULT_RULES[0], "-p", "tcp", "--dport", str(port),
                       "-j", "REJECT", "--reject-with", "tcp-reset")  # fmt: skip

    def heal(self, host: int) -> None:
        """Lifts every fault of host ``host``."""
        for chain in _FAULT_RULES:
            self._iptables(host, "-F", chain)

    def close(self) -> None:
        """Removes every namespace and interface the lab made (a namespace's veths go with
        it). Idempotent; the first failure is raised after every removal was tried."""
        failed: HostLabError | None = None
        while self._made:
            made = self._made.pop()
            kind, _, name = made.rpartition(":")
            try:  # a veth goes at once (deleting its namespace would take it later)
                _run(
                    ["ip", "link", "del", name] if kind == "link" else ["ip", "netns", "del", made]
                )
            except HostLabError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)

    def _ip(self, *args: str) -> None:
        _run(["ip", *args])

    def _iptables(self, host: int, *args: str) -> None:
        _run([*self.runner(host), "iptables", "-w", "5", *args])

    def _check(self, host: int) -> None:
        if not 0 <= host < self.n_hosts:
            raise IndexError(f"the lab has hosts 0 to {self.n_hosts - 1}, not {host}")
