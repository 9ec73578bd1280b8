"""The job through the faults real networks have: each process in its own network namespace on a private bridge.

A real lighthouse (``stalwart lighthouse``) and three real digits workers,
each in a namespace of a :class:`~stalwart.testing.network.netns.Bridge`,
with the issue's settings (``--collective-timeout 1``; ``--min-replicas 2
--heartbeat-timeout 1 --join-timeout 5``). The job is held at step
``FAULT_AT`` until all three are in one quorum; the fault goes in, the job
may commit ``HELD_DURING`` more steps while it lasts; the fault is healed;
the job is held there until the worker it hit is back in the quorum, then
runs to its end. Each scenario then checks the three promises (exactly once,
the planned global batch, parameters within 1e-4 of the failure-free run) and
that no healthy worker exited non-zero, plus what the fault is about.

Before issue 36 only the NIC and parity scenarios passed (docs/design.md,
"Network faults", has how each other one failed). Run one alone by name,
e.g. ``pytest tests/integration/test_network_faults.py -k nic_down``.
Needs root (``ip netns``); skipped, with the reason, only where that is missing.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stalwart.testing.digits_job import check_job, reference_parameters
from stalwart.testing.network.job import (
    FAULTS,
    LIGHTHOUSE,
    START_TIMEOUT,
    WORKERS,
    NetworkJob,
    commits_after,
    inject_fault,
    member_of,
)
from stalwart.testing.network.netns import Bridge, unavailable_reason

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
    pytest.mark.slow,  # 75 s in all, single process
]

FAULT_AT = 3
HELD_DURING = 10
"""Steps the job may commit while a fault lasts (it is held before the next one until the fault is healed)."""
STEPS = FAULT_AT + HELD_DURING + 4
PROGRESS_TIMEOUT = 30.0
"""Seconds a fault is kept beyond its duration while the job has not committed what the scenario expects."""
BACK_TIMEOUT = 60.0
"""Seconds the worker a healed fault hit has to be back in the quorum."""
EVERYONE = [member_of(node) for node in WORKERS]
PROBE_TIMEOUT = 1.0
"""Seconds a probe connection waits before it calls a path silent (a connect on the bridge that is let through
is answered by the kernels in microseconds; a dropped one is never answered)."""


@dataclass(frozen=True)
class Scenario:
    """A fault kept ``duration`` s and until the job has committed ``progress`` steps (bounded) during it."""

    fault: str
    duration: float
    progress: int
    extra: tuple[str, ...] = ()
    majority_kept: bool = True
    """Whether the steps committed during the fault must be the others' (the victim committed none of them)."""
    departs: bool = False
    """The victim leaves for good (preemption): it must exit 0 without finishing, and no failure is counted."""


@dataclass
class Outcome:
    """What a scenario's run left: the exit statuses, and what the lighthouse counted since the fault."""

    job: NetworkJob
    exits: dict[str, int]
    failures: int
    reassigned: float


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The failure-free parameters after ``STEPS`` steps (one computation for every scenario)."""
    return reference_parameters(STEPS)


@pytest.fixture
def bridge() -> Iterator[Bridge]:
    """The lighthouse's and the workers' namespaces on a private bridge, removed with their processes after."""
    with Bridge([LIGHTHOUSE, *WORKERS]) as network:
        yield network


def run_scenario(bridge: Bridge, run_dir: Path, scenario: Scenario) -> Outcome:
    """Run the job through ``scenario``'s fault to its end (every wait bounded).

    Fails at once, without waiting for the end, when the job did not commit
    the scenario's steps while the fault lasted, or when the worker cut off
    committed some of them (the majority must be the side that goes on).
    """
    fault = FAULTS[scenario.fault]
    job = NetworkJob(bridge, run_dir, STEPS, extra=scenario.extra)
    job.start(hold_at=FAULT_AT)
    job.wait_committed(FAULT_AT, START_TIMEOUT)
    job.wait_in_quorum(EVERYONE, START_TIMEOUT, "every worker in one quorum before the fault")
    timeline = inject_fault(
        job,
        fault,
        duration=scenario.duration,
        progress=scenario.progress,
        progress_timeout=PROGRESS_TIMEOUT,
        hold_during=job.committed() + HELD_DURING,
    )
    assert timeline.progressed, f"fewer than {scenario.progress} steps during {scenario.fault}\n{job.logs()}"
    if scenario.majority_kept and fault.victim is not None and timeline.healed is not None:
        during = [r for r in commits_after(job.run_dir, timeline.injected) if r["time"] < timeline.healed]
        assert all(r["member"] != member_of(fault.victim) for r in during), f"the cut-off worker committed: {during}"
    if fault.heal is not None:
        job.wait_in_quorum(EVERYONE, BACK_TIMEOUT, f"{fault.victim or 'every worker'} back in the quorum")
    job.release()
    exits = job.wait_exits()
    status = job.status()
    reassigned = job.metric("stalwart_samples_reassigned_total") - timeline.reassigned_before
    return Outcome(job, exits, len(status["failures"]) - timeline.failures_before, reassigned)


def check_scenario(outcome: Outcome, scenario: Scenario, reference: dict[str, torch.Tensor]) -> None:
    """The promises every scenario keeps, and no healthy worker exiting non-zero."""
    job = outcome.job
    assert outcome.exits == dict.fromkeys(WORKERS, 0), f"{outcome.exits}\n{job.logs()}"
    check_job(job.run_dir, reference, finishers=len(WORKERS) - scenario.departs, steps_run=STEPS)


def _listen(bridge: Bridge, node: str) -> socket.socket:
    """A TCP listener on ``node``'s address, port 5000 (opened inside its namespace)."""

    def listen() -> socket.socket:
        listener = socket.create_server((bridge.address(node), 5000))
        listener.settimeout(PROBE_TIMEOUT)
        return listener

    return bridge.call_in(node, listen)


