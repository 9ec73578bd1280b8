"""``stalwart simulate``: run the ledger through epochs with random failures and joins, and audit it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stalwart.data.simulation import SimulationConfig, SimulationResult, StepRecord, planned_steps, simulate

PROGRESS_MIN_STEPS = 2_000


@click.command("simulate")
@click.option("--dataset-size", type=click.IntRange(min=1), required=True, help="Samples in the dataset.")
@click.option(
    "--global-batch", type=click.IntRange(min=1), required=True, help="Samples per step, all workers together."
)
@click.option("--workers", type=click.IntRange(min=1), required=True, help="Members at the start.")
@click.option("--multiple", type=click.IntRange(min=1), default=1, show_default=True, help="local_batch_multiple.")
@click.option("--failures", type=click.IntRange(min=0), default=0, show_default=True, help="Members dying mid-step.")
@click.option("--joins", type=click.IntRange(min=0), default=0, show_default=True, help="New members joining.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the order and events.")
@click.option(
    "--reassign/--requeue",
    default=True,
    show_default=True,
    help="Survivors take a dead member's work in the same step, or it goes first into the next step.",
)
@click.option("--drop-last", is_flag=True, help="Do not train on the tail shorter than a step.")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True, help="Epochs to run.")
@click.option(
    "--max-rows", type=click.IntRange(min=2), default=40, show_default=True, help="Steps listed (first and last)."
)
def simulate_command(
    dataset_size: int,
    global_batch: int,
    workers: int,
    multiple: int,
    failures: int,
    joins: int,
    seed: int,
    reassign: bool,
    drop_last: bool,
    epochs: int,
    max_rows: int,
) -> None:
    """Run the data ledger through epochs with random failures and joins, and check exactly-once coverage.

    Exits with status 1 when an epoch's samples were not trained on exactly
    once, or (with --reassign) a step's total left the schedule.
    """
    if multiple > global_batch:
        raise click.BadParameter(
            f"must be at most --global-batch ({global_batch}), got {multiple}", param_hint="'--multiple'"
        )
    if drop_last and global_batch > dataset_size:
        raise click.BadParameter(
            f"must be at most --dataset-size ({dataset_size}) with --drop-last, got {global_batch}",
            param_hint="'--global-batch'",
        )
    try:
        config = SimulationConfig(
            dataset_size=dataset_size,
            global_batch_size=global_batch,
            workers=workers,
            local_batch_multiple=multiple,
            failures=failures,
            joins=joins,
            seed=seed,
            reassign=reassign,
            drop_last=drop_last,
            epochs=epochs,
        )
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    result = _run_with_progress(config)
    console = Console()
    console.print(_steps_table(result.records, max_rows, config.reassign))
    console.print(_summary_table(result))
    if not result.summary.passed:
        raise SystemExit(1)


def _run_with_progress(config: SimulationConfig) -> SimulationResult:
    """Simulate, with a transient progress bar on stderr when the run is long."""
    planned = planned_steps(config)
    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        *columns, console=Console(stderr=True), transient=True, disable=planned < PROGRESS_MIN_STEPS
    ) as progress:
        task = progress.add_task("simulate", total=planned)
        done = 0

        def advance(_: StepRecord) -> None:
            nonlocal done
            done += 1
            progress.update(task, completed=done, total=max(planned, done))

        return simulate(config, on_step=advance)


def _steps_table(records: Sequence[StepRecord], max_rows: int, reassign: bool) -> Table:
    """One row per step, the first and last ones only when there are more than ``max_rows``.

    With ``reassign`` a total off the schedule is a fault and shows the planned total next to it;
    re-queueing shifts totals by design.
    """
    table = Table(title="steps", title_justify="left")
    for name in ("epoch", "step", "members", "shares", "total", "missing", "event"):
        table.add_column(name, justify="left" if name in ("shares", "event") else "right")
    head = max_rows - max_rows // 2
    shown = list(records) if len(records) <= max_rows else [*records[:head], None, *records[-(max_rows // 2) :]]
    for record in shown:
        if record is None:
            table.add_row("⋮", "⋮", "⋮", "⋮", "⋮", "⋮", f"{len(records) - max_rows} steps not shown")
            continue
        members = str(record.members) if record.survivors == record.members else f"{record.members}→{record.survivors}"
        total = str(record.total)
        if reassign and record.total != record.planned_total:
            total += f" (plan {record.planned_total})"
        table.add_row(
            str(record.epoch),
            str(record.step),
            members,
            _shares(record.share_sizes),
            total,
            str(record.missing),
            "; ".join(record.events),
        )
    return table


def _shares(sizes: Sequence[int]) -> str:
    """Run-length form that adds up to the total: ``4x11 + 2x10``."""
    runs = [(size, len(list(group))) for size, group in itertools.groupby(sizes)]
    return " + ".join(str(size) if count == 1 else f"{count}x{size}" for size, count in runs)


def _summary_table(result: SimulationResult) -> Table:
    summary = result.summary
    mode = "reassign" if summary.reassign else "re-queue"
    failures = f"{summary.failures} ({mode})"
    if summary.failures_unapplied:
        failures += f", {summary.failures_unapplied} unapplied: only one member was live"
    on_schedule = "all" if not summary.off_schedule_steps else f"{summary.steps - summary.off_schedule_steps}"
    table = Table(title="audit", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("exactly once", "[green]yes[/]" if summary.exactly_once else "[red]no[/]")
    table.add_row("duplicates", str(summary.duplicates))
    table.add_row("missing", str(summary.missing))
    table.add_row("unexpected", str(summary.unexpected))
    table.add_row("step totals", f"min {summary.min_step_total}, max {summary.max_step_total}")
    table.add_row("steps on schedule", f"{on_schedule} of {summary.steps}")
    table.add_row("epochs", str(summary.epochs))
    table.add_row("failures", failures)
    table.add_row("joins", f"{summary.joins} (members at the end: {summary.final_members})")
    table.add_row("result", "[green]PASS[/]" if summary.passed else "[red]FAIL[/]")
    return table
