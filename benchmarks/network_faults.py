"""Network-fault benchmark: what each fault real networks have does to a running job (issue 36's table).

Run from the repository root, as root (network namespaces), with the virtual environment active::

    python -m benchmarks.network_faults            # every fault at the issue's durations: about 6 min on 2 busy cores
    python -m benchmarks.network_faults --quick    # shorter faults: about 3 min
    python -m benchmarks.network_faults --faults silent_partition,slow_link

Each row is one run of the digits job on a private bridge
(:mod:`stalwart.testing.network`): the real lighthouse and three real
workers, each in its own network namespace, with the issue's settings
(``--collective-timeout 1``; ``--min-replicas 2 --heartbeat-timeout 1
--join-timeout 5``). Once all three have committed ``FAULT_AT`` steps in one
quorum the fault goes in and the job runs freely; after the fault's duration
it is healed and the run measures until all three commit a step together
again (bounded by ``BACK_LIMIT``), then the run is stopped. Columns:

- *to next commit*: seconds from the fault to the next step the job commits;
- *steps during*: steps committed while the fault lasted (SIGTERM: in the
  ``duration`` after the signal);
- *heal to back*: seconds from the heal to the first step all three commit together;
- *failures*: failures the lighthouse counted (``/v1/status``) since the fault;
- *retrained*: samples of failed members handed to survivors
  (``stalwart_samples_reassigned_total``) since the fault.

The benchmark reports; it never fails because a number is off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Column

from benchmarks._measure import Goal, machine_line, make_console, print_goals, print_table, run_directory
from stalwart.testing.network.job import (
    FAULTS,
    LIGHTHOUSE,
    START_TIMEOUT,
    WORKERS,
    FaultTimeline,
    NetworkJob,
    commits_after,
    inject_fault,
    member_of,
)
from stalwart.testing.network.netns import Bridge, unavailable_reason
from stalwart.testing.waiting import wait_until

FAULT_AT = 5
STEPS = 5000
"""The job's ``--max-steps``: more than any run commits (it is stopped once measured)."""
STEP_SECONDS = 0.2
"""Simulated compute per step: about the 0.26 s steps the issue measured its figures on."""
BACK_LIMIT = 90.0
"""Seconds after the heal a run waits for the three workers to commit together again."""
EVERYONE = [member_of(node) for node in WORKERS]
BACK_GOAL = 3.0
"""Issue 36: a member whose link comes back is in the quorum within this many seconds."""
NEXT_COMMIT_GOAL = 15.0
"""Issue 36: under a one-sided partition the majority commits its next step within this many seconds."""
SLOW_STEPS_GOAL = 10
"""Issue 36: steps committed during 20 s at 128 kbit/s."""


@dataclass(frozen=True)
class Row:
    """One fault of the table, how long it lasts (full and ``--quick``), and the issue's goal for it."""

    name: str
    label: str
    fault: str
    seconds: float
    quick_seconds: float
    goal: str
    extra: tuple[str, ...] = ()


ROWS = (
    Row("nic_down", "worker 1's NIC down", "nic_down", 10.0, 4.0, "back in the quorum <= 3 s"),
    Row(
        "asymmetric_w2",
        "worker 2 cut from peers (one-sided)",
        "asymmetric_w2",
        20.0,
        10.0,
        "majority kept, next commit <= 15 s",
    ),
    Row(
        "asymmetric_w0",
        "worker 0 cut from peers (one-sided)",
        "asymmetric_w0",
        20.0,
        10.0,
        "majority kept, next commit <= 15 s",
    ),
    Row(
        "silent_partition",
        "silent partition, worker 2 from peers",
        "silent_partition",
        60.0,
        15.0,
        "steps committed during it",
    ),
    Row("slow_link", "worker 2's link at 128 kbit/s", "slow_link", 20.0, 20.0, ">= 10 steps in 20 s"),
    Row("lighthouse_down", "lighthouse's link down", "lighthouse_down", 10.0, 5.0, "0 failures counted"),
    Row("sigterm", "SIGTERM to worker 2", "sigterm", 10.0, 5.0, "0 samples retrained"),
    Row(
        "parity_nic_down",
        "worker 1's NIC down, Parity(2,1) state",
        "nic_down",
        10.0,
        4.0,
        "back in the quorum <= 3 s",
        ("--parity", "2,1"),
    ),
)
ROW_NAMES = [row.name for row in ROWS]


@dataclass
class Measured:
    """One row's figures (None: it did not happen within the run's bounds)."""

    row: Row
    seconds: float
    to_next_commit: float | None
    steps_during: int
    majority_kept: bool
    heal_to_back: float | None
    failures: int
    retrained: float
    note: str = ""


def measure(row: Row, seconds: float, run_dir: Path) -> Measured:
    """Run the job through ``row``'s fault for ``seconds`` and measure it (every wait bounded)."""
    fault = FAULTS[row.fault]
    with Bridge([LIGHTHOUSE, *WORKERS]) as bridge:
        job = NetworkJob(bridge, run_dir, STEPS, STEP_SECONDS, extra=row.extra)
        job.start(hold_at=FAULT_AT)
        job.wait_committed(FAULT_AT, START_TIMEOUT)
        job.wait_in_quorum(EVERYONE, START_TIMEOUT, "every worker in one quorum before the fault")
        timeline = inject_fault(job, fault, duration=seconds)
        end = timeline.healed if timeline.healed is not None else timeline.injected + seconds
        back = _wait_back(job, end) if timeline.healed is not None else None
        next_commit = _first_commit_after(job, timeline.injected, end + BACK_LIMIT)
        status = job.status()
        (run_dir / "status.json").write_text(json.dumps(status, indent=1))  # the quorums and failures, to read after
        failures = len(status["failures"]) - timeline.failures_before
        retrained = job.metric("stalwart_samples_reassigned_total") - timeline.reassigned_before
        return _figures(row, seconds, job, timeline, end, next_commit, back, failures, retrained)


