"""The digits job on a private bridge: the real lighthouse and three real workers, each in its own namespace.

The settings are the issue's (#36): workers with ``--collective-timeout 1``,
the lighthouse with ``--min-replicas 2 --heartbeat-timeout 1 --join-timeout 5``
(and ``--start-replicas 3``, so that the first quorum holds every worker).
:class:`NetworkJob` starts them (fresh interpreters, through ``ip netns exec``),
holds and releases the job with the workers' hold file, reads the
lighthouse's ``/v1/status`` and ``/metrics`` from inside its namespace, and
waits (bounded) on the workers' step records.

:data:`FAULTS` names each fault a scenario injects and heals; :func:`inject_fault`
runs one on a job from a given step and returns its :class:`FaultTimeline`,
which both the scenario tests and ``benchmarks.network_faults`` read.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stalwart.launch.cluster import HOLD_FILE, latest_step, read_status
from stalwart.launch.processes import ForkedWorker
from stalwart.launch.report import committed_steps
from stalwart.testing.digits_job import PLAN, worker_args
from stalwart.testing.network.netns import Bridge
from stalwart.testing.waiting import wait_until

LIGHTHOUSE = "lh"
WORKERS = ("w0", "w1", "w2")
LIGHTHOUSE_PORT = 29510
LIGHTHOUSE_INSECURE = ("--insecure",)
"""What ``stalwart lighthouse`` needs to serve a non-loopback address over plain HTTP (the bridge is private)."""
LIGHTHOUSE_SETTINGS = (
    "--min-replicas", "2", "--start-replicas", "3", "--heartbeat-timeout", "1", "--join-timeout", "5",
)  # fmt: skip
START_TIMEOUT = 120.0
"""Seconds the lighthouse and the workers have to start and form their first quorum (fresh interpreters, busy CPU)."""
FINISH_TIMEOUT = 180.0
"""Seconds the workers have to end once the job is released."""
REQUEST_TIMEOUT = 5.0


def member_of(node: str) -> str:
    """The member name of worker node ``w<i>``: ``worker-<i>``."""
    if node not in WORKERS:
        raise ValueError(f"node must be one of {list(WORKERS)}, got {node!r}")
    return f"worker-{node[1:]}"


class NetworkJob:
    """A lighthouse (node ``lh``) and three digits workers (``w0``-``w2``) on ``bridge``, writing to ``run_dir``.

    ``steps``: the job's ``--max-steps``; ``step_seconds``: simulated compute
    per step; ``extra``: more worker options (``--parity 2,1``).
    """

    def __init__(
        self, bridge: Bridge, run_dir: Path, steps: int, step_seconds: float = 0.0, extra: Sequence[str] = ()
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        if not 0 <= step_seconds < float("inf"):
            raise ValueError(f"step_seconds must be a finite number of seconds >= 0, got {step_seconds!r}")
        self.bridge = bridge
        self.run_dir = run_dir
        self.steps = steps
        self.step_seconds = step_seconds
        self.extra = list(extra)
        self.token = secrets.token_urlsafe(16)
        self.url = f"http://{bridge.address(LIGHTHOUSE)}:{LIGHTHOUSE_PORT}"
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, ForkedWorker] = {}
        run_dir.mkdir(parents=True, exist_ok=True)
        self.hold_file = run_dir / HOLD_FILE

    def _env(self) -> dict[str, str]:
        return {**os.environ, "STALWART_LIGHTHOUSE_TOKEN": self.token}

    def start(self, hold_at: int | None = None) -> None:
        """Start the lighthouse, wait until it listens, then start the workers (held before ``hold_at``)."""
        if hold_at is not None:
            self.hold(hold_at)
        log = self.run_dir / "lighthouse.log"
        command = [
            sys.executable, "-m", "stalwart", "lighthouse", "--host", self.bridge.address(LIGHTHOUSE),
            "--port", str(LIGHTHOUSE_PORT), *LIGHTHOUSE_INSECURE, *LIGHTHOUSE_SETTINGS,
            "--dataset-size", str(PLAN.dataset_size), "--global-batch", str(PLAN.global_batch_size),
            "--seed", str(PLAN.seed),
        ]  # fmt: skip
        self.lighthouse = self.bridge.spawn(LIGHTHOUSE, command, log, self._env())
        lighthouse = self.lighthouse
        wait_until(
            lambda: lighthouse.poll() is not None or "listening on" in log.read_text(errors="replace"),
            START_TIMEOUT,
            "the lighthouse to listen",
        )
        if lighthouse.poll() is not None:
            raise AssertionError(f"the lighthouse exited {lighthouse.returncode}: {log.read_text(errors='replace')}")
        for node in WORKERS:
            self.start_worker(node)

    def start_worker(self, node: str) -> None:
        """Start worker ``node`` (``python -m stalwart.launch.worker``, forked), logging to ``RUN_DIR/<node>.log``."""
        argv = [
            "--lighthouse", self.url,
            "--member", member_of(node), "--run-dir", str(self.run_dir), "--hold-file", str(self.hold_file),
            "--host", self.bridge.address(node), *worker_args(self.steps, self.step_seconds), *self.extra,
        ]  # fmt: skip
        self.workers[node] = self.bridge.fork(node, argv, self.run_dir / f"{node}.log", self._env())

    def hold(self, step: int) -> None:
        """Make the workers wait before any step >= ``step`` (a membership change still gets its step)."""
        self.hold_file.write_text(str(step), encoding="utf-8")

    def release(self) -> None:
        """Let held workers go on."""
        self.hold_file.unlink(missing_ok=True)

    def committed(self) -> int:
        """Steps the job has committed, from the workers' step records."""
        return latest_step(self.run_dir)[0]

    def status(self) -> dict[str, Any]:
        """The lighthouse's ``/v1/status``, asked from inside its namespace."""
        return self.bridge.call_in(LIGHTHOUSE, lambda: read_status(self.url, self.token, REQUEST_TIMEOUT))

    def metric(self, name: str) -> float:
        """The sum of the lighthouse's ``/metrics`` samples called ``name`` (0 when it has none)."""
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {self.token}"})

        def fetch() -> str:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
                return str(response.read().decode())

        text = self.bridge.call_in(LIGHTHOUSE, fetch)
        return sum(
            sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name
        )  # fmt: skip

    def quorum_members(self) -> set[str]:
        """The members of the lighthouse's current quorum (empty before the first, or when it does not answer)."""
        try:
            quorum = self.status()["quorum"]
        except OSError:
            return set()
        return set() if quorum is None else set(quorum["members"])

    def wait_in_quorum(self, members: Sequence[str], timeout: float, what: str) -> None:
        """Wait (bounded) until the lighthouse's quorum holds every one of ``members``."""
        wait_until(lambda: set(members) <= self.quorum_members(), timeout, what)

    def wait_committed(self, steps: int, timeout: float) -> None:
        """Wait (bounded) until the job has committed ``steps`` steps."""
        wait_until(lambda: self.committed() >= steps, timeout, f"{steps} committed steps")

    def wait_exits(self, timeout: float = FINISH_TIMEOUT) -> dict[str, int]:
        """Wait (bounded) until every worker has exited; their exit statuses by node."""
        wait_until(lambda: all(p.poll() is not None for p in self.workers.values()), timeout, "every worker to exit")
        return {node: process.wait(timeout=0) for node, process in self.workers.items()}

    def logs(self, limit: int = 3000) -> str:
        """The tail of every log of the run and the lighthouse's quorums (id, reason, members), for an assertion's
        message: which quorum left whom out is what a failed scenario is read from."""
        parts = [
            f"--- {path.name}\n{path.read_text(errors='replace')[-limit:]}"
            for path in sorted(self.run_dir.glob("*.log"))
        ]
        try:
            quorums = [
                (quorum["quorum_id"], quorum["reason"], quorum["members"]) for quorum in self.status()["quorums"]
            ]
            parts.append(f"--- the lighthouse's quorums (id, reason, members)\n{quorums}")
        except OSError as error:
            parts.append(f"--- the lighthouse's quorums: not read ({error})")
        return "\n".join(parts)


