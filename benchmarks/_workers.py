"""Launching the runtime benchmark's worker processes (:mod:`benchmarks._runtime_workers`) and reading their records.

Shared by the benchmarks that run those workers (runtime, goodput, redundancy):
a group of worker processes with bounded waits, kills and relaunches, and
torchft's lighthouse for the torchft loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._measure import REPO_ROOT
from stalwart.launch.cluster import read_records
from stalwart.launch.processes import ForkedWorker

POLL_S = 0.05
_WORKER_MODULE = "benchmarks._runtime_workers"


def worker_env(local_rank: int | None = None) -> dict[str, str]:
    """A worker's environment: one-thread pools, Gloo and NCCL on the loopback interface, its GPU (``LOCAL_RANK``)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    if sys.platform.startswith("linux"):
        env.update({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
        # A fixed mmap threshold: glibc serves every block of 128 KiB or more by mmap and returns it when freed,
        # so the peak RSS follows the tensors alive, not how the heap fragmented (its threshold otherwise grows
        # to 32 MiB as blocks are freed, and freed tensors below it stay in the process).
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    return env


def wait_for(
    processes: Sequence[subprocess.Popen[bytes] | ForkedWorker], timeout: float, tick: Callable[[], None] = lambda: None
) -> bool:
    """Wait until every process exited (True) or ``timeout`` passed (False); ``tick`` runs between two looks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(process.poll() is not None for process in processes):
            return True
        tick()
        time.sleep(POLL_S)
    return False


class WorkerGroup:
    """The worker processes of one run, logging to ``run_dir``; waits are bounded.

    Each worker is a fresh interpreter, as a user's launcher starts it, unless
    ``forked``: then it is forked from one interpreter that imported torch
    (:class:`~stalwart.launch.processes.ForkedWorker`), for quick runs whose
    start-up figures need not be a user's.
    """

    def __init__(self, run_dir: Path, name: str, world: int, device: str = "cpu", forked: bool = False) -> None:
        self.run_dir = run_dir
        self.name = name
        self.world = world
        self.device = device
        self.forked = forked
        self.launched_at = time.time()
        self.processes: list[subprocess.Popen[bytes] | ForkedWorker] = []

    def start(self, loop: str, model: str, steps: int, rank: int, extra: Sequence[str]) -> None:
        """Start rank ``rank`` of ``loop`` (in place of its earlier process, if any: a relaunch)."""
        arguments = [
            loop,
            "--model", model, "--steps", str(steps), "--rank", str(rank), "--world", str(self.world),
            "--device", self.device, "--out", str(self.run_dir / self.name),
            "--launched-at", repr(self.launched_at), *extra,
        ]  # fmt: skip
        env = worker_env(rank if self.device == "cuda" else None)
        log_path = self.run_dir / f"{self.name}-worker-{rank}.log"
        process: subprocess.Popen[bytes] | ForkedWorker
        if self.forked:
            process = ForkedWorker(arguments, env, log_path, entry=f"{_WORKER_MODULE}:main")
        else:
            with open(log_path, "ab") as log:
                command = [sys.executable, "-m", _WORKER_MODULE, *arguments]
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        if rank < len(self.processes):
            self.processes[rank] = process
        else:
            self.processes.append(process)

    def records(self, rank: int) -> list[dict[str, Any]]:
        """What rank ``rank`` wrote so far."""
        return read_records(self.run_dir / f"{self.name}-worker-{rank}.jsonl")

    def peak_memory_bytes(self) -> list[int]:
        """Each finished worker's peak memory (from its summary)."""
        return [summary["peak_memory_bytes"] for summary in self.summaries()]

    def summaries(self) -> list[dict[str, Any]]:
        """The summaries of the workers that finished (their peak memory and what their loop added)."""
        paths = (self.run_dir / f"{self.name}-worker-{rank}.summary.json" for rank in range(self.world))
        return [json.loads(path.read_text(encoding="utf-8")) for path in paths if path.exists()]

    def wait(self, timeout: float, tick: Callable[[], None] = lambda: None) -> bool:
        """Wait until every process exited (True) or ``timeout`` passed (False: they are killed)."""
        if wait_for(self.processes, timeout, tick):
            return True
        self.kill()
        return False

    def alive(self, rank: int) -> bool:
        """Whether rank ``rank``'s process was started and is running."""
        return rank < len(self.processes) and self.processes[rank].poll() is None

    def kill_one(self, rank: int) -> None:
        """SIGKILL rank ``rank``'s process (a failure) and reap it."""
        process = self.processes[rank]
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=60)

    def kill(self) -> None:
        """SIGKILL every process still running (stopped ones included) and reap it."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(timeout=10)

    def log_tail(self, rank: int, lines: int = 4) -> str:
        """The last lines of rank ``rank``'s log, for error notes."""
        path = self.run_dir / f"{self.name}-worker-{rank}.log"
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def torchft_missing() -> str | None:
    """Why torchft cannot run here (None when it can)."""
    os.environ.setdefault("RUST_LOG", "warn")  # read as torchft loads; else its lighthouse logs each quorum to stderr
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        return f"not run: torchft is not installed ({error.name}); pip install torchft==0.2.0"
    return None


class TorchftLighthouse:
    """torchft's own lighthouse (its Rust server), bound to 127.0.0.1."""

    def __init__(self, min_replicas: int, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 5000) -> None:
        from torchft.coordination import LighthouseServer

        self._server = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.shutdown()
