"""The Communicator over a real 3-process Gloo group: sums, and failures that surface as CollectiveError.

What the NCCL path adds and a CPU can check is tested here too: the
environment it sets, the work result it reads and the bounded connect; the
NCCL groups themselves are tested in ``tests/gpu``.

The peers are spawned processes that rendezvous on a TCPStore started by the
test and report what happened through a queue. Failures are real signals:
SIGKILL (the peer's sockets close) and SIGSTOP (the peer hangs, its sockets
stay open). The group's timeout is long, so a CollectiveError that arrives
within the test's bound comes from the failure, not from the timeout.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import threading
import time
import uuid
from multiprocessing.context import SpawnProcess
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.coord.client import LighthouseClient
from stalwart.coord.protocol import MAX_STORE_WAIT_S, StoreAddress
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.processes import preloaded_context
from stalwart.runtime.comm import (
    NCCL_ENVIRONMENT,
    CollectiveError,
    Communicator,
    _GaveUp,
    _Rendezvous,
    nccl_environment,
    quorum_store,
    work_failure,
)
from stalwart.testing.loopback import prefix_store
from stalwart.testing.waiting import wait_until

HOST = "127.0.0.1"
WORLD = 3
VICTIM = 2
GROUP_TIMEOUT = 30.0
TEST_BOUND = 120.0  # a bound on a busy machine (spawned peers import torch first), not an expectation
CONTEXT = preloaded_context()  # forked from one interpreter that imported torch once
LATE_RENDEZVOUS = 5.0
"""The "late" scenario's group timeout: its peers rendezvous right after a barrier, well within it."""
LATE_BY = 2 * LATE_RENDEZVOUS
"""How long the late peer sleeps before its collectives: past the group's timeout, within the collectives'."""


def peer(rank: int, port: int, prefix: str, scenario: str, reports: Any, abandon: Any) -> None:
    """One member of the group; reports ``(rank, what, detail)`` tuples."""
    torch.set_num_threads(1)
    store = prefix_store(HOST, port, prefix, GROUP_TIMEOUT)
    rendezvous = GROUP_TIMEOUT
    if scenario == "late":  # every peer at the rendezvous together, so that its short timeout is never the issue
        store.add("arrived", 1)
        wait_until(lambda: store.add("arrived", 0) >= WORLD, TEST_BOUND, "every peer at the barrier")
        rendezvous = LATE_RENDEZVOUS
    comm = Communicator(
        store,
        rank,
        WORLD,
        timeout=GROUP_TIMEOUT,
        device=torch.device("cpu"),
        abandon=abandon.is_set,
        rendezvous_timeout=rendezvous,
    )
    reports.put((rank, "ready", None))
    try:
        if scenario == "late":
            if rank == VICTIM:
                time.sleep(LATE_BY)
            gathered = comm.all_gather(torch.tensor([float(rank)])).tolist()
            exchanged = comm.all_to_all(torch.full((WORLD,), float(rank)), [1] * WORLD, [1] * WORLD).tolist()
            reports.put((rank, "late", (gathered, exchanged)))
        elif scenario == "sum":
            values = torch.tensor([rank + 1.0, 10.0 * rank])
            comm.start_all_reduce_sum(values)()
            received = torch.tensor([float(rank)])
            comm.broadcast([received], source_rank=1)
            # Gloo's all-gather goes through one kept buffer: sizes and dtypes that differ, growing and shrinking.
            gathered = [
                comm.all_gather(torch.full((5,), rank + 0.5)).tolist(),
                comm.all_gather(torch.tensor([rank, -rank], dtype=torch.int64)).tolist(),
                comm.all_gather(torch.arange(3.0) + 10 * rank, out=torch.empty(3 * WORLD)).tolist(),
                comm.all_gather(torch.zeros(0)).tolist(),
            ]
            records = comm.all_gather_bytes(b"r" * rank + bytes([rank]), limit=16)  # lengths differ by rank
            try:
                comm.all_gather_bytes(b"x" * (rank + 1), limit=2)
                over = "no error"
            except CollectiveError as error:
                over = str(error)
            reports.put((rank, "sum", (values.tolist(), received.item(), gathered, records, over)))
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
                # A peer that ends between the check and the signal is already gone.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.join(timeout=TEST_BOUND)


