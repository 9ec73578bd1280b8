"""``stalwart demo``: train the digits MLP or a GPT on a local cluster while a chaos schedule kills workers."""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stalwart.coord.protocol import TOKEN_ENVIRONMENT
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import (
    LocalCluster,
    PlannedKill,
    parse_kills,
    random_kill_times,
    read_status,
    worker_events,
)
from stalwart.launch.driver import ChaosDriver
from stalwart.launch.driver import Progress as DriverProgress
from stalwart.launch.report import RunReport, build_report, committed_steps, plot_report, write_audit
from stalwart.launch.tasks import TASKS, reference_run
from stalwart.redundancy.config import parse_parity


@click.command("demo")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Worker processes.")
@click.option("--steps", type=click.IntRange(1, 100_000), default=60, show_default=True, help="Steps to commit.")
@click.option("--global-batch", type=click.IntRange(1), default=64, show_default=True, help="Samples in every step.")
@click.option(
    "--multiple", type=click.IntRange(1), default=1, show_default=True, help="Each share is a multiple of this."
)
@click.option(
    "--max-microbatch", type=click.IntRange(1), default=16, show_default=True, help="Largest micro-batch per worker."
)
@click.option(
    "--step-seconds",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="Simulated compute per step, so that failures land mid-run.",
)
@click.option(
    "--kill",
    "kills",
    default="",
    help="Planned failures STEP:WORKER,... (workers from 0); 'none' for none. "
    "Default, without --mtbf: worker 1 at a quarter of the steps and worker 2 at half.",
)
@click.option("--mtbf", type=click.FloatRange(min=0.1), default=None, help="Mean seconds between random failures.")
@click.option(
    "--restart-after",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds before a failed worker is restarted (or sent SIGCONT).",
)
@click.option(
    "--signal",
    "signal_name",
    type=click.Choice(["KILL", "STOP"]),
    default="KILL",
    show_default=True,
    help="KILL: the process dies; STOP: it hangs (SIGSTOP), then resumes.",
)
@click.option("--compare/--no-compare", default=True, show_default=True, help="Also train without failures.")
@click.option(
    "--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here."
)
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write a PNG here."
)
@click.option("--lighthouse", "lighthouse_url", default=None, help="Use this lighthouse instead of an embedded one.")
@click.option("--token", envvar="STALWART_LIGHTHOUSE_TOKEN", default=None, help="Shared token for the lighthouse.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Shuffle and model seed.")
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds of silence after which a worker counts as failed.",
)
@click.option(
    "--timeout", type=click.FloatRange(min=1), default=900.0, show_default=True, help="Give up after this many seconds."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Workers' logs, step records and the audit (default: a new temporary directory).",
)
@click.option(
    "--overlap",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="Shard the optimizer state; each shard also held by round(F x workers) others (0: ZeRO, 1: DDP).",
)
@click.option("--parity", default=None, help="Shard the optimizer state with K,M parity (7,1 like RAID-5).")
@click.option(
    "--optimizer",
    type=click.Choice(["adam", "adamw", "sgd"]),
    default="adam",
    show_default=True,
    help="The workers' optimizer (and the reference's); a GPT's is over weight-decay groups.",
)
@click.option(
    "--model",
    type=click.Choice(sorted(TASKS)),
    default="digits",
    show_default=True,
    help="The task: the digits MLP, or a small GPT on a generated corpus (AdamW groups, cosine LR, clipping).",
)
def demo_command(
    workers: int,
    steps: int,
    global_batch: int,
    multiple: int,
    max_microbatch: int,
    step_seconds: float,
    kills: str,
    mtbf: float | None,
    restart_after: float,
    signal_name: str,
    compare: bool,
    report_path: Path | None,
    plot_path: Path | None,
    lighthouse_url: str | None,
    token: str | None,
    seed: int,
    heartbeat_timeout: float,
    timeout: float,
    run_dir: Path | None,
    overlap: float | None,
    parity: str | None,
    optimizer: str,
    model: str,
) -> None:
    """Train with failures injected, then report constant batch, exactly-once data and parameter drift.

    Every failed worker is restarted (or resumed) and the job waits for it to
    rejoin, so the world returns to full size. SIGTERM or Ctrl-C stops
    every process the demo started.
    """
    console = Console()
    if multiple > global_batch:
        raise click.BadParameter(
            f"must be at most --global-batch={global_batch}, got {multiple}", param_hint="--multiple"
        )
    redundancy_args = _redundancy_args(overlap, parity, workers)
    planned = _planned_kills(kills, workers, steps, mtbf, console)
    dataset_size = len(TASKS[model].dataset())  # type: ignore[arg-type]
    if global_batch > dataset_size:
        raise click.BadParameter(
            f"must be at most the {model} training set's {dataset_size} samples, got {global_batch}",
            param_hint="--global-batch",
        )
    plan = EpochPlan(dataset_size, global_batch, seed=seed, local_batch_multiple=multiple)
    run_dir = _prepare_run_dir(run_dir)
    lighthouse = None
    worker_args = ["--max-steps", str(steps), "--max-microbatch", str(max_microbatch), "--seed", str(seed)]
    worker_args += ["--step-seconds", str(step_seconds), "--collective-timeout", str(heartbeat_timeout)]
    worker_args += ["--optimizer", optimizer, "--model", model, *redundancy_args]
    previous_handlers = _raise_on_termination()
    cluster: LocalCluster | None = None
    try:
        if lighthouse_url is None:
            lighthouse = Lighthouse(
                plan,
                min_replicas=1,
                start_replicas=workers,
                token=token,
                heartbeat_timeout=heartbeat_timeout,
                join_timeout=30.0,
            )
            lighthouse.start()
            lighthouse_url = lighthouse.url
        # the token goes to the workers in their environment: a command line is visible to every user (ps)
        token_env = {} if not token else {TOKEN_ENVIRONMENT: token}
        cluster = LocalCluster(lighthouse_url, run_dir, worker_args, worker_env=lambda _: token_env)
        console.print(f"lighthouse {lighthouse_url}, {workers} workers, run directory {run_dir}")
        rng = random.Random(seed)
        driver = ChaosDriver(
            cluster,
            workers,
            steps,
            planned,
            random_kill_times(mtbf, timeout, rng) if mtbf else [],
            restart_after,
            signal_name,
            status=_status_reader(lighthouse, lighthouse_url, token),
            say=lambda line: console.print(line, highlight=False),
            rng=rng,
        )
        _drive(driver, plan, steps, timeout, console)
    except _Terminated as stop:
        console.print(f"[red]{stop}: stopping every worker process[/]")
        raise SystemExit(128 + stop.signum) from None
    finally:
        for sig in previous_handlers:
            signal.signal(sig, signal.SIG_IGN)
        if cluster is not None:
            cluster.terminate()
        if lighthouse is not None:
            lighthouse.stop()
        _restore(previous_handlers)
    errors = _worker_errors(run_dir, workers)
    if errors and driver.progress.committed < steps:
        for line in errors:
            console.print(f"[red]{line}[/]", highlight=False)
        raise click.ClickException(f"the workers stopped after {driver.progress.committed} of {steps} steps")
    reference = reference_run(plan, steps, seed, optimizer_name=optimizer, task=model) if compare else None
    report = build_report(plan, run_dir, cluster.failures, reference, driver.events)
    write_audit(plan, run_dir / "audit", committed_steps(run_dir))
    _print(report, console)
    console.print(f"audit the committed samples yourself: stalwart audit {run_dir / 'audit'}", highlight=False)
    if report_path is not None:
        report_path.write_text(report.to_json(), encoding="utf-8")
    if plot_path is not None:
        plot_report(report, plot_path)
    audited = report.exactly_once and report.global_batch_as_planned and report.loader_audit_mismatches == 0
    if not audited or report.steps_committed < steps:
        raise SystemExit(1)