@dataclass(frozen=True)
class Fault:
    """A fault a scenario injects into a running job and later heals (``heal`` None: nothing to heal)."""

    name: str
    inject: Callable[[NetworkJob], None]
    heal: Callable[[NetworkJob], None] | None
    victim: str | None
    """The worker node the fault is aimed at (None: the lighthouse)."""


def _sigterm(job: NetworkJob, node: str) -> None:
    job.workers[node].send_signal(signal.SIGTERM)


FAULTS: dict[str, Fault] = {
    fault.name: fault
    for fault in (
        Fault("nic_down", lambda j: j.bridge.set_link("w1", False), lambda j: j.bridge.set_link("w1", True), "w1"),
        Fault(
            "asymmetric_w2",
            lambda j: j.bridge.set_blackhole("w2", ["w0", "w1"], True),
            lambda j: j.bridge.set_blackhole("w2", ["w0", "w1"], False),
            "w2",
        ),
        Fault(
            "asymmetric_w0",
            lambda j: j.bridge.set_blackhole("w0", ["w1", "w2"], True),
            lambda j: j.bridge.set_blackhole("w0", ["w1", "w2"], False),
            "w0",
        ),
        Fault(
            "silent_partition",
            lambda j: j.bridge.set_partition(["w2"], ["w0", "w1"], True),
            lambda j: j.bridge.set_partition(["w2"], ["w0", "w1"], False),
            "w2",
        ),
        Fault("slow_link", lambda j: j.bridge.set_rate("w2", "128kbit"), lambda j: j.bridge.set_rate("w2", None), "w2"),
        Fault(
            "lighthouse_down",
            lambda j: j.bridge.set_link(LIGHTHOUSE, False),
            lambda j: j.bridge.set_link(LIGHTHOUSE, True),
            None,
        ),
        Fault("sigterm", lambda j: _sigterm(j, "w2"), None, "w2"),
    )
}
"""The faults of the scenarios, by name (``nic_down`` also serves the sharded-state scenario)."""


