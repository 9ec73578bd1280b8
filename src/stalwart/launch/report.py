"""What a local run did: the committed steps, the audit, recovery times and the comparison.

Each worker appends a line per step it applied (see :mod:`stalwart.launch.worker`).
A step applied by several members appears several times with the same
content; when a step was applied by a member that died before any survivor
had it, the survivors recompute it in a later quorum, so for each step the
record of the highest quorum is the one that counts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.data.audit import coverage
from stalwart.data.plan import EpochPlan


@dataclass
class RunReport:
    """The demo's report; ``to_json()`` is what ``--report`` writes."""

    steps_committed: int
    failures_injected: int
    failures_survived: int
    global_batch_sizes: list[int]
    global_batch_as_planned: bool
    exactly_once: bool
    duplicates: int
    missing: int
    recovery_seconds: list[float]
    losses: list[float]
    world_sizes: list[int]
    final_loss: float | None
    reference_final_loss: float | None = None
    max_param_diff_vs_reference: float | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(asdict(self), indent=2)


def committed_steps(run_dir: Path) -> list[dict[str, Any]]:
    """One record per committed step, in step order (the highest quorum's when recomputed)."""
    best: dict[int, dict[str, Any]] = {}
    for path in sorted(run_dir.glob("steps-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            kept = best.get(record["step"])
            if kept is None or record["quorum_id"] > kept["quorum_id"]:
                best[record["step"]] = record
    return [best[step] for step in sorted(best)]


def audit_steps(plan: EpochPlan, steps: list[dict[str, Any]]) -> tuple[bool, int, int]:
    """Check each epoch's committed positions: exactly the first positions of the epoch, once each.

    Returns (exactly_once, duplicates, missing). A step missing from the
    records counts its samples as missing.
    """
    by_epoch: dict[int, list[list[int]]] = {}
    for record in steps:
        by_epoch.setdefault(record["epoch"], []).append(record["positions"])
    duplicates = missing = 0
    expected_steps = list(range(len(steps)))
    if [record["step"] for record in steps] != expected_steps:
        missing += len(set(expected_steps) - {record["step"] for record in steps})
    for positions in by_epoch.values():
        taken = sum(len(part) for part in positions)
        report = coverage(positions, np.arange(min(taken, plan.epoch_length)))
        duplicates += sum(count - 1 for count in report.duplicates.values())
        missing += len(report.missing)
    return duplicates == 0 and missing == 0, duplicates, missing


def build_report(
    plan: EpochPlan,
    run_dir: Path,
    failures: list[dict[str, Any]],
    reference: tuple[dict[str, torch.Tensor], list[float]] | None,
) -> RunReport:
    """Assemble the report from the workers' records, the injected failures and the reference run."""
    steps = committed_steps(run_dir)
    exactly_once, duplicates, missing = audit_steps(plan, steps)
    times = [record["time"] for record in steps]
    recovery = []
    for failure in failures:
        after = [t for t in times if t > failure["time"]]
        if after:
            recovery.append(round(min(after) - failure["time"], 4))
    report = RunReport(
        steps_committed=len(steps),
        failures_injected=len(failures),
        failures_survived=len(recovery),
        global_batch_sizes=[record["samples"] for record in steps],
        global_batch_as_planned=all(record["samples"] == planned_total(plan, record["step"]) for record in steps),
        exactly_once=exactly_once,
        duplicates=duplicates,
        missing=missing,
        recovery_seconds=recovery,
        losses=[record["loss"] for record in steps],
        world_sizes=[record["world_size"] for record in steps],
        final_loss=steps[-1]["loss"] if steps else None,
        failures=failures,
    )
    if reference is not None:
        parameters, losses = reference
        report.reference_final_loss = losses[-1] if losses else None
        diffs = [
            max(
                float((torch.load(path, weights_only=True)[name] - value).abs().max())
                for name, value in parameters.items()
            )
            for path in sorted(run_dir.glob("final-*.pt"))
        ]
        report.max_param_diff_vs_reference = max(diffs) if diffs else None
    return report


def planned_total(plan: EpochPlan, step: int) -> int:
    """The samples of global step ``step`` in a run whose steps all follow the plan (no re-queued steps)."""
    return plan.step_total(step % plan.steps_per_epoch)


def plot_report(report: RunReport, path: Path) -> None:
    """Write a PNG of the loss and the world size per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(9, 4.5))
    steps = range(len(report.losses))
    loss_axis.plot(steps, report.losses, color="tab:blue", label="loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    world_axis = loss_axis.twinx()
    world_axis.step(steps, report.world_sizes, where="post", color="tab:red", label="world size")
    world_axis.set_ylabel("world size", color="tab:red")
    world_axis.set_ylim(0, max(report.world_sizes, default=1) + 1)
    loss_axis.set_title(
        f"{report.steps_committed} steps, {report.failures_injected} failures, exactly once: {report.exactly_once}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
