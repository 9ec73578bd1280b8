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
from typing import Any, Literal

import numpy as np
import torch

from stalwart.data.audit import AuditWriter, coverage
from stalwart.data.plan import EpochPlan
from stalwart.runtime.consistency import index_checksum


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
    loader_audit_mismatches: int
    """Committed steps whose samples, as the loaders produced them (the quorum's reduced checksum), are not the
    plan's samples for the step (recomputed from the plan here, not taken from the ledger)."""
    recovery_seconds: list[float]
    losses: list[float]
    world_sizes: list[int]
    final_loss: float | None
    reference_final_loss: float | None = None
    max_param_diff_vs_reference: float | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    rejoins: int = 0
    failed_rejoins: list[dict[str, Any]] = field(default_factory=list)
    world_size_history: list[tuple[int, int]] = field(default_factory=list)
    """``(step, world size)`` at the first step and wherever the world size changed."""
    reference_losses: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """Failures, restarts, rejoins, heals and failed rejoins, each with its worker and step."""
    state_bytes_per_worker: list[int] = field(default_factory=list)
    """Sharded optimizer state each finishing worker held (``--overlap``/``--parity``; empty without)."""
    repairs: int = 0
    """Reshards after a change of the quorum, summed over the finishing workers."""
    repair_seconds: float = 0.0
    """Seconds those reshards took, summed over the finishing workers."""
    shards_lost: list[int] = field(default_factory=list)
    """Shards that more failures than the redundancy covers lost (the job stopped)."""

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


def redundancy_figures(run_dir: Path) -> dict[str, Any]:
    """State bytes, repairs and their seconds from the workers' ``finished`` events; shards lost from ``error``."""
    finished: dict[str, dict[str, Any]] = {}
    lost: set[int] = set()
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if event["event"] == "finished" and "state_bytes" in event:
                finished[path.stem] = event
            lost.update(event.get("shards_lost", ()))
    return {
        "state_bytes_per_worker": [event["state_bytes"] for _, event in sorted(finished.items())],
        "repairs": sum(event["repairs"] for event in finished.values()),
        "repair_seconds": round(sum(event["repair_seconds"] for event in finished.values()), 4),
        "shards_lost": sorted(lost),
    }


def build_report(
    plan: EpochPlan,
    run_dir: Path,
    failures: list[dict[str, Any]],
    reference: tuple[dict[str, torch.Tensor], list[float]] | None,
    events: list[dict[str, Any]] | None = None,
) -> RunReport:
    """Assemble the report from the workers' records, the injected failures, the driver's events and the reference.

    A failure's recovery time runs from the signal to the next committed
    step, less the time the driver held the job for a restarted worker.
    ``max_param_diff_vs_reference`` is the largest over every worker that
    finished, restarted and healed ones included.
    """
    events = events or []
    steps = committed_steps(run_dir)
    exactly_once, duplicates, missing = audit_steps(plan, steps)
    times = [record["time"] for record in steps]
    holds = [(event["time"], event["end"]) for event in events if event["kind"] == "hold"]
    recovery = []
    for failure in failures:
        after = [t for t in times if t > failure["time"]]
        if after:
            start, end = failure["time"], min(after)
            held = sum(max(0.0, min(end, hold_end) - max(start, hold_start)) for hold_start, hold_end in holds)
            recovery.append(round(end - start - held, 4))
    report = RunReport(
        **redundancy_figures(run_dir),
        steps_committed=len(steps),
        failures_injected=len(failures),
        failures_survived=len(recovery),
        global_batch_sizes=[record["samples"] for record in steps],
        global_batch_as_planned=all(record["samples"] == planned_total(plan, record["step"]) for record in steps),
        exactly_once=exactly_once,
        duplicates=duplicates,
        missing=missing,
        loader_audit_mismatches=loader_audit_mismatches(plan, steps),
        recovery_seconds=recovery,
        losses=[record["loss"] for record in steps],
        world_sizes=[record["world_size"] for record in steps],
        final_loss=steps[-1]["loss"] if steps else None,
        failures=failures,
        restarts=sum(event["kind"] == "restart" for event in events),
        rejoins=sum(event["kind"] == "rejoin" for event in events),
        failed_rejoins=[
            {"worker": event["worker"], "step": event["step"], "reason": event["reason"]}
            for event in events
            if event["kind"] == "failed_rejoin"
        ],
        world_size_history=world_size_history([record["world_size"] for record in steps]),
        events=events,
    )
    if reference is not None:
        parameters, losses = reference
        report.reference_losses = losses
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


def loader_audit_mismatches(plan: EpochPlan, steps: list[dict[str, Any]]) -> int:
    """How many committed steps' loaded-sample checksums differ from the plan's samples of the step.

    A step record's ``loaded_checksum`` is what the quorum's loaders produced
    (summed in the step's all-reduce); the expectation comes from the plan
    alone, so a ledger that handed out the wrong positions is caught too.
    """
    mismatches = 0
    for record in steps:
        epoch_step = record["step"] % plan.steps_per_epoch
        indices = plan.indices(record["epoch"], plan.step_start(epoch_step), plan.step_start(epoch_step + 1))
        if record.get("loaded_checksum") != f"{index_checksum(record['epoch'], indices):016x}":
            mismatches += 1
    return mismatches