def test_all_reduce_sums_broadcast_copies_and_all_gather_concatenates(store: dist.TCPStore) -> None:
    """Also records of any length gathered as bytes, and one over the limit refused on every rank."""
    group = Group(store.port, "sum")
    try:
        results = group.collect("sum", list(range(WORLD)))
        gathered = [
            [rank + 0.5 for rank in range(WORLD) for _ in range(5)],
            [value for rank in range(WORLD) for value in (rank, -rank)],
            [10.0 * rank + i for rank in range(WORLD) for i in range(3)],
            [],
        ]
        records = [b"r" * rank + bytes([rank]) for rank in range(WORLD)]
        over = f"rank {WORLD - 1} sent a record of {WORLD} bytes, over 2"  # every rank refuses it alike
        assert results == dict.fromkeys(range(WORLD), ([6.0, 30.0], 1.0, gathered, records, over))
    finally:
        group.close()


@pytest.mark.slow
def test_a_slow_peer_has_the_collective_timeout_not_the_rendezvous_timeout(store: dist.TCPStore) -> None:
    """A gather and an all-to-all wait ``timeout`` for a peer, as the all-reduce does (Gloo's own default for them
    is the group's timeout, the rendezvous's: the peers would give up on the late one at 5 s)."""
    group = Group(store.port, "late")
    try:
        results = group.collect("late", list(range(WORLD)))
        ranks = [float(rank) for rank in range(WORLD)]
        assert results == {rank: (ranks, ranks) for rank in range(WORLD)}
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
    lonely = prefix_store(HOST, store.port, f"lonely-{uuid.uuid4().hex}/", 1.0)
    with pytest.raises(CollectiveError, match="rendezvous of rank 0/2"):
        Communicator(lonely, 0, 2, timeout=1.0, device=torch.device("cpu"))


def test_an_unreachable_quorum_store_fails_the_rendezvous() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    store = quorum_store(StoreAddress(f"http://{HOST}:{port}", 1, "k"), 1.0, token=None)
    with pytest.raises(CollectiveError, match="cannot reach"):
        Communicator(store, 0, 2, timeout=1.0, device=torch.device("cpu"))
    with pytest.raises(CollectiveError, match="cannot use"):
        quorum_store(StoreAddress("tcp://nowhere", 1, "k"), 1.0, token=None)


def test_a_bounded_store_wait_ends_with_the_key_and_says_false_when_it_never_came() -> None:
    """``present_within`` (a process waiting for the leader's on_leader work): one wait held on the lighthouse,
    True once another thread sets the key meanwhile (a mere look would say False), False at its end without it."""
    with Lighthouse(EpochPlan(64, 8), min_replicas=1) as server:
        client = LighthouseClient(server.url, "a", heartbeat_interval=0.05)
        try:
            client.start_heartbeat(lambda: 0)
            answer = client.quorum(0, None, "join", TEST_BOUND)
            store = quorum_store(answer.store, 5.0, token=None)
            assert not store.present_within(["leader/1"], 0.01)
            setter = threading.Timer(0.2, store.set, ("leader/1", "done"))
            setter.start()
            try:
                assert store.present_within(["leader/1"], MAX_STORE_WAIT_S), "set while the wait was held"
            finally:
                setter.join()
            assert not store.present_within(["leader/1", "leader/2"], 0.01), "every key must be there"
        finally:
            client.close()


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


