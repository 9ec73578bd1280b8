"""NCCL on real GPUs: failures raise instead of ending the process, and the digits job recovers on NCCL.

Skipped without CUDA. NCCL cannot put two ranks of one communicator on the
same GPU, so a test with several ranks needs one GPU per rank and is skipped
(with the count) on a machine with fewer; a single GPU runs the one-rank
tests: a group's collectives, a rendezvous whose peer never comes, and a
one-worker job. Every process takes the GPU of its index: a worker sees only
that GPU (``CUDA_VISIBLE_DEVICES``), since a worker that is a member on its
own is a world of one, where ``LOCAL_RANK`` can only be 0
(:class:`~stalwart.data.world.WorldInfo`).

Communicator-level tests run their ranks in spawned processes that report
through a queue, so a rank that NCCL ends shows up as a missing report, not
as a dead test process. Job-level tests run the digits job on a
:class:`~stalwart.launch.cluster.LocalCluster` against an embedded lighthouse
and check what ``tests/test_runtime.py`` checks on Gloo: every step's global
batch, exactly-once samples, and the failure-free parameters (computed on the
CPU: the GPU's float32 sums differ by re-association only, the same order as
the quorum's changing partial sums, well inside ``PARAM_TOLERANCE``).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (torch.cuda.is_available() is False)", allow_module_level=True)

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.processes import preloaded_context
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.runtime.comm import NCCL_ENVIRONMENT, CollectiveError, Communicator, nccl_environment
from stalwart.testing.groups import GROUP_PLAN as HSDP_PLAN
from stalwart.testing.loopback import prefix_store
from tests.integration.hsdp_scenario import kill_restart_and_heal

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL cannot put two ranks of one communicator on one GPU: needs 2 GPUs, this machine has {GPUS}"
)
HOST = "127.0.0.1"
CONTEXT = preloaded_context()  # forked from one interpreter that imported torch once
REPORT_BOUND = 60.0
RENDEZVOUS = 3.0
COLLECTIVE = 1.0
STEPS = 10
LONG_STEPS = 24
PLAN = EpochPlan(1797, 48, seed=0)
PARAM_TOLERANCE = 1e-4
JOB_TIMEOUT = 180.0


# --- Communicator on NCCL ------------------------------------------------------------------------------------------


def peer(rank: int, world: int, port: int, prefix: str, scenario: str, reports: Any) -> None:
    """One rank on GPU ``rank``; reports ``(rank, what, detail)`` tuples."""
    device = torch.device("cuda", rank)

    def group(prefix: str, world: int, timeout: float = 10.0, rendezvous_timeout: float | None = None) -> Communicator:
        store = prefix_store(HOST, port, prefix, RENDEZVOUS)
        in_group = rank if world > 1 else 0
        return Communicator(
            store, in_group, world, timeout=timeout, rendezvous_timeout=rendezvous_timeout, device=device
        )

    def works_alone() -> None:
        """A fresh one-rank group on the same GPU sums: nothing of a failed group holds this process up."""
        start = time.monotonic()
        comm = group(f"{prefix}alone-{rank}/", 1)
        value = torch.ones(4, device=device)
        comm.start_all_reduce_sum(value)()
        comm.abort()
        reports.put((rank, "recovered", (value.tolist(), time.monotonic() - start)))

    if scenario == "one rank":
        comm = group(prefix, 1)
        reports.put((rank, "environment", {name: os.environ.get(name) for name in NCCL_ENVIRONMENT}))
        summed = torch.tensor([1.0, 2.0], device=device)
        comm.start_all_reduce_sum(summed)()
        copied = torch.arange(3, device=device)
        comm.broadcast([copied], source_rank=0, timeout=120.0)  # longer than the group's timeout: raises it
        comm.abort()
        reports.put((rank, "sums", (summed.tolist(), copied.tolist())))
        works_alone()
    elif scenario == "lonely":
        start = time.monotonic()
        try:
            group(prefix, world, rendezvous_timeout=RENDEZVOUS)
            reports.put((rank, "connected", None))
        except CollectiveError as error:
            reports.put((rank, "CollectiveError", (str(error), time.monotonic() - start)))
        works_alone()
    elif scenario == "kill":
        comm = group(prefix, world, timeout=COLLECTIVE, rendezvous_timeout=RENDEZVOUS)
        if rank == world - 1:
            reports.put((rank, "ready", None))
            time.sleep(REPORT_BOUND)
            return
        wait = comm.start_all_reduce_sum(torch.ones(1 << 16, device=device))
        reports.put((rank, "started", None))
        try:
            wait()
            reports.put((rank, "completed", None))
            return
        except CollectiveError as error:
            reports.put((rank, "CollectiveError", str(error)))
        # Not aborted yet: NCCL's watchdog times the hung collective out meanwhile, which must not end the process.
        time.sleep(RENDEZVOUS + 5.0)
        start = time.monotonic()
        comm.abort()
        reports.put((rank, "aborted", time.monotonic() - start))
        works_alone()


class Ranks:
    """Spawned ranks of one test, with bounded waits on their reports."""

    def __init__(self, store: dist.TCPStore, scenario: str, world: int, started: int | None = None) -> None:
        self.reports: Any = CONTEXT.Queue()
        prefix = f"{scenario}-{uuid.uuid4().hex}/"
        self.processes: list[SpawnProcess] = [
            CONTEXT.Process(target=peer, args=(rank, world, store.port, prefix, scenario, self.reports))
            for rank in range(world if started is None else started)
        ]
        self.deadline = time.monotonic() + REPORT_BOUND
        self.seen: list[tuple[int, str, Any]] = []
        for process in self.processes:
            process.start()

    def collect(self, what: str, ranks: list[int]) -> dict[int, Any]:
        """Details of the ``what`` reports of ``ranks``, waiting until the bound at most."""
        found = {rank: detail for rank, kind, detail in self.seen if kind == what and rank in ranks}
        while set(found) != set(ranks):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                exits = {rank: process.exitcode for rank, process in enumerate(self.processes)}
                raise AssertionError(f"no {what!r} report from ranks {sorted(set(ranks) - set(found))}; exits {exits}")
            try:
                report = self.reports.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            self.seen.append(report)
            if report[1] == what and report[0] in ranks:
                found[report[0]] = report[2]
        return found

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=30)


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


def test_a_one_rank_group_sums_broadcasts_and_sets_the_nccl_environment(store: dist.TCPStore) -> None:
    """One GPU suffices."""
    ranks = Ranks(store, "one rank", 1)
    try:
        inherited = {name: os.environ.get(name) for name in NCCL_ENVIRONMENT}
        assert ranks.collect("environment", [0])[0] == {**inherited, **nccl_environment(os.environ)}
        assert ranks.collect("sums", [0])[0] == ([1.0, 2.0], [0, 1, 2])
        assert ranks.collect("recovered", [0])[0][0] == [1.0] * 4
    finally:
        ranks.close()


def test_a_rendezvous_whose_peer_never_comes_raises_at_its_deadline(store: dist.TCPStore) -> None:
    """Rank 0 of two, alone: NCCL's connect would wait forever. One GPU suffices."""
    ranks = Ranks(store, "lonely", 2, started=1)
    try:
        message, elapsed = ranks.collect("CollectiveError", [0])[0]
        assert "rendezvous of rank 0/2 failed" in message and RENDEZVOUS <= elapsed < RENDEZVOUS + 5
        values, took = ranks.collect("recovered", [0])[0]
        assert values == [1.0] * 4 and took < 15
    finally:
        ranks.close()


