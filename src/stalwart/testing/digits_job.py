"""The digits job the integration tests run through failures, and the checks of the three promises on its records.

The workers are ``stalwart.launch.worker`` processes of a
:class:`~stalwart.launch.cluster.LocalCluster`; what they leave in the run
directory (committed steps, events, final parameters) is checked here against
the failure-free reference run.

Tolerance: the reference sums each step's per-sample gradients in one pass;
the cluster sums per-member partial sums, in an order that changes with the
quorum. Both are float32 sums of the same terms, so they differ by
re-association only (about 1e-7 relative per step, compounded);
``PARAM_TOLERANCE`` leaves two orders of magnitude above what is observed,
and dropping one member's share of a single step moves the parameters far
beyond it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster, latest_step
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.waiting import wait_until

STEPS = 10
LONG_STEPS = 24
WORKERS = 3
GLOBAL_BATCH = 48
PARAM_TOLERANCE = 1e-4
JOB_TIMEOUT = 150.0
PLAN = EpochPlan(1797, GLOBAL_BATCH, seed=0)


@functools.cache
def reference_parameters(steps: int) -> dict[str, torch.Tensor]:
    """The failure-free parameters after ``steps`` steps of ``PLAN`` (computed once per process; do not modify)."""
    parameters, _ = reference_run(PLAN, steps)
    return parameters


def worker_args(steps: int = STEPS, step_seconds: float = 0.0) -> list[str]:
    """Arguments of every worker; ``step_seconds`` slows steps down so that a test can act between them."""
    return [
        "--max-steps", str(steps), "--max-microbatch", "8", "--collective-timeout", "1.0",
        "--step-seconds", str(step_seconds),
    ]  # fmt: skip


def _worker_logs(cluster: LocalCluster) -> str:
    return "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(cluster.run_dir.glob("*.log")))


def wait_for(cluster: LocalCluster, *, until_step: int | None = None, timeout: float = JOB_TIMEOUT) -> None:
    """Wait (bounded) until the job reached ``until_step`` committed steps, or until every worker exited.

    On the deadline the workers are killed and ``AssertionError`` carries the tail of their logs.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until_step is not None and latest_step(cluster.run_dir)[0] >= until_step:
            return
        if until_step is None and not cluster.running():
            return
        time.sleep(0.05)
    cluster.terminate()
    raise AssertionError(f"job did not get there in {timeout} s; worker logs:\n{_worker_logs(cluster)}")


def check_job(run_dir: Path, reference: dict[str, torch.Tensor], finishers: int, steps_run: int = STEPS) -> float:
    """Assert the three promises on ``run_dir``'s records; return the largest parameter difference to ``reference``."""
    steps = committed_steps(run_dir)
    assert [record["step"] for record in steps] == list(range(steps_run))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(steps_run)]
    exactly_once, duplicates, missing = audit_steps(PLAN, steps)
    assert (exactly_once, duplicates, missing) == (True, 0, 0)
    finals = sorted(run_dir.glob("final-*.pt"))
    assert len(finals) == finishers
    worst = 0.0
    for path in finals:
        parameters = torch.load(path, weights_only=True)
        for name, value in reference.items():
            worst = max(worst, float((parameters[name] - value).abs().max()))
    assert worst < PARAM_TOLERANCE
    return worst


def latest_quorum(lighthouse: Lighthouse) -> int:
    """The id of the lighthouse's latest quorum (0 before the first)."""
    quorums = lighthouse.status()["quorums"]
    return int(quorums[-1]["quorum_id"]) if quorums else 0


def together(lighthouse: Lighthouse, members: Sequence[str], since: int) -> bool:
    """Whether one quorum after ``since`` holds every one of ``members``."""
    quorums = lighthouse.status()["quorums"]
    return any(q["quorum_id"] > since and set(members) <= set(q["members"]) for q in quorums)


def wait_until_together(lighthouse: Lighthouse, members: Sequence[str], cluster: LocalCluster, since: int) -> None:
    """Wait (bounded) until one quorum after ``since`` holds every one of ``members``; the workers are killed if not.

    For a held job whose first restarted worker formed a quorum alone: the
    others asking is not enough, since released before the lighthouse's call
    to a boundary reaches it, it can finish the job alone within one
    heartbeat. A hold never blocks a membership change, so this is reached.
    It fails at once when every worker has exited (they can no longer meet),
    and its error carries the tail of their logs.
    """
    what = f"{list(members)} in one quorum"
    try:
        wait_until(lambda: together(lighthouse, members, since) or not cluster.running(), JOB_TIMEOUT, what)
    except AssertionError as error:
        cluster.terminate()
        raise AssertionError(f"{error}; worker logs:\n{_worker_logs(cluster)}") from None
    if not together(lighthouse, members, since):
        raise AssertionError(f"every worker exited before {what}; worker logs:\n{_worker_logs(cluster)}")
