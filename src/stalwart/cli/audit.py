"""``stalwart audit DIR``: was every epoch in an audit directory consumed exactly once, by index and by row?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from stalwart.data.audit import (
    AuditFileError,
    AuditReport,
    Delivery,
    EpochAudit,
    KeyConflict,
    StepDisagreement,
    audit_directory,
)
from stalwart.errors import StalwartError

EXIT_VIOLATION = 1
EXIT_UNREADABLE = 2
NAMED = 5
"""Rows (or indices) named per finding; the counts cover all of them."""


class UnreadableAudit(StalwartError, click.ClickException):
    """The audit directory cannot be read: one line through click, exit status :data:`EXIT_UNREADABLE`."""

    exit_code = EXIT_UNREADABLE


@click.command("audit")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def audit_command(directory: Path) -> None:
    """Check the audit files in DIRECTORY: each epoch's samples consumed exactly once.

    Records that carry row keys are checked by key too: rows delivered twice
    are named, rows of a complete epoch never delivered counted, and indices
    delivered as two different rows named. The step records of a Manager's
    ``Checks(audit_dir=...)`` count each committed step once (consumer
    ``quorum``); steps whose members recorded different samples are named.
    Exits 0 when every complete epoch was covered exactly once and no epoch
    in progress repeats a sample, 1 on any violation or when the directory
    holds no records (nothing was consumed through an audited loop), 2 when
    it cannot be read.
    """
    try:
        report = audit_directory(directory)
    except (OSError, AuditFileError) as error:
        raise UnreadableAudit(f"cannot audit {directory}: {error}") from error
    console = Console()
    for epoch in report.epochs:
        console.print(_epoch_table(epoch))
        for line in _epoch_summary(epoch):
            console.print(line, highlight=False, soft_wrap=True)
    if report.conflicts:
        console.print(_conflicts_line(report.conflicts), highlight=False, soft_wrap=True)
    if report.disagreements:
        console.print(_disagreements_line(report.disagreements), highlight=False, soft_wrap=True)
    console.print(_verdict(report), highlight=False, soft_wrap=True)
    if not report.ok:
        raise SystemExit(EXIT_VIOLATION)


def _epoch_table(epoch: EpochAudit) -> Table:
    """One epoch's per-rank batches and samples; ranks that recorded their world size are labelled ``r of w``."""
    state = "complete" if epoch.complete else "in progress"
    table = Table(title=f"epoch {epoch.epoch} ({state})", title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("batches", justify="right")
    table.add_column("samples", justify="right")
    for consumer, samples in epoch.rank_samples.items():
        table.add_row(str(consumer), str(epoch.rank_batches[consumer]), str(samples))
    return table


def _epoch_summary(epoch: EpochAudit) -> list[str]:
    """One epoch's coverage by index and, when the records carry keys, by row."""
    result = epoch.coverage
    missing = len(result.missing) if epoch.complete else f"{len(result.missing)} not yet consumed"
    lines = [
        f"consumed {result.consumed} of {epoch.expected}: duplicates {len(result.duplicates)}, "
        f"missing {missing}, unexpected {len(result.unexpected)}"
    ]
    keys = epoch.keys
    if keys is not None:
        line = f"rows by key: {keys.distinct} distinct of {keys.keyed} keyed"
        if keys.duplicates:
            named = "; ".join(
                f"{_key(key)} at {', '.join(delivery.describe() for delivery in deliveries)}"
                for key, deliveries in list(keys.duplicates.items())[:NAMED]
            )
            line += f", {len(keys.duplicates)} delivered more than once ({named}{_more(keys.duplicates)})"
        if epoch.missing_rows:
            line += f", {epoch.missing_rows} never delivered"
        lines.append(line)
    return lines


def _conflicts_line(conflicts: list[KeyConflict]) -> str:
    named = "; ".join(
        f"index {conflict.index}: "
        + ", ".join(f"{_key(key)} at {_where(delivery)}" for key, delivery in conflict.deliveries)
        for conflict in conflicts[:NAMED]
    )
    return f"{len(conflicts)} indices delivered as different rows ({named}{_more(conflicts)})"


def _disagreements_line(disagreements: list[StepDisagreement]) -> str:
    named = "; ".join(disagreement.describe() for disagreement in disagreements[:NAMED])
    return f"{len(disagreements)} steps recorded differently by their members ({named}{_more(disagreements)})"


def _verdict(report: AuditReport) -> str:
    """One line: OK, or what went wrong in which epochs."""
    torn = f" ({report.torn_lines} torn last line(s) skipped)" if report.torn_lines else ""
    if report.empty:
        return (
            f"[bold red]NO RECORDS[/] in {report.directory}{torn}: nothing was consumed through an audited loop "
            "(a ShardedStream's consume(), a sampler's steps(), a Manager's Checks(audit_dir=...)), so nothing "
            "can be vouched for"
        )
    if report.ok:
        count = len(report.epochs)
        return f"[bold green]OK[/]: {count} epoch(s); complete ones exactly once, none repeats a sample{torn}"
    problems = []
    for epoch in report.epochs:
        if epoch.ok:
            continue
        result = epoch.coverage
        found = [f"{len(result.duplicates)} duplicated"]
        if epoch.complete:
            found.append(f"{len(result.missing)} missing")
        found.append(f"{len(result.unexpected)} unexpected")
        if epoch.keys is not None and epoch.keys.duplicates:
            found.append(f"{len(epoch.keys.duplicates)} rows delivered twice")
        if epoch.missing_rows:
            found.append(f"{epoch.missing_rows} rows never delivered")
        problems.append(f"epoch {epoch.epoch}: " + ", ".join(found))
    if report.conflicts:
        problems.append(f"{len(report.conflicts)} indices delivered as different rows")
    if report.disagreements:
        problems.append(f"{len(report.disagreements)} steps recorded differently by their members")
    return "[bold red]VIOLATION[/]: " + "; ".join(problems) + torn


def _key(key: Any) -> str:
    return f"key {key!r}"


def _where(delivery: Delivery) -> str:
    return f"rank {delivery.consumer}, epoch {delivery.epoch} step {delivery.step}"


def _more(items: Any) -> str:
    return f"; and {len(items) - NAMED} more" if len(items) > NAMED else ""
