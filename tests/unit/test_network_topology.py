"""The network-fault harness's pure half: names, addresses, command lines and the stale-namespace sweep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.testing.network.topology import (
    BRIDGE_DEVICE,
    HUB,
    NODE_DEVICE,
    Topology,
    blackhole_command,
    check_rate,
    drop_command,
    owner_tag,
    rate_commands,
    setup_commands,
    stale_namespaces,
    subnet_for,
)

node_names = st.lists(st.from_regex(r"[a-z][a-z0-9]{0,11}", fullmatch=True), min_size=1, max_size=12, unique=True)
owners = st.tuples(st.integers(0, 4_194_304), st.integers(0, 10_000))


@given(owners, node_names)
def test_every_node_gets_its_own_namespace_and_an_address_in_the_subnet(
    owner: tuple[int, int], nodes: list[str]
) -> None:
    pid, counter = owner
    topology = Topology(owner_tag(pid, counter), subnet_for(pid, counter), tuple(nodes))
    addresses = [topology.address(node) for node in nodes]
    assert len(set(addresses)) == len(nodes)
    assert all(address.startswith(f"10.{topology.subnet}.0.") for address in addresses)
    assert all(2 <= int(address.rsplit(".", 1)[1]) <= 254 for address in addresses)
    assert len(set(topology.namespaces)) == len(nodes) + 1
    assert all(name.startswith(f"{topology.tag}-") for name in topology.namespaces)


@given(owners, node_names)
def test_interface_names_fit_the_kernel_limit_and_every_command_stays_in_the_topology_namespaces(
    owner: tuple[int, int], nodes: list[str]
) -> None:
    topology = Topology(owner_tag(*owner), subnet_for(*owner), tuple(nodes))
    assert all(len(name) <= 15 for name in [NODE_DEVICE, BRIDGE_DEVICE, *map(topology.hub_device, nodes)])
    for command in setup_commands(topology):
        namespace = command[3] if command[:2] == ["ip", "netns"] else command[2]
        assert command[1] in ("netns", "-n") and namespace in topology.namespaces  # never the machine's own


@given(st.integers(0, 50), st.sets(st.integers(0, 50), max_size=10))
def test_only_namespaces_of_dead_owners_are_stale(pid: int, alive: set[int]) -> None:
    names = [f"{owner_tag(pid, 3)}-w0", f"{owner_tag(pid, 3)}-{HUB}", "stw-other", "netns1", "stw12x-w0"]
    stale = stale_namespaces(names, lambda candidate: candidate in alive)
    assert stale == ([] if pid in alive else names[:2])


def test_faults_are_spelled_on_the_side_they_cut() -> None:
    topology = Topology(owner_tag(7, 0), subnet_for(7, 0), ("lh", "w0", "w1"))
    assert blackhole_command(topology, "w1", "w0", True) == [
        "ip", "-n", "stw7n0-w1", "route", "add", "blackhole", f"{topology.address('w0')}/32",
    ]  # fmt: skip
    rule = drop_command(topology, "w0", "w1", False)
    assert rule[:5] == ["ip", "-n", "stw7n0-w0", "rule", "del"] and rule[-1] == "blackhole"
    assert rule[rule.index("from") + 1] == topology.address("w1")
    limits = rate_commands(topology, "w1", "128kbit")
    assert {(command[2], command[6]) for command in limits} == {("stw7n0-w1", "eth0"), ("stw7n0-hub", "v2")}
    assert all(command[command.index("rate") + 1] == "128kbit" for command in limits)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Topology("mine", 1, ("w0",)), "tag must look like"),
        (lambda: Topology(owner_tag(1, 0), 256, ("w0",)), "subnet must be an integer in [0, 255]"),
        (lambda: Topology(owner_tag(1, 0), 1, ("W0",)), "got 'W0'"),
        (lambda: Topology(owner_tag(1, 0), 1, ("w0", "w0")), "must be distinct"),
        (lambda: Topology(owner_tag(1, 0), 1, (HUB,)), "not 'hub'"),
        (lambda: Topology(owner_tag(1, 0), 1, ("w0",)).address("w9"), "node must be one of ['w0'], got 'w9'"),
        (lambda: owner_tag(-1, 0), "pid must be an integer >= 0, got -1"),
        (lambda: check_rate("fast"), "rate must be a tc rate such as '128kbit'"),
    ],
)
def test_bad_arguments_are_named(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        make()  # type: ignore[operator]
