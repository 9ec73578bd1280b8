"""Chaos soak: a training job through hundreds of random failures of every kind, audited at the end.

Run: ``python -m benchmarks.chaos --failures 200 --report out/chaos.json``
(``--quick`` for a short run). Everything runs on 127.0.0.1: a lighthouse
process (``stalwart lighthouse`` on a SQLite state file) and ``--workers``
worker processes training the digits task with Adam and an LR schedule,
writing a checkpoint every ``--checkpoint-every`` steps. Failures, each of a
kind drawn at random (every kind at least once):

- ``worker_kill``: SIGKILL one worker, start a new process for it;
- ``worker_stop``: SIGSTOP one worker until the lighthouse excludes it, then SIGCONT;
- ``fleet_restart``: SIGKILL every worker, then start them all again (the job
  resumes from its newest checkpoint);
- ``lighthouse_restart``: SIGKILL the lighthouse, start it again on its state file;
- ``database_failure``: another process holds the lighthouse's SQLite file
  locked, so its writes fail (it answers 503 and hands nothing out unsaved)
  until the lock goes.

Before each failure the job is held a few steps ahead, so that it cannot end
mid-recovery; a failure is *survived* when the job commits a step after it.
At the end the committed steps are audited (samples lost: planned samples of a
step never committed; trained twice: committed more than once) and every
finished worker's parameters are compared with a failure-free run of the same
steps in this process. The loop is bounded in failures and in time
(``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._measure import make_console, print_table, progress_display
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster, latest_step, read_status
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run

KINDS = ("worker_kill", "worker_stop", "fleet_restart", "lighthouse_restart", "database_failure")
PLAN = EpochPlan(1797, 64, seed=0)
HEARTBEAT_TIMEOUT = 2.0
DATABASE_LOCK_SECONDS = 7.0
"""Longer than SQLite's 5 s busy timeout, so that the lighthouse's writes really fail while it is held."""


class Lighthouse:
    """``stalwart lighthouse`` as a process of its own, restartable on the same port and state file."""

    def __init__(self, state: Path, workers: int) -> None:
        self.state = state
        self.workers = workers
        self.port = 0
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> None:
        """Start it (on the port of the last start, if any) and wait for its first line."""
        command = [
            sys.executable, "-m", "stalwart", "lighthouse", "--min-replicas", "1",
            "--start-replicas", str(self.workers), "--state", str(self.state),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--join-timeout", "30",
            "--dataset-size", str(PLAN.dataset_size), "--global-batch", str(PLAN.global_batch_size),
            "--port", str(self.port),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("lighthouse listening on "):
            raise RuntimeError(f"the lighthouse did not start: {line!r}")
        self.url = line.removeprefix("lighthouse listening on ").strip()
        self.port = int(self.url.rpartition(":")[2])

    def kill(self) -> None:
        """SIGKILL it and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=60)

    def status(self) -> dict[str, Any]:
        """``/v1/status``, or ``{}`` while it does not answer."""
        try:
            return read_status(self.url, timeout=5.0)
        except (OSError, ValueError):  # urllib's URLError is an OSError
            return {}


