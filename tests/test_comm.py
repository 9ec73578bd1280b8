"""The Communicator over a real 3-process Gloo group: sums, and failures that surface as CollectiveError.

The peers are spawned processes that rendezvous on a TCPStore started by the
test and report what happened through a queue. Failures are real signals:
SIGKILL (the peer's sockets close) and SIGSTOP (the peer hangs, its sockets
stay open). The group's timeout is long, so a CollectiveError that arrives
within the test's bound comes from the failure, not from the timeout.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.runtime.comm import CollectiveError, Communicator, quorum_store

HOST = "127.0.0.1"
WORLD = 3
VICTIM = 2
GROUP_TIMEOUT = 30.0
TEST_BOUND = 20.0
CONTEXT = multiprocessing.get_context("spawn")


def peer(rank: int, port: int, prefix: str, scenario: str, reports: Any, abandon: Any) -> None:
    """One member of the group; reports ``(rank, what, detail)`` tuples."""
    torch.set_num_threads(1)
    store = quorum_store(HOST, port, prefix, GROUP_TIMEOUT)
    comm = Communicator(store, rank, WORLD, timeout=GROUP_TIMEOUT, device=torch.device("cpu"), abandon=abandon.is_set)
    reports.put((rank, "ready", None))
    try:
        if scenario == "sum":
            values = torch.tensor([rank + 1.0, 10.0 * rank])
            comm.start_all_reduce_sum(values)()
            received = torch.tensor([float(rank)])
            comm.broadcast([received], source_rank=1)
            reports.put((rank, "sum", (values.tolist(), received.item())))
        elif rank == VICTIM:
            time.sleep(2 * GROUP_TIMEOUT)
        else:
            wait = comm.start_all_reduce_sum(torch.ones(1 << 16))
            reports.put((rank, "started", None))
            try:
                wait()
                reports.put((rank, "completed", None))
            except CollectiveError as error:
                reports.put((rank, "CollectiveError", str(error)))
    finally:
        comm.abort()


class Group:
    """The spawned peers of one test, with bounded waits on their reports."""

    def __init__(self, port: int, scenario: str) -> None:
        self.reports: Any = CONTEXT.Queue()
        self.abandon = CONTEXT.Event()
        prefix = f"{scenario}-{uuid.uuid4().hex}/"
        self.peers: list[SpawnProcess] = [
            CONTEXT.Process(target=peer, args=(rank, port, prefix, scenario, self.reports, self.abandon))
            for rank in range(WORLD)
        ]
        self.deadline = time.monotonic() + TEST_BOUND
        for process in self.peers:
            process.start()

    def collect(self, what: str, ranks: list[int]) -> dict[int, Any]:
        """Details of the ``what`` reports of ``ranks``, waiting until the test's bound at most."""
        found: dict[int, Any] = {}
        while set(found) != set(ranks):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what!r} report from ranks {sorted(set(ranks) - set(found))} in time")
            try:
                rank, kind, detail = self.reports.get(timeout=remaining)
            except queue.Empty:
                continue
            if kind == what:
                found[rank] = detail
            elif kind != "ready":
                raise AssertionError(f"rank {rank} reported {kind!r} ({detail}) while {what!r} was expected")
        return found

    def close(self) -> None:
        """Wake stopped peers and end every peer still running."""
        for process in self.peers:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.join(timeout=TEST_BOUND)


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    yield dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def test_all_reduce_sums_and_broadcast_copies(store: dist.TCPStore) -> None:
    group = Group(store.port, "sum")
    try:
        results = group.collect("sum", list(range(WORLD)))
        assert results == dict.fromkeys(range(WORLD), ([6.0, 30.0], 1.0))
    finally:
        group.close()


def test_a_peer_killed_mid_collective_makes_the_survivors_raise(store: dist.TCPStore) -> None:
    group = Group(store.port, "kill")
    try:
        group.collect("started", [0, 1])
        os.kill(group.peers[VICTIM].pid or 0, signal.SIGKILL)
        errors = group.collect("CollectiveError", [0, 1])
        assert all("all-reduce" in message for message in errors.values())
    finally:
        group.close()


def test_abandon_ends_a_collective_blocked_on_a_stopped_peer(store: dist.TCPStore) -> None:
    group = Group(store.port, "stop")
    try:
        group.collect("started", [0, 1])
        os.kill(group.peers[VICTIM].pid or 0, signal.SIGSTOP)
        group.abandon.set()
        errors = group.collect("CollectiveError", [0, 1])
        assert all("abandoned" in message for message in errors.values())
    finally:
        group.close()


def test_a_rendezvous_whose_peers_never_come_raises(store: dist.TCPStore) -> None:
    lonely = quorum_store(HOST, store.port, f"lonely-{uuid.uuid4().hex}/", 1.0)
    with pytest.raises(CollectiveError, match="rendezvous of rank 0/2"):
        Communicator(lonely, 0, 2, timeout=1.0, device=torch.device("cpu"))


def test_an_unreachable_store_raises() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    with pytest.raises(CollectiveError, match="cannot reach"):
        quorum_store(HOST, port, "nobody/", 1.0)


def test_default_device_is_the_cpu_without_cuda_whatever_local_rank_says() -> None:
    from stalwart.runtime.comm import default_device

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: see the test below")
    assert default_device({"LOCAL_RANK": "1"}) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_device_is_the_gpu_of_local_rank() -> None:
    from stalwart.runtime.comm import default_device

    assert default_device({"LOCAL_RANK": "0"}) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        default_device({"LOCAL_RANK": str(torch.cuda.device_count())})