@pytest.mark.parametrize(
    ("environ", "changes"),
    [
        ({}, NCCL_ENVIRONMENT),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, NCCL_ENVIRONMENT),  # torchrun's TearDown
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": " 3 "}, NCCL_ENVIRONMENT),  # torch's default, SkipCleanUp
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, NCCL_ENVIRONMENT),  # the older name torch still reads
        ({"TORCH_NCCL_DUMP_ON_TIMEOUT": ""}, NCCL_ENVIRONMENT),  # blank is unset
        (
            {
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_BLOCKING_WAIT": "1",
            },
            {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
        ),
        (
            {"NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100"},
            {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        ),
    ],
)
def test_nccl_environment_sets_what_is_unset_and_only_overrides_modes_that_end_the_process(
    environ: dict[str, str], changes: dict[str, str]
) -> None:
    assert nccl_environment(environ) == changes
    assert NCCL_ENVIRONMENT["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the communicators, raise


class _Work:
    def __init__(self, result: int | None) -> None:
        self.result: torch.futures.Future[int] = torch.futures.Future()
        if result is not None:
            self.result.set_result(result)

    def get_future_result(self) -> torch.futures.Future[int]:
        return self.result


def test_work_failure_reads_the_result_the_watchdog_recorded() -> None:
    assert work_failure(_Work(None)) is None  # the watchdog has not looked at it yet: the work itself decides
    assert work_failure(_Work(0)) is None
    assert work_failure(_Work(1)) == "TIMEOUT"
    assert work_failure(_Work(2)) == "COMM_ERROR"


class _Group:
    """Stands for an NCCL group whose eager connect blocks until released, or fails."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.released = threading.Event()
        self.aborted = False

    def eager_connect_single_device(self, device: torch.device) -> None:
        if self.error is not None:
            raise self.error
        self.released.wait(30)

    def abort(self) -> None:
        self.aborted = True
        self.released.set()


def _rendezvous(group: _Group, seconds: float, abandon: Any = lambda: False) -> Any:
    """The group connected the NCCL way (created, then its eager connect) by the helper thread."""
    connect = _Rendezvous(lambda: group, lambda made: made.eager_connect_single_device(torch.device("cuda", 0)))
    return connect.result(time.monotonic() + seconds, abandon)


def test_a_connect_that_does_not_finish_is_given_up_at_the_deadline_and_the_group_aborted() -> None:
    group = _Group()
    start = time.monotonic()
    with pytest.raises(_GaveUp, match="its deadline passed"):
        _rendezvous(group, 0.3)
    assert 0.3 <= time.monotonic() - start < 5 and group.aborted


def test_a_connect_is_given_up_when_the_quorum_breaks_and_its_error_is_raised() -> None:
    group = _Group()
    with pytest.raises(_GaveUp, match="a member of this quorum is dead"):
        _rendezvous(group, 30, lambda: True)
    assert group.aborted
    with pytest.raises(RuntimeError, match="store timed out"):
        _rendezvous(_Group(RuntimeError("store timed out")), 30)
    released = _Group()
    released.released.set()
    assert _rendezvous(released, 30) is released
    assert not released.aborted


def test_a_group_whose_creation_outlives_its_deadline_is_aborted_by_the_helper_thread_when_it_comes() -> None:
    """Gloo's constructor cannot be interrupted: the caller leaves at its deadline, and the group the constructor
    returns later is aborted there, never handed to anyone."""
    late = _Group()
    created = threading.Event()

    def create() -> _Group:
        created.wait(30)
        return late

    connect = _Rendezvous(create, lambda _: None)
    with pytest.raises(_GaveUp):
        connect.result(time.monotonic() + 0.2, lambda: False)
    created.set()
    wait_until(lambda: late.aborted, 30, "the late group aborted by the helper thread")


def test_a_key_a_dead_peer_never_wrote_is_a_failed_collective(store: dist.TCPStore) -> None:
    """A heal's or reshard's metadata from a peer that died first: CollectiveError (the quorum is asked again)."""
    alone = prefix_store(HOST, store.port, f"alone-{uuid.uuid4().hex}/", 1.0)
    comm = Communicator(alone, 0, 1, timeout=1.0, device=torch.device("cpu"))
    comm.publish("written", "yes")
    assert comm.read("written") == b"yes"
    with pytest.raises(CollectiveError, match="got no 'heal/1' from the quorum's store"):
        comm.read("heal/1")
    comm.abort()
