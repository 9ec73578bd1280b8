"""A local cluster: worker processes on this machine, and a chaos schedule that kills them.

Failures are real: the schedule sends SIGKILL or SIGSTOP to a worker process
when the job reaches a step (``--kill STEP:WORKER``) or at random times with a
mean time between failures (``--mtbf``). A killed worker is started again
after ``restart_after`` seconds with the same member name (it rejoins and is
healed); a stopped one is sent SIGCONT (it finds itself excluded, rejoins and
is healed).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True)
class PlannedKill:
    """Kill worker ``worker`` once the job has committed ``step`` steps."""

    step: int
    worker: int


def parse_kills(text: str, workers: int) -> list[PlannedKill]:
    """Parse ``STEP:WORKER,...``; workers are numbered from 0."""
    kills = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        step_text, _, worker_text = item.partition(":")
        if not (step_text.isdigit() and worker_text.isdigit()) or int(worker_text) >= workers:
            raise ValueError(f"--kill items must be STEP:WORKER with WORKER in [0, {workers - 1}], got {item!r}")
        kills.append(PlannedKill(int(step_text), int(worker_text)))
    return sorted(kills, key=lambda kill: kill.step)


class LocalCluster:
    """Starts, kills and restarts ``python -m stalwart.launch.worker`` processes."""

    def __init__(self, lighthouse_url: str, run_dir: Path, worker_args: list[str]) -> None:
        self.lighthouse_url = lighthouse_url
        self.run_dir = run_dir
        self.worker_args = worker_args
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.stopped: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        run_dir.mkdir(parents=True, exist_ok=True)

    def start(self, worker: int, extra_args: list[str] | None = None) -> None:
        """Start worker ``worker`` (member ``worker-N``), logging to ``RUN_DIR/worker-N.log``."""
        command = [
            sys.executable, "-m", "stalwart.launch.worker",
            "--lighthouse", self.lighthouse_url,
            "--member", f"worker-{worker}",
            "--run-dir", str(self.run_dir),
            *self.worker_args,
            *(extra_args or []),
        ]  # fmt: skip
        log = open(self.run_dir / f"worker-{worker}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.processes[worker] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, worker: int, signal_name: str, step: int) -> None:
        """Send ``signal_name`` (KILL or STOP) to a worker and record the failure."""
        process = self.processes[worker]
        if process.poll() is not None or worker in self.stopped:
            return
        process.send_signal(SIGNALS[signal_name])
        if signal_name == "STOP":
            self.stopped.add(worker)
        self.failures.append({"worker": worker, "signal": signal_name, "step": step, "time": time.time()})

    def revive(self, worker: int) -> None:
        """Bring a failed worker back: SIGCONT if stopped, else start it again."""
        if worker in self.stopped:
            self.stopped.discard(worker)
            self.processes[worker].send_signal(signal.SIGCONT)
        elif self.processes[worker].poll() is not None:
            self.start(worker)

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


def random_kill_times(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    """Failure times (seconds from the start) of a Poisson process with mean gap ``mtbf``, up to ``horizon``."""
    times: list[float] = []
    now = rng.expovariate(1 / mtbf)
    while now < horizon and len(times) < 1000:
        times.append(now)
        now += rng.expovariate(1 / mtbf)
    return times
