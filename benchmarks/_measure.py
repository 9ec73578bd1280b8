"""Small helpers shared by the benchmarks: isolated measurements, medians and rich tables.

A measurement of peak memory needs a process of its own: the peak resident set
size (``ru_maxrss``) only ever grows, so whatever ran earlier in the same
process would show up in it. ``run_isolated`` starts a fresh interpreter
(``python -m benchmarks._measure``) that imports a function by name, calls it
with JSON keyword arguments and prints what it returned together with its own
peak RSS as one JSON line. Subtract the peak of a child that only does the
imports to get what the measured code itself needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

REPO_ROOT = Path(__file__).resolve().parents[1]
_RESULT_PREFIX = "BENCHMARK-RESULT "
_THREAD_POOL_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


@dataclass(frozen=True)
class IsolatedRun:
    """What a function returned in a fresh process, and that process's peak resident set size."""

    result: dict[str, Any]
    peak_rss_bytes: int


def run_isolated(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    single_core: bool = False,
    timeout_s: float = 600.0,
) -> IsolatedRun:
    """Call ``target`` (``"module:function"``, returning a JSON-able dict) with ``kwargs`` in a fresh process.

    With ``single_core`` the child is pinned to one CPU (where the platform
    allows) and its thread pools are limited to one thread.
    """
    request = json.dumps({"target": target, "kwargs": dict(kwargs or {}), "single_core": single_core})
    env = dict(os.environ)
    if single_core:
        env.update(dict.fromkeys(_THREAD_POOL_VARIABLES, "1"))
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks._measure"],
        input=request,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"measurement {target}(**{dict(kwargs or {})}) exited with code {completed.returncode}:\n"
            f"{completed.stderr.strip()}"
        )
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(_RESULT_PREFIX):
            report = json.loads(line[len(_RESULT_PREFIX) :])
            return IsolatedRun(result=report["result"], peak_rss_bytes=int(report["peak_rss_bytes"]))
    raise RuntimeError(f"measurement {target} printed no result line; stdout was:\n{completed.stdout.strip()}")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def median_of_repeats(measure: Callable[[], float], repeats: int) -> float:
    """Run ``measure`` ``repeats`` times and return the median of what it returned."""
    if repeats < 1:
        raise ValueError(f"repeats must be in [1, inf], got {repeats}")
    return statistics.median(measure() for _ in range(repeats))


def make_console(min_width: int = 160) -> Console:
    """A console for benchmark output; at least ``min_width`` columns when it writes to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, min_width))


def print_table(
    console: Console,
    title: str,
    columns: Sequence[str | Column],
    rows: Sequence[Sequence[str]],
    *,
    caption: str | None = None,
) -> None:
    """Print a table; plain-string headers are right-justified (numbers), pass a ``Column`` otherwise."""
    table = Table(
        *(Column(column, justify="right") if isinstance(column, str) else column for column in columns),
        title=title,
        caption=caption,
        caption_justify="left",
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _child_main() -> None:
    """Entry point of the fresh process started by ``run_isolated``: read the request on stdin, answer on stdout."""
    request = json.loads(sys.stdin.read())
    if request["single_core"] and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    module_name, function_name = request["target"].split(":")
    function = getattr(import_module(module_name), function_name)
    result = function(**request["kwargs"])
    print(_RESULT_PREFIX + json.dumps({"result": result, "peak_rss_bytes": peak_rss_bytes()}), flush=True)
    os._exit(0)  # the answer is out: skip interpreter teardown (torch's, a large list's), which costs up to seconds


if __name__ == "__main__":
    _child_main()


@dataclass(frozen=True)
class Goal:
    """One goal of an issue: whether it was met (None: not measured in this run) and the numbers behind it."""

    description: str
    met: bool | None
    detail: str


def print_goals(console: Console, goals: Sequence[Goal]) -> None:
    """The goals summary: met, MISSED or not measured, with the numbers behind each."""
    status = {True: "[green]met[/green]", False: "[red]MISSED[/red]", None: "[yellow]not measured[/yellow]"}
    console.print("[bold]Goals[/bold]")
    for goal in goals:
        console.print(f"  {status[goal.met]}: {goal.description} ({goal.detail})", highlight=False)


def progress_display(console: Console) -> Progress:
    """The benchmarks' progress display: what runs, a bar, done/total and elapsed time; gone when finished."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def machine_line(console: Console, quick: bool, *versions: str, forked: bool = False) -> None:
    """The line above a benchmark's tables: the versions that matter, the CPUs and their load, a quick run's caveat.

    ``forked``: the workers were forked from one interpreter that imported
    torch, so their start-up figures are not what a user's launcher pays.
    """
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    caveat = " (quick run: indicative only)" if quick else ""
    if forked:
        caveat += " (workers forked from one interpreter that imported torch: start-up figures are not a user's)"
    console.print(", ".join([*versions, f"{os.cpu_count()} CPUs"]) + load + caveat, highlight=False)


@contextlib.contextmanager
def run_directory(kept: Path | None, prefix: str) -> Iterator[Path]:
    """Where a run's workers write: ``kept`` (``--run-dir``: created, left there) or a scratch folder, removed after."""
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        yield Path(scratch)


def positive(kind: type[float] | type[int]) -> Callable[[str], float | int]:
    """An argparse type: a number of ``kind`` above 0, or an error naming the value."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} > 0, got {text!r}")
        return value

    return parse


def add_rounds(parser: argparse.ArgumentParser, what: str = "rounds") -> None:
    """``--rounds N`` (1 to 20, None when not given): how many interleaved rounds."""
    parser.add_argument("--rounds", type=int, choices=range(1, 21), metavar="N", help=f"{what} (1-20)")
