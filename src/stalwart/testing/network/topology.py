"""The pure half of the network-fault harness: names, addresses and the ``ip``/``tc`` command lines of each fault.

Nothing here runs a command; :mod:`stalwart.testing.network.netns` does. A
:class:`Topology` is one private network: a *hub* namespace holding a Linux
bridge, and one namespace per node joined to it by a veth pair whose node end
is ``eth0`` with the address ``10.S.0.(2 + i)/24``. Every interface lives
inside a namespace the harness made, so two test processes never collide on an
interface name and nothing is added to the machine's own namespace (no route
can lead to its ``eth0`` or the outside).

Namespace names are ``stw<pid>n<counter>-<node>``: the owner's process id
makes a leftover of a dead test recognisable (:func:`stale_namespaces`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PREFIX = "stw"
"""Every namespace the harness makes starts with this (then the owner's pid)."""
NODE_DEVICE = "eth0"
"""A node's end of its veth pair, inside its namespace."""
BRIDGE_DEVICE = "br0"
"""The bridge, inside the hub namespace."""
HUB = "hub"
"""The hub namespace's node name (it holds the bridge and every veth's other end)."""
DROP_PREFERENCE = 10
"""``ip rule`` preference of a silent drop: before the ``local`` table's lookup, moved to :data:`LOCAL_PREFERENCE`
(the kernel's own rule at preference 0 would match a packet for this node before any drop rule)."""
LOCAL_PREFERENCE = 100
MAX_NODES = 250
_NODE_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")
_RATE = re.compile(r"[1-9][0-9]*(bit|kbit|mbit|gbit)")
_OWNED = re.compile(rf"{PREFIX}(\d+)n\d+-[a-z0-9]+")


@dataclass(frozen=True)
class Topology:
    """One private network: ``nodes`` (short lowercase names) on a bridge in the subnet ``10.SUBNET.0.0/24``.

    ``tag`` makes the namespace names unique to their owner (see :func:`owner_tag`).
    """

    tag: str
    subnet: int
    nodes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not re.fullmatch(rf"{PREFIX}\d+n\d+", self.tag):
            raise ValueError(f"tag must look like {PREFIX}<pid>n<counter> (see owner_tag), got {self.tag!r}")
        if isinstance(self.subnet, bool) or not isinstance(self.subnet, int) or not 0 <= self.subnet <= 255:
            raise ValueError(
                f"subnet must be an integer in [0, 255] (the second octet of 10.x.0.0/24), got {self.subnet!r}"
            )
        if not 1 <= len(self.nodes) <= MAX_NODES:
            raise ValueError(f"nodes must name 1 to {MAX_NODES} nodes, got {len(self.nodes)}")
        for node in self.nodes:
            if not isinstance(node, str) or not _NODE_NAME.fullmatch(node) or node == HUB:
                raise ValueError(
                    f"node names must be 1-12 lowercase letters and digits starting with a letter, not {HUB!r}; "
                    f"got {node!r}"
                )
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"node names must be distinct, got {list(self.nodes)}")

    def namespace(self, node: str) -> str:
        """The network namespace of ``node`` (or of the hub, :data:`HUB`)."""
        if node != HUB:
            self._index(node)
        return f"{self.tag}-{node}"

    def address(self, node: str) -> str:
        """``node``'s address on the bridge: ``10.SUBNET.0.(2 + its index)``."""
        return f"10.{self.subnet}.0.{2 + self._index(node)}"

    def hub_device(self, node: str) -> str:
        """The hub's end of ``node``'s veth pair (``v<index>``, well under 15 characters)."""
        return f"v{self._index(node)}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this topology, the hub's first."""
        return [self.namespace(HUB), *(self.namespace(node) for node in self.nodes)]

    def _index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise ValueError(f"node must be one of {list(self.nodes)}, got {node!r}") from None