class Soak:
    """Injects the failures and waits, bounded, for the job to recover from each."""

    def __init__(self, lighthouse: Lighthouse, cluster: LocalCluster, workers: int, rng: random.Random) -> None:
        self.lighthouse = lighthouse
        self.cluster = cluster
        self.workers = workers
        self.rng = rng
        self.injected: Counter[str] = Counter()
        self.survived: Counter[str] = Counter()
        self.recovery_seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.last_status: dict[str, Any] = {}

    def committed(self) -> int:
        """Steps the job has committed (from the workers' step records)."""
        return latest_step(self.cluster.run_dir)[0]

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``predicate`` every 50 ms; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        members = {entry["member"]: (entry["state"], entry["asking"]) for entry in self.last_status.get("members", [])}
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; the lighthouse last said {members}")

    def members(self, state: str) -> set[str] | None:
        """Members the lighthouse reports in ``state`` (``asking``: asking to join); None while it does not answer."""
        status = self.lighthouse.status()
        self.last_status = status or self.last_status
        if not status:
            return None
        return {
            entry["member"]
            for entry in status.get("members", [])
            if entry["state"] == state or (state == "asking" and entry["asking"] == "join")
        }

    def rejoined(self, names: set[str]) -> bool:
        """Whether every one of ``names`` is in the quorum or asking to join it (as the lighthouse answers)."""
        alive, asking = self.members("alive"), self.members("asking")
        return alive is not None and asking is not None and names <= alive | asking

    def gone(self, names: set[str]) -> bool:
        """Whether none of ``names`` is in the quorum any more (as the lighthouse answers)."""
        alive = self.members("alive")
        return alive is not None and not names & alive

    def inject(self, kind: str, recovery_timeout: float) -> None:
        """One failure of ``kind``, held a few steps ahead of the job; returns once it has recovered."""
        before = self.committed()
        self.cluster.hold(before + 2)
        start = time.monotonic()
        self.injected[kind] += 1
        getattr(self, kind)(recovery_timeout)
        self.cluster.release()
        self.wait(lambda: self.committed() > before, recovery_timeout, f"a step after {kind}")
        self.survived[kind] += 1
        self.recovery_seconds[kind].append(time.monotonic() - start)

    def _restart_and_wait(self, workers: list[int], timeout: float) -> None:
        for worker in workers:
            self.cluster.start(worker)
        names = {f"worker-{worker}" for worker in workers}

        def rejoined() -> bool:
            for worker in workers:
                if self.cluster.processes[worker].poll() is not None:
                    log = (self.cluster.run_dir / f"worker-{worker}.log").read_text(errors="replace")
                    raise RuntimeError(f"worker-{worker} exited while rejoining: {log.strip().splitlines()[-1]}")
            return self.rejoined(names)

        self.wait(rejoined, timeout, f"{sorted(names)} to rejoin")

    def in_quorum(self, timeout: float) -> list[int]:
        """Running workers the lighthouse has in its quorum (waits, bounded, for at least one)."""
        found: list[int] = []

        def some() -> bool:
            alive = self.members("alive") or set()
            found[:] = [w for w in self.cluster.alive() if f"worker-{w}" in alive]
            return bool(found)

        self.wait(some, timeout, "a worker in the quorum")
        return found

    def worker_kill(self, timeout: float) -> None:
        """SIGKILL one worker of the quorum and start it again."""
        worker = self.rng.choice(self.in_quorum(timeout))
        process = self.cluster.processes[worker]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        self._restart_and_wait([worker], timeout)

    def worker_stop(self, timeout: float) -> None:
        """SIGSTOP one worker until the lighthouse excludes it, then let it go on (it rejoins)."""
        worker = self.rng.choice(self.in_quorum(timeout))
        name = f"worker-{worker}"
        self.cluster.kill(worker, "STOP", self.committed())
        try:
            self.wait(lambda: self.gone({name}), timeout, f"{name} to be excluded")
        finally:
            self.cluster.revive(worker)
        self.wait(lambda: self.rejoined({name}), timeout, f"{name} to rejoin")

    def fleet_restart(self, timeout: float) -> None:
        """SIGKILL every worker, then start them all again: the job resumes from its checkpoint."""
        self.wait(lambda: bool(self.lighthouse.status().get("checkpoint")), timeout, "a checkpoint to resume from")
        for worker, process in self.cluster.processes.items():
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=60)
            self.cluster.stopped.discard(worker)
        names = {f"worker-{worker}" for worker in range(self.workers)}
        self.wait(lambda: self.gone(names), timeout, "the lighthouse to see the fleet gone")
        self._restart_and_wait(list(range(self.workers)), timeout)

    def lighthouse_restart(self, timeout: float) -> None:
        """SIGKILL the lighthouse and start it again on its state file."""
        self.lighthouse.kill()
        self.lighthouse.start()
        self.wait(lambda: bool(self.lighthouse.status()), timeout, "the lighthouse to answer again")

    def database_failure(self, timeout: float) -> None:
        """Hold the lighthouse's SQLite file locked (its writes fail meanwhile), then let go."""
        connection = sqlite3.connect(self.lighthouse.state, timeout=timeout, isolation_level=None)
        try:
            connection.execute("BEGIN EXCLUSIVE")
            time.sleep(DATABASE_LOCK_SECONDS)
            connection.execute("COMMIT")
        finally:
            connection.close()


