"""A peer blackholed from the others: the rendezvous ends at its deadline and the probe finds who is cut off.

Each rank and the store run in a network namespace of their own on a bridge
(in a namespace of its own too); rank 2's routes to ranks 0 and 1 are
blackholed (``ip route add blackhole``), so it reaches the store and nothing
else: its connects fail at once (EINVAL) while ranks 0 and 1 wait as the
passive side of their pairs with it. Gloo's own connect held them five
rendezvous timeouts (25 s at 5 s); the Communicator gives up at one. Root
and ``ip`` are needed (CI runs as root); every namespace and process is
removed afterwards, and the addresses exist only inside the namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

RENDEZVOUS_TIMEOUT = 5.0
BOUND = 120.0
"""A liveness bound for the processes (interpreters importing torch on a busy machine), not an expectation."""
SUBNET = "10.213.7"
STORE_PORT = 29611
PEER = Path(__file__).with_name("reach_peer.py")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2"
)


def ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[dict[str, str]]:
    """``{"store": ns, "0": ns, "1": ns, "2": ns}`` on one bridge, addresses SUBNET.1-4; all deleted after."""
    tag = f"sr{os.getpid() % 100000}"
    switch = f"{tag}sw"
    names = {role: f"{tag}{role[0]}" for role in ("store", "0", "1", "2")}
    made: list[str] = []
    try:
        for name in [switch, *names.values()]:
            ip("netns", "add", name)
            made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for host, name in enumerate(names.values(), start=1):
            inside, outside = f"{name}a", f"{name}b"
            ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            ip("link", "set", inside, "netns", name)
            ip("link", "set", outside, "netns", switch)
            ip("-n", switch, "link", "set", outside, "master", "br0")
            ip("-n", switch, "link", "set", outside, "up")
            ip("-n", name, "addr", "add", f"{SUBNET}.{host}/24", "dev", inside)
            ip("-n", name, "link", "set", inside, "up")
        yield names
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def in_namespace(name: str, *command: str) -> subprocess.Popen[str]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command_line = ["ip", "netns", "exec", name, *command]
    return subprocess.Popen(command_line, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=environ)


@pytest.mark.slow
def test_a_peer_blackholed_from_the_others_ends_the_rendezvous_at_its_deadline_and_is_found_cut_off(
    namespaces: dict[str, str],
) -> None:
    ip("-n", namespaces["2"], "route", "add", "blackhole", f"{SUBNET}.2/32")  # rank 0
    ip("-n", namespaces["2"], "route", "add", "blackhole", f"{SUBNET}.3/32")  # rank 1
    store_host = f"{SUBNET}.1"
    serve = (
        "import datetime, time, torch.distributed as dist; "
        f"s = dist.TCPStore('{store_host}', {STORE_PORT}, is_master=True, timeout=datetime.timedelta(seconds=60)); "
        f"time.sleep({BOUND})"
    )
    processes = [in_namespace(namespaces["store"], sys.executable, "-c", serve)]
    try:
        for rank in range(3):
            arguments = [str(rank), "3", f"{SUBNET}.{rank + 2}", store_host, str(STORE_PORT), str(RENDEZVOUS_TIMEOUT)]
            processes.append(in_namespace(namespaces[str(rank)], sys.executable, str(PEER), *arguments))
        reports = {}
        for process in processes[1:]:
            out, _ = process.communicate(timeout=BOUND)
            report = json.loads(out.strip().splitlines()[-1])
            reports[report["rank"]] = report
    finally:
        for process in processes:
            process.kill()
            process.wait(30)
    assert not any(report["connected"] for report in reports.values())
    for rank in (0, 1):  # waited on rank 2 and gave up at the deadline, well before Gloo's five timeouts
        assert reports[rank]["failure"] == "timeout", reports[rank]
        assert reports[rank]["seconds"] < 3 * RENDEZVOUS_TIMEOUT, reports[rank]
        assert "every rank came, not every peer connected" in reports[rank]["error"]
        assert reports[rank]["probes"]["2"] == "cut off"
    assert reports[0]["probes"]["1"] == "reachable"
    assert reports[2]["probes"] == {"0": "cut off", "1": "cut off"}  # its routes to them are blackholed
