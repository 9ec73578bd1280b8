"""Replica groups as torchrun launches: two worker processes per group against a separately started lighthouse."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from stalwart.data.plan import EpochPlan

GROUP_STEPS = 24
GROUP_PLAN = EpochPlan(1797, 48, seed=0, local_batch_multiple=4)
"""The digits job for groups of two: every group's share splits by intra-group rank into multiples of 4."""


def launch_group(
    url: str, name: str, run_dir: Path, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """One torchrun launch of two digits workers forming replica group ``name``, for ``GROUP_STEPS`` steps.

    ``extra``: more worker options; ``env``: variables added to the launch's environment. The log goes to
    ``run_dir/NAME.log``; the agent runs in a session of its own so that :func:`end_group` can end it.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stalwart.launch.worker", "--lighthouse", url, "--member", name, "--run-dir", str(run_dir),
        "--max-steps", str(GROUP_STEPS), "--max-microbatch", "4", "--collective-timeout", "1.0",
        "--step-seconds", "0.25", *extra,
    ]  # fmt: skip
    environ = {**os.environ, **(env or {})}
    with open(run_dir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environ)


def end_group(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launch's workers (torchrun may start them in sessions of their own) and its agent, if running."""
    if agent.poll() is not None:
        return
    for pid in worker_pids(agent).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)


def worker_pids(agent: subprocess.Popen[bytes]) -> dict[int, int]:
    """Intra-group rank -> pid of the worker processes torchrun started (read from ``/proc``)."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == agent.pid:
            rank = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                workers[int(rank)] = int(entry.name)
    return workers