def owner_tag(pid: int, counter: int) -> str:
    """The namespace-name tag of the ``counter``-th network of process ``pid``: unique among live processes."""
    for name, value in (("pid", pid), ("counter", counter)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return f"{PREFIX}{pid}n{counter}"


def subnet_for(pid: int, counter: int) -> int:
    """A second octet for the ``counter``-th network of ``pid`` in [16, 255]: distinct for neighbouring counters.

    The networks are isolated by their namespaces anyway; distinct subnets only
    keep the logs of two runs apart.
    """
    return 16 + (pid * 7 + counter) % 240


def owner_pid(namespace: str) -> int | None:
    """The pid of the process that made ``namespace`` with this harness (None: not one of the harness's)."""
    match = _OWNED.fullmatch(namespace)
    return None if match is None else int(match[1])


def stale_namespaces(names: Iterable[str], is_alive: Callable[[int], bool]) -> list[str]:
    """The namespaces among ``names`` that this harness made for a process that ``is_alive`` says has ended."""
    stale = []
    for name in names:
        owner = owner_pid(name)
        if owner is not None and not is_alive(owner):
            stale.append(name)
    return stale


def check_rate(rate: str) -> str:
    """``rate`` if it is a ``tc`` rate such as ``128kbit``; ``ValueError`` otherwise."""
    if not isinstance(rate, str) or not _RATE.fullmatch(rate):
        raise ValueError(
            f"rate must be a tc rate such as '128kbit' (a number and bit, kbit, mbit or gbit), got {rate!r}"
        )
    return rate


def setup_commands(topology: Topology) -> list[list[str]]:
    """The ``ip`` commands that build ``topology`` (namespaces, bridge, veth pairs, addresses, rule order)."""
    hub = topology.namespace(HUB)
    commands = [["ip", "netns", "add", name] for name in topology.namespaces]
    commands += [
        ["ip", "-n", hub, "link", "add", BRIDGE_DEVICE, "type", "bridge"],
        ["ip", "-n", hub, "link", "set", BRIDGE_DEVICE, "up"],
    ]
    for node in topology.nodes:
        namespace, veth = topology.namespace(node), topology.hub_device(node)
        commands += [
            ["ip", "-n", hub, "link", "add", veth, "type", "veth", "peer", "name", NODE_DEVICE, "netns", namespace],
            ["ip", "-n", hub, "link", "set", veth, "master", BRIDGE_DEVICE, "up"],
            ["ip", "-n", namespace, "link", "set", "lo", "up"],
            ["ip", "-n", namespace, "addr", "add", f"{topology.address(node)}/24", "dev", NODE_DEVICE],
            ["ip", "-n", namespace, "link", "set", NODE_DEVICE, "up"],
            ["ip", "-n", namespace, "rule", "add", "pref", str(LOCAL_PREFERENCE), "lookup", "local"],
            ["ip", "-n", namespace, "rule", "del", "pref", "0"],
        ]
    return commands


def link_command(topology: Topology, node: str, up: bool) -> list[str]:
    """Set ``node``'s ``eth0`` down or up (a dead NIC: the node reaches nobody, nobody reaches it)."""
    return ["ip", "-n", topology.namespace(node), "link", "set", NODE_DEVICE, "up" if up else "down"]


def blackhole_command(topology: Topology, node: str, peer: str, add: bool) -> list[str]:
    """Add (or delete) a blackhole route to ``peer`` in ``node``'s namespace only: an asymmetric cut.

    ``node``'s own sends to ``peer`` fail at once (``EINVAL``); ``peer``'s
    packets still arrive, but what ``node`` answers is dropped, so ``peer`` sees silence.
    """
    action = "add" if add else "del"
    return ["ip", "-n", topology.namespace(node), "route", action, "blackhole", f"{topology.address(peer)}/32"]


def drop_command(topology: Topology, node: str, peer: str, add: bool) -> list[str]:
    """Add (or delete) a rule in ``node``'s namespace that silently drops every packet arriving from ``peer``.

    Both directions of a silent partition take one each: nobody's send fails,
    nothing arrives.
    """
    action = "add" if add else "del"
    return [
        "ip", "-n", topology.namespace(node), "rule", action, "pref", str(DROP_PREFERENCE),
        "from", topology.address(peer), "iif", NODE_DEVICE, "blackhole",
    ]  # fmt: skip


def rate_commands(topology: Topology, node: str, rate: str | None) -> list[list[str]]:
    """Limit both directions of ``node``'s link to ``rate`` with a token bucket (``tbf``), or lift it (None).

    The node's ``eth0`` shapes what it sends, the hub's end of its veth what it receives.
    """
    ends = [(topology.namespace(node), NODE_DEVICE), (topology.namespace(HUB), topology.hub_device(node))]
    if rate is None:
        return [["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"] for namespace, device in ends]
    check_rate(rate)
    return [
        ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
         "burst", "16kbit", "latency", "400ms"]
        for namespace, device in ends
    ]  # fmt: skip