@needs_two_gpus
def test_a_peer_killed_mid_all_reduce_raises_and_the_watchdog_does_not_end_the_survivor(
    store: dist.TCPStore,
) -> None:
    """The survivor raises, outlives NCCL's watchdog timeout of the hung collective, aborts, and works again.

    The watchdog times the collective out 3 s after it started (the group's
    timeout); in a tear-down mode it would end the process then.
    """
    world = min(GPUS, 3)
    victim = world - 1
    ranks = Ranks(store, "kill", world)
    try:
        ranks.collect("ready", [victim])
        survivors = list(range(victim))
        ranks.collect("started", survivors)
        os.kill(ranks.processes[victim].pid or 0, signal.SIGKILL)
        errors = ranks.collect("CollectiveError", survivors)
        assert all("all-reduce" in message for message in errors.values())
        assert all(took < 10 for took in ranks.collect("aborted", survivors).values())
        recovered = ranks.collect("recovered", survivors)
        assert all(values == [1.0] * 4 for values, _ in recovered.values())
    finally:
        ranks.close()


# --- the digits job on NCCL ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_run(PLAN, STEPS)[0]


@pytest.fixture(scope="module")
def long_reference() -> dict[str, torch.Tensor]:
    return reference_run(PLAN, LONG_STEPS)[0]


