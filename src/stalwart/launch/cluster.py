"""A local cluster: worker processes on this machine, and a chaos schedule that kills them.

Failures are real: the schedule sends SIGKILL or SIGSTOP to a worker process
when the job reaches a step (``--kill STEP:WORKER``) or at random times with a
mean time between failures (``--mtbf``). A killed worker is started again
after ``restart_after`` seconds with the same member name (it rejoins and is
healed); a stopped one is sent SIGCONT (it finds itself excluded, rejoins and
is healed).

Workers get ``--hold-file RUN_DIR/hold``: :meth:`LocalCluster.hold` makes them
wait before their next step and :meth:`LocalCluster.release` lets them go, so
a driver can keep the job alive until a restarted worker has asked to rejoin,
however long its start-up takes on a busy machine.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.launch.processes import ForkedWorker

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
HOLD_FILE = "hold"
_KILL_ITEM = re.compile(r"(\d+):(\d+)")


@dataclass(frozen=True)
class PlannedKill:
    """Kill worker ``worker`` once the job has committed ``step`` steps."""

    step: int
    worker: int


def parse_kills(text: str, workers: int, steps: int | None = None) -> list[PlannedKill]:
    """Parse ``STEP:WORKER,...`` (workers from 0, steps below ``steps``); ``ValueError`` names the bad item."""
    kills = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _KILL_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"expected STEP:WORKER items separated by commas (e.g. 30:1,60:2), got {item!r}")
        step, worker = int(match[1]), int(match[2])
        if worker >= workers:
            raise ValueError(f"worker {worker} in {item!r} is not one of the {workers} workers (0 to {workers - 1})")
        if steps is not None and step >= steps:
            raise ValueError(f"step {step} in {item!r} is past the run's last step {steps - 1}")
        kills.append(PlannedKill(step, worker))
    return sorted(kills, key=lambda kill: kill.step)


class LocalCluster:
    """Starts, kills and restarts ``python -m stalwart.launch.worker`` processes.

    ``worker_env(N)``, when given, is added to worker N's environment at every
    start (e.g. ``CUDA_VISIBLE_DEVICES``, so that it takes its own GPU).
    ``preloaded``: fork workers from one interpreter that imported torch once
    (:mod:`~stalwart.launch.processes`; about 1.3 s of CPU less per start);
    False starts a fresh interpreter each time, as a relaunch on a new machine
    does (benchmarks that measure recovery).
    """

    def __init__(
        self,
        lighthouse_url: str,
        run_dir: Path,
        worker_args: list[str],
        worker_env: Callable[[int], Mapping[str, str]] | None = None,
        preloaded: bool = True,
    ) -> None:
        self.lighthouse_url = lighthouse_url
        self.run_dir = run_dir
        self.worker_args = worker_args
        self.worker_env = worker_env
        self.preloaded = preloaded
        self.processes: dict[int, subprocess.Popen[bytes] | ForkedWorker] = {}
        self.stopped: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        run_dir.mkdir(parents=True, exist_ok=True)
        self.hold_file = run_dir / HOLD_FILE

    def start(self, worker: int, extra_args: list[str] | None = None) -> None:
        """Start worker ``worker`` (member ``worker-N``), logging to ``RUN_DIR/worker-N.log``."""
        argv = [
            "--lighthouse", self.lighthouse_url,
            "--member", f"worker-{worker}",
            "--run-dir", str(self.run_dir),
            "--hold-file", str(self.hold_file),
            *self.worker_args,
            *(extra_args or []),
        ]  # fmt: skip
        env = {**os.environ, **(self.worker_env(worker) if self.worker_env is not None else {})}
        log_path = self.run_dir / f"worker-{worker}.log"
        if self.preloaded:
            self.processes[worker] = ForkedWorker(argv, env, log_path)
            return
        command = [sys.executable, "-m", "stalwart.launch.worker", *argv]
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            self.processes[worker] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill(self, worker: int, signal_name: str, step: int) -> None:
        """Send ``signal_name`` (KILL or STOP) to a worker and record the failure."""
        process = self.processes[worker]
        if process.poll() is not None or worker in self.stopped:
            return
        process.send_signal(SIGNALS[signal_name])
        if signal_name == "STOP":
            self.stopped.add(worker)
        self.failures.append({"worker": worker, "signal": signal_name, "step": step, "time": time.time()})

    def revive(self, worker: int) -> bool:
        """Bring a failed worker back: SIGCONT if stopped, else start it again; False if it was running."""
        if worker in self.stopped:
            self.stopped.discard(worker)
            self.processes[worker].send_signal(signal.SIGCONT)
            how = "SIGCONT"
        elif self.processes[worker].poll() is not None:
            self.start(worker)
            how = "restart"
        else:
            return False
        self.restarts.append({"worker": worker, "how": how, "time": time.time(), "pid": self.processes[worker].pid})
        return True

    def hold(self, from_step: int = 0) -> None:
        """Make the workers wait before any step >= ``from_step`` until :meth:`release`."""
        self.hold_file.write_text(str(from_step), encoding="utf-8")

    def release(self) -> None:
        """Let held workers go on."""
        self.hold_file.unlink(missing_ok=True)

    def alive(self) -> list[int]:
        """Workers whose process is running and not stopped."""
        return [w for w, p in self.processes.items() if p.poll() is None and w not in self.stopped]

    def running(self) -> bool:
        """True while any worker process exists (stopped ones included)."""
        return any(process.poll() is None for process in self.processes.values())

    def terminate(self) -> None:
        """Stop every worker (used on errors and timeouts)."""
        for worker, process in self.processes.items():
            if process.poll() is None:
                if worker in self.stopped:
                    process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(timeout=10)


def latest_step(run_dir: Path) -> tuple[int, float | None, int]:
    """(steps committed, last loss, world size) read from the workers' step records."""
    best: tuple[int, float | None, int] = (0, None, 0)
    for path in run_dir.glob("steps-*.jsonl"):
        lines = path.read_bytes().splitlines()
        for line in reversed(lines[-2:]):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["step"] + 1 > best[0]:
                best = (record["step"] + 1, record["loss"], record["world_size"])
            break
    return best


def worker_events(run_dir: Path, worker: int) -> list[dict[str, Any]]:
    """The life events worker ``worker`` recorded (see :mod:`stalwart.launch.worker`), oldest first."""
    return read_records(run_dir / f"events-worker-{worker}.jsonl")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``, oldest first ([] if it is missing; a torn last line, from a killed writer, is
    skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_status(url: str, token: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """The lighthouse's ``GET /v1/status`` JSON (``OSError`` when it does not answer)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url.rstrip("/") + "/v1/status", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        status: dict[str, Any] = json.loads(response.read())
    return status


def random_kill_times(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    """Failure times (seconds from the start) of a Poisson process with mean gap ``mtbf``, up to ``horizon``."""
    times: list[float] = []
    now = rng.expovariate(1 / mtbf)
    while now < horizon and len(times) < 1000:
        times.append(now)
        now += rng.expovariate(1 / mtbf)
    return times
