"""``stalwart redundancy``: state bytes per process and failures survived, for an overlap or a parity choice."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from stalwart.redundancy import (
    OPTIMIZER_STATE_ELEMENTS,
    FailurePattern,
    Overlap,
    Placement,
    Redundancy,
    parse_parity,
    place,
    state_bytes,
    survived_patterns,
)

MAX_PROCESSES = 1024
"""The placement lists every unit; full replication of a larger world takes more than a moment."""

GIB = 1 << 30
SCALES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


class ParameterCount(click.ParamType):
    """A model size: ``7000000000``, ``7e9``, ``1.3B``, ``350M``, ``1.5T`` (K, M, B or G, T: powers of 1000)."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            count = Decimal(value)
        else:
            text = str(value).strip()
            scale = SCALES.get(text[-1:].upper(), 1)
            try:
                count = Decimal(text[:-1] if scale != 1 else text) * scale
            except InvalidOperation:
                self.fail(f"{value!r} is not a parameter count such as 7e9, 1.3B or 350M", param, ctx)
        if not count.is_finite() or count != count.to_integral_value() or count < 1:
            self.fail(f"{value!r} must be a whole number of parameters, at least 1", param, ctx)
        return int(count)


@click.command("redundancy")
@click.option("--processes", type=click.IntRange(1, MAX_PROCESSES), required=True, help="Processes in the world (N).")
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Nodes, each with an equal run of consecutive ranks (the first ones one more when N does not divide).",
)
@click.option("--overlap", type=float, help="F in [0, 1]: each shard also held by round(F x N) other processes.")
@click.option("--parity", "parity_text", metavar="K,M", help="Groups of K data cells plus M parity cells.")
@click.option(
    "--parameters", type=ParameterCount(), default="7B", show_default=True, help="Model size: 7e9, 1.3B, 350M."
)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATE_ELEMENTS)),
    default="adam",
    show_default=True,
    help="adam: 2 moments + fp32 master; sgd: momentum + fp32 master.",
)
def redundancy_command(
    processes: int, nodes: int, overlap: float | None, parity_text: str | None, parameters: int, optimizer: str
) -> None:
    """Print the optimizer state each process holds, against ZeRO and DDP, and the failures it survives.

    Give --overlap F or --parity K,M. The state is fp32: the optimizer's
    elements and the master parameters, sharded over the processes; the
    model's parameters and gradients, whole on every process, are not
    counted.
    """
    redundancy = _redundancy(overlap, parity_text)
    if nodes > processes:
        raise click.BadParameter(f"must be at most --processes ({processes}), got {nodes}", param_hint="'--nodes'")
    labels = [f"node{index}" for index in range(nodes) for _ in range(len(range(index, processes, nodes)))]
    try:
        chosen = place(redundancy, labels)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    elements = OPTIMIZER_STATE_ELEMENTS[optimizer]
    rows = [("ZeRO", place(Overlap(0.0), labels)), ("chosen", chosen), ("DDP", place(Overlap(1.0), labels))]
    console = Console()
    per_node = sorted({labels.count(label) for label in set(labels)}, reverse=True)
    console.print(
        f"{processes} processes on {nodes} node{'s' * (nodes > 1)} ({' or '.join(map(str, per_node))} each), "
        f"{parameters:,} parameters, {optimizer}: "
        f"{elements} fp32 state elements per parameter, {parameters * elements * 4 / GIB:,.2f} GiB of state in all"
    )
    console.print(_comparison(rows, parameters, elements))
    console.print(_patterns(chosen))


def _redundancy(overlap: float | None, parity_text: str | None) -> Redundancy:
    """The choice from --overlap or --parity (exactly one), with their errors as click's."""
    if (overlap is None) == (parity_text is None):
        raise click.UsageError("give exactly one of --overlap F and --parity K,M")
    try:
        return Overlap(overlap) if overlap is not None else parse_parity(parity_text or "")
    except ValueError as error:
        raise click.BadParameter(
            str(error), param_hint="'--overlap'" if overlap is not None else "'--parity'"
        ) from None


def _comparison(rows: list[tuple[str, Placement]], parameters: int, elements: int) -> Table:
    """Per row: who holds a shard, the most state bytes a process holds, relative to ZeRO and DDP, what it survives."""
    held = [max(state_bytes(placement, parameters, state_elements=elements)) for _, placement in rows]
    zero, ddp = held[0], held[-1]
    table = Table(title="optimizer state per process", title_justify="left")
    for column in ("", "redundancy", "per shard", "state per process", "vs ZeRO", "vs DDP", "survives"):
        table.add_column(column, justify="right" if column.startswith(("state", "vs")) else "left")
    for (name, placement), size in zip(rows, held, strict=True):
        table.add_row(
            name,
            str(placement.redundancy),
            _per_shard(placement),
            f"{size / GIB:,.2f} GiB",
            f"{size / zero:.2f}x",
            f"{100 * size / ddp:.1f}%",
            _headline(survived_patterns(placement)),
        )
    return table


def _patterns(placement: Placement) -> Table:
    """Every failure pattern the choice survives: whole nodes, and processes on top."""
    table = Table()
    table.add_column(f"failures {placement.redundancy} survives", no_wrap=True)
    for pattern in survived_patterns(placement):
        table.add_row(str(pattern))
    return table


def _per_shard(placement: Placement) -> str:
    """What backs a shard: its copies, or its cells' parity group."""
    redundancy = placement.redundancy
    if isinstance(redundancy, Overlap):
        copies = len(placement.stripes[0].redundant)
        return f"{copies} cop{'y' if copies == 1 else 'ies'}"
    return f"{redundancy.k} cells + {redundancy.m} parity"


def _headline(patterns: tuple[FailurePattern, ...]) -> str:
    """The most processes and the most whole nodes survived: ``any 8 processes, any 7 nodes``."""
    most_processes, most_nodes = patterns[0], FailurePattern(patterns[-1].nodes, 0)
    if not most_nodes.nodes:
        return str(most_processes)
    return f"{most_processes}, {most_nodes}"
