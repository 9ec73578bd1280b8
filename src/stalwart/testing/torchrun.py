"""One ``torchrun`` launch as a replica group the tests and benchmarks can SIGKILL and relaunch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from stalwart.testing.procfs import stat_fields


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
