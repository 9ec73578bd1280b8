"""``stalwart audit DIR``: was every epoch in an audit directory consumed exactly once?"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from stalwart.data.audit import AuditFileError, AuditReport, EpochAudit, audit_directory

EXIT_VIOLATION = 1
EXIT_UNREADABLE = 2


class UnreadableAudit(click.ClickException):
    """The audit directory cannot be read: one line through click, exit status :data:`EXIT_UNREADABLE`."""

    exit_code = EXIT_UNREADABLE


@click.command("audit")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def audit_command(directory: Path) -> None:
    """Check the audit files in DIRECTORY: each epoch's samples consumed exactly once.

    Exits 0 when every complete epoch was covered exactly once and no epoch in
    progress repeats a sample, 1 on any violation, 2 when the directory cannot
    be read.
    """
    try:
        report = audit_directory(directory)
    except (OSError, AuditFileError) as error:
        raise UnreadableAudit(f"cannot audit {directory}: {error}") from error
    console = Console()
    for epoch in report.epochs:
        console.print(_epoch_table(epoch))
        console.print(_epoch_summary(epoch), highlight=False, soft_wrap=True)
    console.print(_verdict(report), highlight=False, soft_wrap=True)
    if not report.ok:
        raise SystemExit(EXIT_VIOLATION)


def _epoch_table(epoch: EpochAudit) -> Table:
    """One epoch's per-rank batches and samples."""
    state = "complete" if epoch.complete else "in progress"
    table = Table(title=f"epoch {epoch.epoch} ({state})", title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("batches", justify="right")
    table.add_column("samples", justify="right")
    for rank, samples in epoch.rank_samples.items():
        table.add_row(str(rank), str(epoch.rank_batches[rank]), str(samples))
    return table


def _epoch_summary(epoch: EpochAudit) -> str:
    """One epoch's coverage; missing samples only count once the epoch is complete."""
    result = epoch.coverage
    missing = len(result.missing) if epoch.complete else f"{len(result.missing)} not yet consumed"
    return (
        f"consumed {result.consumed} of {epoch.expected}: duplicates {len(result.duplicates)}, "
        f"missing {missing}, unexpected {len(result.unexpected)}"
    )


def _verdict(report: AuditReport) -> str:
    """One line: OK, or what went wrong in which epochs."""
    torn = f" ({report.torn_lines} torn last line(s) skipped)" if report.torn_lines else ""
    if not report.epochs:
        return f"[bold yellow]NO RECORDS[/] in {report.directory}{torn}"
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
        problems.append(f"epoch {epoch.epoch}: " + ", ".join(found))
    return "[bold red]VIOLATION[/]: " + "; ".join(problems) + torn
