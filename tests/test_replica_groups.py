"""Replica groups launched by torchrun against a separately started lighthouse.

Two groups of two processes each (one ``torchrun --standalone --nproc-per-node 2``
launch per group) train the digits job; each group's share is split by
intra-group rank. One process of a group is SIGKILLed mid-run: torchrun's
agent ends its sibling, the lighthouse sees the group's leader go, and the
other group finishes the steps alone, computing the lost share. The run must
keep every step's global batch, train each sample exactly once, and end with
the failure-free parameters on every surviving process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import latest_step
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run

STEPS = 24
PLAN = EpochPlan(1797, 48, seed=0, local_batch_multiple=4)
PARAM_TOLERANCE = 1e-4
TIMEOUT = 180.0


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0)
    server.start()
    yield server
    server.stop()


def launch_group(
    url: str, name: str, run_dir: Path, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """One torchrun launch of two worker processes forming replica group ``name``.

    ``extra``: more worker options; ``env``: variables added to the launch's environment.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stalwart.launch.worker", "--lighthouse", url, "--member", name, "--run-dir", str(run_dir),
        "--max-steps", str(STEPS), "--max-microbatch", "4", "--collective-timeout", "1.0", "--step-seconds", "0.25",
        *extra,
    ]  # fmt: skip
    log = open(run_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
    environ = {**os.environ, **(env or {})}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
    log.close()
    return process


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
    """Intra-group rank -> pid of the worker processes torchrun started."""
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


def test_groups_split_shares_and_a_lost_group_is_recomputed(tmp_path: Path, lighthouse: Lighthouse) -> None:
    agents = {name: launch_group(lighthouse.url, name, tmp_path) for name in ("group-a", "group-b")}
    try:
        deadline = time.monotonic() + TIMEOUT
        while latest_step(tmp_path)[0] < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert latest_step(tmp_path)[0] >= 6, "the groups did not start training"
        victim = worker_pids(agents["group-b"])[1]
        os.kill(victim, signal.SIGKILL)
        for agent in agents.values():
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents.values():
            end_group(agent)
    assert agents["group-a"].returncode == 0
    assert agents["group-b"].returncode != 0
    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    world_sizes = [record["world_size"] for record in steps]
    assert world_sizes[0] == 2 and world_sizes[-1] == 1
    reference, _ = reference_run(PLAN, STEPS)
    finals = sorted(tmp_path.glob("final-group-a.*.pt"))
    assert [path.name for path in finals] == ["final-group-a.0.pt", "final-group-a.1.pt"]
    for path in finals:
        parameters = torch.load(path, weights_only=True)
        worst = max(float((parameters[name] - value).abs().max()) for name, value in reference.items())
        assert worst < PARAM_TOLERANCE