@dataclass
class FaultTimeline:
    """When a fault was injected and healed, and what the lighthouse counted before it (wall-clock times)."""

    fault: str
    injected: float
    healed: float | None = None
    failures_before: int = 0
    reassigned_before: float = 0.0
    progressed: bool = False
    """Whether the job committed the steps asked of it while the fault lasted."""


def inject_fault(
    job: NetworkJob,
    fault: Fault,
    *,
    duration: float,
    progress: int = 0,
    progress_timeout: float = 0.0,
    hold_during: int | None = None,
) -> FaultTimeline:
    """Inject ``fault`` now, keep it ``duration`` seconds, and longer (up to ``progress_timeout`` more) until the
    job commits ``progress`` steps; then heal it. Every wait is bounded.

    ``hold_during``: once the fault is in, hold the job before that step
    instead of where it was held (None: release it), so that it cannot end
    before the fault is healed.
    """
    for name, value in (("duration", duration), ("progress", progress), ("progress_timeout", progress_timeout)):
        if not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    status = job.status()
    timeline = FaultTimeline(
        fault.name,
        injected=0.0,
        failures_before=len(status["failures"]),
        reassigned_before=job.metric("stalwart_samples_reassigned_total"),
    )
    start_steps = job.committed()
    timeline.injected = time.time()
    fault.inject(job)
    if hold_during is None:
        job.release()
    else:
        job.hold(hold_during)
    time.sleep(duration)
    deadline = time.monotonic() + progress_timeout
    while job.committed() < start_steps + progress and time.monotonic() < deadline:
        time.sleep(0.1)
    timeline.progressed = job.committed() >= start_steps + progress
    if fault.heal is not None:
        fault.heal(job)
        timeline.healed = time.time()
    return timeline


def commits_after(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """The committed steps' records written after wall time ``since``, oldest first."""
    return [record for record in committed_steps(run_dir) if record["time"] > since]