def world_size_history(world_sizes: list[int]) -> list[tuple[int, int]]:
    """``(step, size)`` for the first step and each step whose world size differs from the step before."""
    return [(step, size) for step, size in enumerate(world_sizes) if step == 0 or world_sizes[step - 1] != size]


def write_audit(plan: EpochPlan, directory: Path, steps: list[dict[str, Any]]) -> None:
    """Write the committed steps' samples as an audit directory that ``stalwart audit`` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    with AuditWriter(directory, 0, expected={"plan": plan.to_dict()}) as writer:
        for record in steps:
            positions = np.asarray(record["positions"], dtype=np.int64)
            writer.write(record["epoch"], record["step"], plan.indices_at(record["epoch"], positions))


def planned_total(plan: EpochPlan, step: int) -> int:
    """The samples of global step ``step`` in a run whose steps all follow the plan (no re-queued steps)."""
    return plan.step_total(step % plan.steps_per_epoch)


@dataclass(frozen=True)
class EventMark:
    """How the plot shows one event: a vertical line (failures) or a marker on the world-size axis."""

    kind: str
    step: int
    label: str
    color: str
    line_style: Literal["-", "--", ""] = ""
    marker: str = ""


_FAILURE_STYLES: dict[str, tuple[str, Literal["-", "--"]]] = {"KILL": ("tab:red", "-"), "STOP": ("tab:orange", "--")}
_EVENT_MARKERS = {
    "rejoin": ("tab:green", "^", "rejoin"),
    "heal": ("tab:purple", "o", "heal"),
    "failed_rejoin": ("black", "x", "failed rejoin"),
}


def event_marks(report: RunReport) -> list[EventMark]:
    """The plot's marks for the report's failures (by signal), rejoins, heals and failed rejoins, in order."""
    marks = []
    for event in report.events:
        kind, step = event["kind"], int(event["step"])
        if kind == "failure":
            signal = event.get("signal", "KILL")
            color, style = _FAILURE_STYLES.get(signal, _FAILURE_STYLES["KILL"])
            marks.append(EventMark(kind, step, f"failure (SIG{signal})", color, line_style=style))
        elif kind in _EVENT_MARKERS:
            color, marker, label = _EVENT_MARKERS[kind]
            marks.append(EventMark(kind, step, label, color, marker=marker))
    return marks


def plot_report(report: RunReport, path: Path) -> list[str]:
    """Write a PNG of the loss (and the failure-free reference's), the world size and the events per step.

    Failures are vertical lines (red solid: SIGKILL, orange dashed: SIGSTOP);
    rejoins, heals and failed rejoins are markers on the world-size axis.
    Returns the legend's labels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    figure, loss_axis = plt.subplots(figsize=(10, 5))
    steps = range(len(report.losses))
    handles = [Line2D([], [], color="tab:blue", label="loss")]
    loss_axis.plot(steps, report.losses, color="tab:blue")
    if report.reference_losses:
        loss_axis.plot(range(len(report.reference_losses)), report.reference_losses, color="black", linestyle=":")
        handles.append(Line2D([], [], color="black", linestyle=":", label="loss without failures"))
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    world_axis = loss_axis.twinx()
    world_axis.step(steps, report.world_sizes, where="post", color="tab:green")
    handles.append(Line2D([], [], color="tab:green", label="world size"))
    world_axis.set_ylabel("world size", color="tab:green")
    world_axis.set_ylim(0, max(report.world_sizes, default=1) + 1)
    labels = [str(handle.get_label()) for handle in handles]
    for mark in event_marks(report):
        if mark.line_style:
            loss_axis.axvline(mark.step, color=mark.color, linestyle=mark.line_style, alpha=0.8)
            handle = Line2D([], [], color=mark.color, linestyle=mark.line_style, label=mark.label)
        else:
            level: float = report.world_sizes[min(mark.step, len(report.world_sizes) - 1)] if report.world_sizes else 0
            level += 0.25 if mark.kind == "heal" else 0.0
            world_axis.plot([mark.step], [level], marker=mark.marker, color=mark.color, markersize=9, linestyle="none")
            handle = Line2D([], [], color=mark.color, marker=mark.marker, linestyle="none", label=mark.label)
        if mark.label not in labels:
            handles.append(handle)
            labels.append(mark.label)
    loss_axis.legend(handles=handles, loc="upper right", fontsize="small")
    loss_axis.set_title(
        f"{report.steps_committed} steps, {report.failures_injected} failures, {report.rejoins} rejoins, "
        f"exactly once: {report.exactly_once}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return labels
