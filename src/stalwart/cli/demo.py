"""``stalwart demo``: train the digits MLP on a local cluster while a chaos schedule kills workers."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster, PlannedKill, latest_step, parse_kills, random_kill_times
from stalwart.launch.digits import digits_dataset, reference_run
from stalwart.launch.report import RunReport, build_report, plot_report


@click.command("demo")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Worker processes.")
@click.option("--steps", type=click.IntRange(1, 100_000), default=60, show_default=True, help="Steps to commit.")
@click.option("--global-batch", type=click.IntRange(1, 1797), default=64, show_default=True)
@click.option("--multiple", type=click.IntRange(1), default=1, show_default=True, help="local_batch_multiple.")
@click.option("--max-microbatch", type=click.IntRange(1), default=16, show_default=True)
@click.option(
    "--step-seconds",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="Simulated compute per step, so that failures land mid-run.",
)
@click.option("--kill", "kills", default="", help="Planned failures STEP:WORKER,... (workers from 0).")
@click.option("--mtbf", type=click.FloatRange(min=0.1), default=None, help="Mean seconds between random failures.")
@click.option("--restart-after", type=click.FloatRange(min=0), default=2.0, show_default=True)
@click.option("--signal", "signal_name", type=click.Choice(["KILL", "STOP"]), default="KILL", show_default=True)
@click.option("--compare/--no-compare", default=True, show_default=True, help="Also train without failures.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--lighthouse", "lighthouse_url", default=None, help="Use this lighthouse instead of an embedded one.")
@click.option("--token", default=None, help="Shared token for the lighthouse.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0.1), default=1.0, show_default=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True, help="Give up after.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
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
) -> None:
    """Train with failures injected, then report constant batch, exactly-once data and parameter drift."""
    console = Console()
    if multiple > global_batch:
        raise click.BadParameter(
            f"must be at most --global-batch={global_batch}, got {multiple}", param_hint="--multiple"
        )
    planned = parse_kills(kills, workers)
    plan = EpochPlan(len(digits_dataset()), global_batch, seed=seed, local_batch_multiple=multiple)
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="stalwart-demo-"))
    lighthouse = None
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
    worker_args = ["--max-steps", str(steps), "--max-microbatch", str(max_microbatch), "--seed", str(seed)]
    worker_args += ["--step-seconds", str(step_seconds)]
    worker_args += ["--collective-timeout", str(heartbeat_timeout)]
    if token:
        worker_args += ["--token", token]
    cluster = LocalCluster(lighthouse_url, run_dir, worker_args)
    console.print(f"lighthouse {lighthouse_url}, {workers} workers, run directory {run_dir}")
    try:
        _drive(plan, cluster, workers, steps, planned, mtbf, restart_after, signal_name, seed, timeout, console)
    finally:
        cluster.terminate()
        if lighthouse is not None:
            lighthouse.stop()
    reference = reference_run(plan, steps, seed) if compare else None
    report = build_report(plan, run_dir, cluster.failures, reference)
    _print(report, console)
    if report_path is not None:
        report_path.write_text(report.to_json(), encoding="utf-8")
    if plot_path is not None:
        plot_report(report, plot_path)
    if not (report.exactly_once and report.global_batch_as_planned) or report.steps_committed < steps:
        raise SystemExit(1)


def _drive(
    plan: EpochPlan,
    cluster: LocalCluster,
    workers: int,
    steps: int,
    planned: list[PlannedKill],
    mtbf: float | None,
    restart_after: float,
    signal_name: str,
    seed: int,
    timeout: float,
    console: Console,
) -> None:
    """Run the workers to the end, firing the chaos schedule; bounded by ``timeout`` seconds.

    Random failures (``mtbf``) are timed from the first committed step, so that none hits the start-up.
    """
    rng = random.Random(seed)
    start = time.time()
    random_times = random_kill_times(mtbf, timeout, rng) if mtbf else []
    training_since: float | None = None
    revivals: list[tuple[float, int]] = []
    for worker in range(workers):
        cluster.start(worker)
    columns = (TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.description}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("starting", total=steps)
        while cluster.running() and time.time() - start < timeout:
            committed, loss, world = latest_step(cluster.run_dir)
            now = time.time()
            due = [kill for kill in planned if kill.step <= committed] if committed < steps else []
            victims = [kill.worker for kill in due]
            planned[:] = [kill for kill in planned if kill not in due]
            if training_since is None and committed > 0:
                training_since = now
            clock = now - training_since if training_since is not None else -1.0
            while random_times and random_times[0] <= clock and committed < steps:
                random_times.pop(0)
                if len(cluster.alive()) > 1:
                    victims.append(rng.choice(cluster.alive()))
            for worker in victims:
                cluster.kill(worker, signal_name, committed)
                revivals.append((now + restart_after, worker))
            for when, worker in [item for item in revivals if item[0] <= now]:
                revivals.remove((when, worker))
                if committed < steps:
                    cluster.revive(worker)
            if committed >= steps:
                for worker in list(cluster.stopped):
                    cluster.revive(worker)
            loss_text = "-" if loss is None else f"{loss:.4f}"
            progress.update(
                task,
                completed=committed,
                description=f"world {world}  loss {loss_text}  samples {_samples_committed(plan, committed)}  "
                f"failures {len(cluster.failures)}",
            )
            time.sleep(0.05)
    if cluster.running():
        console.print(f"[red]gave up after {timeout:.0f} s")


def _samples_committed(plan: EpochPlan, steps: int) -> int:
    """Samples trained on in the first ``steps`` steps (failure-transparent steps follow the plan)."""
    epochs, rest = divmod(steps, plan.steps_per_epoch)
    return epochs * plan.epoch_length + plan.step_start(rest)


def _print(report: RunReport, console: Console) -> None:
    table = Table(title="stalwart demo report")
    table.add_column("what")
    table.add_column("value", justify="right")
    sizes = sorted(set(report.global_batch_sizes))
    rows = [
        ("steps committed", str(report.steps_committed)),
        ("failures injected / survived", f"{report.failures_injected} / {report.failures_survived}"),
        ("global batch sizes seen", ", ".join(map(str, sizes))),
        ("every step's batch as planned", str(report.global_batch_as_planned)),
        ("exactly once", str(report.exactly_once)),
        ("duplicates / missing", f"{report.duplicates} / {report.missing}"),
        ("recovery seconds", ", ".join(f"{s:.2f}" for s in report.recovery_seconds) or "-"),
        ("final loss", "-" if report.final_loss is None else f"{report.final_loss:.5f}"),
        ("reference final loss", "-" if report.reference_final_loss is None else f"{report.reference_final_loss:.5f}"),
        (
            "max |param - reference|",
            "-" if report.max_param_diff_vs_reference is None else f"{report.max_param_diff_vs_reference:.2e}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