class _Terminated(Exception):
    """SIGTERM or SIGINT reached the demo."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def _raise_on_termination() -> dict[int, Any]:
    """Turn SIGTERM and SIGINT into :class:`_Terminated`, so that the demo's clean-up runs."""

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _planned_kills(text: str, workers: int, steps: int, mtbf: float | None, console: Console) -> list[PlannedKill]:
    """The ``--kill`` schedule; without one (and without ``--mtbf``), a default that shows failures and rejoins."""
    if text.strip() == "none":
        return []
    if text.strip() or mtbf is not None:
        try:
            return parse_kills(text, workers, steps)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--kill") from None
    if workers < 2:
        console.print("no failure injected: a job of one worker cannot survive one (use --workers 2 or more)")
        return []
    default = [PlannedKill(steps // 4, 1)] + ([PlannedKill(steps // 2, 2)] if workers >= 3 else [])
    console.print(
        "no --kill or --mtbf given: failing "
        + " and ".join(f"worker-{kill.worker} at step {kill.step}" for kill in default),
        highlight=False,
    )
    return default


def _redundancy_args(overlap: float | None, parity: str | None, workers: int) -> list[str]:
    """The workers' ``--overlap``/``--parity`` arguments; a bad or contradictory choice is a usage error."""
    if overlap is not None and parity is not None:
        raise click.UsageError(f"choose --overlap ({overlap}) or --parity ({parity}), not both")
    if parity is None:
        return [] if overlap is None else ["--overlap", str(overlap)]
    try:
        parse_parity(parity).check_processes(workers)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--parity") from None
    return ["--parity", parity]


def _prepare_run_dir(run_dir: Path | None) -> Path:
    """A fresh run directory: a new temporary one, or ``run_dir`` emptied of an earlier demo's files."""
    if run_dir is None:
        return Path(tempfile.mkdtemp(prefix="stalwart-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    ours = ("steps-*.jsonl", "events-*.jsonl", "final-*.pt", "worker-*.log", "hold")
    for pattern in ours:
        for path in run_dir.glob(pattern):
            path.unlink()
    shutil.rmtree(run_dir / "audit", ignore_errors=True)
    return run_dir


def _status_reader(lighthouse: Lighthouse | None, url: str, token: str | None) -> Callable[[], dict[str, Any]]:
    """Reads the lighthouse's status: in process when embedded, else over HTTP."""
    if lighthouse is not None:
        return lighthouse.status
    return lambda: read_status(url, token)


def _drive(driver: ChaosDriver, plan: EpochPlan, steps: int, timeout: float, console: Console) -> None:
    """Run the job with a progress bar; bounded by ``timeout`` seconds."""
    columns = (TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.description}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("starting", total=steps)

        def show(progress: DriverProgress) -> None:
            if progress.waiting_for:
                description = progress.waiting_for
            else:
                loss = "-" if progress.loss is None else f"{progress.loss:.4f}"
                description = (
                    f"world {progress.world}  loss {loss}  samples {_samples_committed(plan, progress.committed)}  "
                    f"failures {sum(e['kind'] == 'failure' for e in driver.events)}"
                )
            bar.update(task, completed=progress.committed, description=description)

        finished = driver.run(timeout, show)
    if not finished:
        console.print(f"[red]gave up after {timeout:.0f} s")


def _worker_errors(run_dir: Path, workers: int) -> list[str]:
    """Each worker's last error (a lighthouse it could not reach, a wrong token, a plan mismatch), one line each."""
    lines = []
    for worker in range(workers):
        errors = [event for event in worker_events(run_dir, worker) if event["event"] == "error"]
        if errors:
            lines.append(f"worker-{worker}: {errors[-1]['message']}")
    return lines


def _samples_committed(plan: EpochPlan, steps: int) -> int:
    """Samples trained on in the first ``steps`` steps (failure-transparent steps follow the plan)."""
    epochs, rest = divmod(steps, plan.steps_per_epoch)
    return epochs * plan.epoch_length + plan.step_start(rest)


def _print(report: RunReport, console: Console) -> None:
    table = Table(title="stalwart demo report")
    table.add_column("what")
    table.add_column("value", justify="right")
    sizes = sorted(set(report.global_batch_sizes))
    failed = "; ".join(f"worker-{item['worker']}: {item['reason']}" for item in report.failed_rejoins)
    rows = [
        ("steps committed", str(report.steps_committed)),
        ("failures injected / survived", f"{report.failures_injected} / {report.failures_survived}"),
        ("restarts / rejoins / failed rejoins", f"{report.restarts} / {report.rejoins} / {len(report.failed_rejoins)}"),
        ("world size history (step: size)", ", ".join(f"{step}: {size}" for step, size in report.world_size_history)),
        ("global batch sizes seen", ", ".join(map(str, sizes))),
        ("every step's batch as planned", str(report.global_batch_as_planned)),
        ("exactly once", str(report.exactly_once)),
        ("duplicates / missing", f"{report.duplicates} / {report.missing}"),
        ("steps whose loaded samples differ from the plan", str(report.loader_audit_mismatches)),
        ("recovery seconds", ", ".join(f"{s:.2f}" for s in report.recovery_seconds) or "-"),
        ("final loss", "-" if report.final_loss is None else f"{report.final_loss:.5f}"),
        ("reference final loss", "-" if report.reference_final_loss is None else f"{report.reference_final_loss:.5f}"),
        (
            "max |param - reference|",
            "-" if report.max_param_diff_vs_reference is None else f"{report.max_param_diff_vs_reference:.2e}",
        ),
    ]
    if failed:
        rows.insert(3, ("failed rejoins", failed))
    if report.state_bytes_per_worker:
        per_worker = ", ".join(f"{size / 1024:.1f}" for size in report.state_bytes_per_worker)
        rows.append(("sharded state per worker (KiB)", per_worker))
        rows.append(("repairs / their seconds", f"{report.repairs} / {report.repair_seconds:.2f}"))
    if report.shards_lost:
        rows.append(("shards lost", ", ".join(map(str, report.shards_lost))))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