def cluster_for(lighthouse: Lighthouse, run_dir: Path, steps: int) -> LocalCluster:
    """Workers that each see only the GPU of their index."""
    args = ["--max-steps", str(steps), "--max-microbatch", "8", "--collective-timeout", "1.0"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = visible.split(",") if visible else [str(index) for index in range(GPUS)]
    return LocalCluster(lighthouse.url, run_dir, args, worker_env=lambda worker: {"CUDA_VISIBLE_DEVICES": gpus[worker]})


def wait_for(cluster: LocalCluster, predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    cluster.terminate()
    logs = "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(cluster.run_dir.glob("*.log")))
    pytest.fail(f"{what} not within {JOB_TIMEOUT} s; worker logs:\n{logs}")


def check_job(run_dir: Path, reference: dict[str, torch.Tensor], finishers: int, steps_run: int) -> float:
    """Every step's global batch, exactly-once samples, the reference's parameters; the largest difference."""
    steps = committed_steps(run_dir)
    assert [record["step"] for record in steps] == list(range(steps_run))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(steps_run)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    finals = sorted(run_dir.glob("final-*.pt"))
    assert len(finals) == finishers
    worst = 0.0
    for path in finals:
        parameters = torch.load(path, weights_only=True)
        worst = max(worst, *(float((parameters[name] - value).abs().max()) for name, value in reference.items()))
    print(f"largest parameter difference to the CPU reference: {worst:.3g}")
    assert worst < PARAM_TOLERANCE
    return worst


def test_one_worker_trains_the_digits_job_to_the_reference(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """The worker, the Manager and a one-rank NCCL quorum on the GPU. One GPU suffices."""
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=1.0, join_timeout=30.0) as lighthouse:
        cluster = cluster_for(lighthouse, tmp_path, STEPS)
        cluster.start(0)
        wait_for(cluster, lambda: not cluster.running(), "the job's end")
    assert cluster.processes[0].returncode == 0
    check_job(tmp_path, reference, finishers=1, steps_run=STEPS)


@needs_two_gpus
def test_sigkill_mid_all_reduce_on_nccl(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Worker 1 SIGKILLs itself while its NCCL all-reduce is in flight; the others finish the job without it."""
    workers = min(GPUS, 3)
    with Lighthouse(PLAN, min_replicas=1, start_replicas=workers, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = cluster_for(server, tmp_path, STEPS)
        for worker in range(workers):
            cluster.start(worker, ["--kill-at", "4:during_reduce"] if worker == 1 else None)
        wait_for(cluster, lambda: not cluster.running(), "the job's end")
    assert cluster.processes[1].returncode == -signal.SIGKILL
    assert all(cluster.processes[worker].returncode == 0 for worker in range(workers) if worker != 1)
    check_job(tmp_path, reference, finishers=workers - 1, steps_run=STEPS)
    assert min(record["world_size"] for record in committed_steps(tmp_path)) == workers - 1


@needs_two_gpus
def test_a_killed_worker_restarts_and_is_healed_from_a_peer_over_nccl(
    tmp_path: Path, long_reference: dict[str, torch.Tensor]
) -> None:
    """Worker 1 dies at step 2; its new process (same GPU) is healed by broadcast from a live peer.

    The others are held before step 6 until the new process asks to join, so
    that the job cannot end first however long CUDA takes to start.
    """
    workers = min(GPUS, 3)
    with Lighthouse(PLAN, min_replicas=1, start_replicas=workers, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = cluster_for(server, tmp_path, LONG_STEPS)
        cluster.hold(from_step=6)
        for worker in range(workers):
            cluster.start(worker, ["--kill-at", "2:before_forward"] if worker == 1 else None)
        wait_for(cluster, lambda: cluster.processes[1].poll() is not None, "worker 1's death")
        assert cluster.processes[1].returncode == -signal.SIGKILL
        cluster.start(1)

        def asking() -> bool:
            entry = next((m for m in server.status()["members"] if m["member"] == "worker-1"), None)
            return entry is not None and (entry["asking"] == "join" or entry["state"] == "alive")

        wait_for(cluster, asking, "worker 1's rejoin")
        cluster.release()
        wait_for(cluster, lambda: not cluster.running(), "the job's end")
    check_job(tmp_path, long_reference, finishers=workers, steps_run=LONG_STEPS)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert min(world_sizes) == workers - 1 and world_sizes[-1] == workers
    events = [json.loads(line) for line in (tmp_path / "events-worker-1.jsonl").read_text().splitlines()]
    restarted = [event["event"] for event in events if event["pid"] == cluster.processes[1].pid]
    assert restarted[:3] == ["started", "healed", "joined"]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs: 2 FSDP2 groups of 2 processes")
def test_fsdp2_replica_groups_on_nccl(tmp_path: Path) -> None:
    """Two FSDP2 groups of two processes on their own GPUs (NCCL inside and across groups): a process of one
    SIGKILLed, its group restarted and healed shard by shard; exactly-once and the failure-free parameters."""
    with Lighthouse(HSDP_PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        envs = {"group-a": {"CUDA_VISIBLE_DEVICES": "0,1"}, "group-b": {"CUDA_VISIBLE_DEVICES": "2,3"}}
        kill_restart_and_heal(tmp_path, server, envs)
