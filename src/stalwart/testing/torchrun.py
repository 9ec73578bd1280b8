"""A replica group the tests and benchmarks can SIGKILL and relaunch: one ``torchrun`` launch
(:class:`TorchrunGroup`), or its processes forked from the preloaded forkserver with the environment torchrun
gives them (:class:`ForkedGroup`: torch is imported already, and no agent interpreter starts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from stalwart.launch.processes import ForkedWorker
from stalwart.testing.loopback import HOST, free_port
from stalwart.testing.procfs import stat_fields

POLL_INTERVAL = 0.05
"""How often :meth:`ForkedGroup.wait` looks at its processes."""


def child_pids(parent: int) -> list[int]:
    """The live processes whose parent is ``parent``, in pid order (Linux ``/proc``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(stat_fields(int(entry.name))[1]) == parent:
                pids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(pids)


class TorchrunGroup:
    """``command`` (a ``torchrun`` command line) started in a session of its own, its output appended to
    ``log_path``: the agent, and the workers it starts (its children)."""

    def __init__(self, command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        with open(log_path, "ab") as log:
            self.agent = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else dict(env),
            )

    def worker_pids(self) -> dict[int, int]:
        """The worker processes the agent started, numbered in pid order (empty before they start)."""
        return dict(enumerate(child_pids(self.agent.pid)))

    def poll(self) -> int | None:
        return self.agent.poll()

    def wait(self, timeout: float) -> int:
        return self.agent.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the workers (torchrun may start them in sessions of their own), then the agent's session."""
        for pid in self.worker_pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.agent.pid, signal.SIGKILL)


def torchrun_environment(rank: int, world_size: int, master_port: int, run_id: str) -> dict[str, str]:
    """The variables ``torchrun --standalone`` gives process ``rank`` of ``world_size`` on one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": "1",
    }


class ForkedGroup:
    """``processes`` processes running ``entry`` (``MODULE:FUNCTION``, reading ``argv`` from ``sys.argv``), forked
    from the preloaded forkserver with the environment torchrun would give them, their output appended to
    ``log_path``; used as :class:`TorchrunGroup` is.

    Why: a torchrun launch costs an agent interpreter and, in each worker, torch's import (some 3.5 s of CPU
    together for a group of one), which the tests that launch many short groups pay again and again. Like
    torchrun, once a process ends with an error the others are killed and the group's status is that error.
    What torch reads at import (``OMP_NUM_THREADS``) has the forkserver's values: ``entry`` applies it.
    """

    def __init__(self, entry: str, processes: int, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be a positive int, got {processes!r}")
        port, run_id = free_port(), uuid.uuid4().hex
        self.workers = [
            ForkedWorker(argv, {**env, **torchrun_environment(rank, processes, port, run_id)}, log_path, entry)
            for rank in range(processes)
        ]

    def worker_pids(self) -> dict[int, int]:
        return {rank: worker.pid for rank, worker in enumerate(self.workers)}

    def poll(self) -> int | None:
        """0 once every process ended well; the first error (after killing the rest) once one did not; else None."""
        codes = [worker.poll() for worker in self.workers]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            self.kill()
            return failed
        return 0 if all(code == 0 for code in codes) else None

    def wait(self, timeout: float) -> int:
        """:meth:`poll`'s status once there is one; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.workers[0].args, timeout)
            time.sleep(POLL_INTERVAL)
        for worker in self.workers:  # reaped: every process has ended (the rest were killed)
            worker.wait(timeout=max(deadline - time.monotonic(), 1.0))
        return code

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()