def _connect(bridge: Bridge, source: str, target: str) -> str:
    """``ok``, ``refused at once`` (the kernel said no) or ``silence`` (a timeout): a connect from ``source``."""

    def connect() -> str:
        try:
            socket.create_connection((bridge.address(target), 5000), timeout=PROBE_TIMEOUT).close()
        except TimeoutError:
            return "silence"
        except OSError:
            return "refused at once"
        return "ok"

    return bridge.call_in(source, connect)


def _qdisc(bridge: Bridge, node: str) -> str:
    """What ``tc`` shows of the queueing discipline on ``node``'s link."""
    command = ["tc", "-n", bridge.namespace(node), "qdisc", "show", "dev", "eth0"]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout


def test_each_fault_cuts_what_it_says_and_nothing_is_left_behind() -> None:
    with Bridge(["a", "b", "c"]) as bridge:
        listeners = {node: _listen(bridge, node) for node in ("a", "b")}
        assert _connect(bridge, "a", "b") == _connect(bridge, "b", "a") == "ok"
        bridge.set_blackhole("a", ["b"], True)  # a's side only
        assert (_connect(bridge, "a", "b"), _connect(bridge, "b", "a")) == ("refused at once", "silence")
        assert _connect(bridge, "c", "a") == "ok"
        bridge.set_blackhole("a", ["b"], False)
        bridge.set_partition(["a"], ["b"], True)
        assert (_connect(bridge, "a", "b"), _connect(bridge, "b", "a")) == ("silence", "silence")
        assert _connect(bridge, "c", "b") == "ok"
        bridge.set_partition(["a"], ["b"], False)
        bridge.set_link("b", False)
        assert _connect(bridge, "a", "b") in ("silence", "refused at once")
        bridge.set_link("b", True)
        bridge.set_rate("b", "128kbit")
        assert _connect(bridge, "a", "b") == "ok"
        assert "tbf" in _qdisc(bridge, "b") and "128Kbit" in _qdisc(bridge, "b")
        bridge.set_rate("b", None)
        assert "tbf" not in _qdisc(bridge, "b")
        for listener in listeners.values():
            listener.close()
        namespaces = bridge.topology.namespaces
    remaining = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in namespaces if name in remaining.split()]


def test_nic_down_and_up_again(bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    scenario = Scenario("nic_down", duration=3.0, progress=2)
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)


def test_asymmetric_partition_worker_2_cut_from_peers(
    bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Worker 2 reaches the lighthouse but not its peers (a blackhole on its side): the majority goes on."""
    scenario = Scenario("asymmetric_w2", duration=3.0, progress=2)
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)


def test_asymmetric_partition_worker_0_cut_from_peers(
    bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Worker 0 reaches the lighthouse but not its peers: the majority goes on, whoever is cut off."""
    scenario = Scenario("asymmetric_w0", duration=3.0, progress=2)
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)


def test_silent_partition_longer_than_the_heartbeat_timeout(
    bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Packets between worker 2 and its peers vanish both ways (the lighthouse still hears all): steps go on."""
    scenario = Scenario("silent_partition", duration=3.0, progress=2)
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)


def test_slow_link_of_128_kbit(bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Worker 2's link at 128 kbit/s both ways: it is left out as a straggler and the others keep stepping."""
    # at 128 kbit/s an all-reduce through worker 2 takes 2-3 s against a 1 s collective timeout; the probe that
    # follows the first timeout finds its link too slow for a step, and the other two go on without it (the code
    # before issue 36 made 3 steps in 30 s; with the growing timeout alone it made 5-8 in 20 s, all with worker 2)
    scenario = Scenario("slow_link", duration=0.0, progress=HELD_DURING)
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)


def test_lighthouse_link_down_is_no_failure(bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """The lighthouse unreachable for 5 s: the quorum trains on and nobody is counted as failed."""
    scenario = Scenario("lighthouse_down", duration=5.0, progress=0)
    outcome = run_scenario(bridge, tmp_path, scenario)
    check_scenario(outcome, scenario, reference)
    assert outcome.failures == 0, outcome.job.status()["failures"]


def test_sigterm_preemption_is_a_departure(bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """SIGTERM to worker 2: it leaves at a step boundary, announced; no failure, nothing retrained."""
    scenario = Scenario("sigterm", duration=0.0, progress=2, departs=True)
    outcome = run_scenario(bridge, tmp_path, scenario)
    check_scenario(outcome, scenario, reference)
    assert outcome.failures == 0, outcome.job.status()["failures"]
    assert outcome.reassigned == 0


def test_partition_with_parity_sharded_state(
    bridge: Bridge, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Optimizer state sharded with parity (2,1): worker 1 cut off from everything, back, healed."""
    scenario = Scenario("nic_down", duration=3.0, progress=2, extra=("--parity", "2,1"))
    check_scenario(run_scenario(bridge, tmp_path, scenario), scenario, reference)