def _wait_back(job: NetworkJob, healed: float) -> float | None:
    """Seconds from ``healed`` to the first step the three workers committed together (None within BACK_LIMIT)."""

    def together() -> float | None:
        for record in commits_after(job.run_dir, healed):
            if record["world_size"] == len(WORKERS):
                return float(record["time"])
        return None

    try:
        return wait_until(together, BACK_LIMIT, "the three workers committing together") - healed
    except AssertionError:
        return None


def _first_commit_after(job: NetworkJob, since: float, until: float) -> float | None:
    """Seconds from ``since`` to the first step committed after it (waiting, bounded, until ``until``)."""
    try:
        first = wait_until(
            lambda: next(iter(commits_after(job.run_dir, since)), None), max(0.1, until - time.time()), "a commit"
        )
    except AssertionError:
        return None
    return float(first["time"]) - since


def _figures(
    row: Row,
    seconds: float,
    job: NetworkJob,
    timeline: FaultTimeline,
    end: float,
    next_commit: float | None,
    back: float | None,
    failures: int,
    retrained: float,
) -> Measured:
    during = [record for record in commits_after(job.run_dir, timeline.injected) if record["time"] < end]
    victim = FAULTS[row.fault].victim
    kept = bool(during) and victim is not None and all(record["member"] != member_of(victim) for record in during)
    exits = {node: process.poll() for node, process in job.workers.items()}
    note = ", ".join(f"{node} exited {code}" for node, code in exits.items() if code not in (None, 0))
    return Measured(row, seconds, next_commit, len(during), kept, back, failures, retrained, note)


def _goal_met(measured: Measured) -> bool:
    """Whether ``measured`` meets its row's goal (the issue's)."""
    name = measured.row.name
    if name in ("nic_down", "parity_nic_down"):
        return measured.heal_to_back is not None and measured.heal_to_back <= BACK_GOAL
    if name.startswith("asymmetric"):
        return (
            measured.majority_kept
            and measured.to_next_commit is not None
            and measured.to_next_commit <= NEXT_COMMIT_GOAL
        )
    if name == "silent_partition":
        return measured.steps_during > 0
    if name == "slow_link":
        return measured.steps_during >= SLOW_STEPS_GOAL * measured.seconds / 20.0
    if name == "lighthouse_down":
        return measured.failures == 0
    return measured.retrained == 0


def _seconds(value: float | None, limit: str) -> str:
    """``value`` in seconds, or ``> limit`` when it did not happen within the run's bound."""
    return f"> {limit}" if value is None else f"{value:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every fault asked for and print the table and the goals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Shorter faults (the slow link keeps its 20 s).")
    parser.add_argument(
        "--faults",
        type=_fault_names,
        default=list(ROW_NAMES),
        help=f"Comma-separated rows to run (default: all): {', '.join(ROW_NAMES)}.",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="Keep the runs' records and logs here.")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        parser.error(f"this benchmark runs processes in network namespaces: {reason}")
    console = make_console()
    machine_line(console, args.quick)
    results: list[Measured] = []
    with run_directory(args.run_dir, "stalwart-network-faults-") as root:
        for row in (row for row in ROWS if row.name in args.faults):
            seconds = row.quick_seconds if args.quick else row.seconds
            console.print(f"{row.label} for {seconds:g} s", highlight=False)
            results.append(measure(row, seconds, root / row.name))
    rows = [
        [
            result.row.label,
            f"{result.seconds:g}",
            _seconds(result.to_next_commit, "the run"),
            _steps_during(result),
            _back(result),
            str(result.failures),
            f"{result.retrained:.0f}",
            result.row.goal,
            "met" if _goal_met(result) else "MISSED",
            result.note,
        ]
        for result in results
    ]
    print_table(
        console,
        "Network faults: the digits job, a lighthouse and 3 workers in network namespaces",
        [
            Column("fault"),
            "fault (s)",
            "to next commit",
            "steps during",
            "heal to back",
            "failures",
            "retrained",
            Column("goal"),
            Column("goal met"),
            Column("note"),
        ],
        rows,
        caption="steps during: committed while the fault lasted ('victim too': the cut-off worker was in a quorum "
        "that committed); heal to back: the heal to the first step the three commit together; failures: counted "
        "by the lighthouse; retrained: samples of failed members handed to survivors.",
    )
    print_goals(console, [Goal(f"{r.row.label}: {r.row.goal}", _goal_met(r), _detail(r)) for r in results])
    return 0


def _back(result: Measured) -> str:
    """Seconds from the heal to back in the quorum ('-' for SIGTERM, which has no heal)."""
    return "-" if result.row.fault == "sigterm" else _seconds(result.heal_to_back, f"{BACK_LIMIT:g} s")


def _steps_during(result: Measured) -> str:
    """The steps committed during the fault; ' (victim too)' where the cut-off worker committed some of them."""
    victim_matters = result.row.name.startswith(("nic", "parity", "asymmetric", "silent"))
    victim_committed = victim_matters and result.steps_during > 0 and not result.majority_kept
    return f"{result.steps_during}{' (victim too)' if victim_committed else ''}"


def _detail(result: Measured) -> str:
    back = _back(result)
    return (
        f"next commit {_seconds(result.to_next_commit, 'the run')}, {result.steps_during} steps during, back {back}, "
        f"{result.failures} failures, {result.retrained:.0f} retrained"
    )


def _fault_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROW_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--faults must name rows among {', '.join(ROW_NAMES)}; got {text!r}")
    return names


if __name__ == "__main__":
    sys.exit(main())