def soak(failures: int, workers: int, checkpoint_every: int, seed: int, timeout: float) -> dict[str, Any]:
    """Run the soak; returns the report (see ``--report``)."""
    console = make_console()
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="stalwart-chaos-"))
    steps = 4 * failures + 20
    lighthouse = Lighthouse(root / "lighthouse.sqlite", workers)
    lighthouse.start()
    args = [
        "--max-steps", str(steps), "--max-microbatch", "16", "--collective-timeout", str(HEARTBEAT_TIMEOUT),
        "--checkpoint-dir", str(root / "checkpoints"), "--checkpoint-every", str(checkpoint_every),
    ]  # fmt: skip
    cluster = LocalCluster(lighthouse.url, root / "run", args, preloaded=False)  # relaunches pay a start
    chaos = Soak(lighthouse, cluster, workers, rng)
    schedule = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, failures - len(KINDS)))]
    rng.shuffle(schedule)
    deadline = time.monotonic() + timeout
    error = None
    try:
        for worker in range(workers):
            cluster.start(worker)
        chaos.wait(lambda: chaos.committed() >= 2, 300, "the first steps")
        with progress_display(console) as progress:
            task = progress.add_task("failures", total=len(schedule))
            for kind in schedule:
                if time.monotonic() > deadline:
                    error = f"stopped after {timeout:.0f} s"
                    break
                progress.update(task, description=f"{kind} (step {chaos.committed()})")
                chaos.inject(kind, recovery_timeout=300)
                progress.advance(task)
        cluster.release()
        chaos.wait(lambda: not cluster.running(), max(60.0, deadline - time.monotonic()), "the job to finish")
    except (TimeoutError, RuntimeError) as failed:
        error = str(failed)
    finally:
        cluster.terminate()
        status = lighthouse.status()
        lighthouse.kill()
    records = committed_steps(cluster.run_dir)
    exactly_once, trained_twice, lost = audit_steps(PLAN, records)
    lost += sum(planned_total(PLAN, step) for step in range(len(records), steps))
    reference, _ = reference_run(PLAN, steps)
    finals = sorted(cluster.run_dir.glob("final-*.pt"))
    diff = max(
        (
            float((torch.load(path, weights_only=True)[name] - value).abs().max())
            for path in finals
            for name, value in reference.items()
        ),
        default=None,
    )
    return {
        "failures_injected": dict(chaos.injected),
        "failures_survived": sum(chaos.survived.values()),
        "samples_lost": lost,
        "samples_trained_twice": trained_twice,
        "exactly_once": exactly_once and lost == 0,
        "steps": steps,
        "steps_committed": len(records),
        "workers_finished": len(finals),
        "max_param_diff_vs_reference": diff,
        "checkpoint_resumes": status.get("counts", {}).get("checkpoint_resumes", 0),
        "recovery_seconds_median": {
            kind: sorted(times)[len(times) // 2] for kind, times in chaos.recovery_seconds.items() if times
        },
        "error": error,
        "run_directory": str(root),
    }


def main() -> None:
    """Parse arguments, run the soak, print the table and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=200, help="Failures to inject (default 200).")
    parser.add_argument("--workers", type=int, default=3, help="Worker processes (default 3).")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="Steps between checkpoints (default 5).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the failure schedule.")
    parser.add_argument("--timeout", type=float, default=5400.0, help="Give up after this many seconds.")
    parser.add_argument("--report", type=Path, default=None, help="Write the report as JSON here.")
    parser.add_argument("--quick", action="store_true", help="A short run: 10 failures.")
    args = parser.parse_args()
    if args.failures < 1 or args.workers < 2 or args.checkpoint_every < 1:
        parser.error("--failures >= 1, --workers >= 2 and --checkpoint-every >= 1 are required")
    report = soak(10 if args.quick else args.failures, args.workers, args.checkpoint_every, args.seed, args.timeout)
    console = make_console()
    injected = report["failures_injected"]
    rows = [
        [kind, str(injected.get(kind, 0)), f"{report['recovery_seconds_median'].get(kind, 0):.2f}"] for kind in KINDS
    ]
    print_table(console, "chaos soak: failures injected", ["kind", "injected", "median recovery s"], rows)
    diff = report["max_param_diff_vs_reference"]
    summary = [
        ["failures injected / survived", f"{sum(injected.values())} / {report['failures_survived']}"],
        ["steps committed / planned", f"{report['steps_committed']} / {report['steps']}"],
        ["samples lost", str(report["samples_lost"])],
        ["samples trained twice", str(report["samples_trained_twice"])],
        ["max |param - reference|", "-" if diff is None else f"{diff:.2e}"],
        ["checkpoint resumes", str(report["checkpoint_resumes"])],
        ["error", report["error"] or "-"],
    ]
    print_table(console, "chaos soak: outcome", ["what", "value"], summary)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2), encoding="utf-8")
    ok = report["error"] is None and report["samples_lost"] == 0 and report["samples_trained_twice"] == 0
    sys.exit(0 if ok and diff is not None and diff < 1e-4 else 1)


if __name__ == "__main__":
    main()
