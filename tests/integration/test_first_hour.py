"""What a new user meets first: worker errors as one line, late joiners, the demo's rejoins, errors and signals.

Real processes against an embedded lighthouse on 127.0.0.1; every wait is
bounded and waits on an event (a process exit, a file, the lighthouse's
state), never on a process starting within some seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart.cli.audit import audit_command
from stalwart.cli.demo import demo_command
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.digits import digits_model
from stalwart.launch.processes import ForkedWorker
from stalwart.launch.report import RunReport, event_marks, plot_report, world_size_history
from stalwart.redundancy import Parity, place, state_bytes
from stalwart.testing.loopback import free_port
from stalwart.testing.procfs import stat_fields
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(1797, 32, seed=0)
PROCESS_TIMEOUT = 240.0


def worker_argv(url: str, run_dir: Path, member: str, *extra: str) -> list[str]:
    """The worker's options for a 3-step job against ``url``."""
    return [
        "--lighthouse", url, "--member", member, "--run-dir", str(run_dir),
        "--max-steps", "3", "--max-microbatch", "16", *extra,
    ]  # fmt: skip


def run_worker(url: str, run_dir: Path, member: str, *extra: str, fresh: bool = False) -> tuple[int, str]:
    """Run one worker to its end, bounded: its exit status and what it printed.

    ``fresh``: a new ``python -m stalwart.launch.worker``, as a user starts it
    (one test keeps that path); otherwise forked from the preloaded forkserver,
    which runs the same entry with the same arguments without importing torch again.
    """
    if fresh:
        command = [sys.executable, "-m", "stalwart.launch.worker", *worker_argv(url, run_dir, member, *extra)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
        return result.returncode, result.stderr
    log = run_dir / f"{member}.log"
    code = ForkedWorker(worker_argv(url, run_dir, member, *extra), os.environ, log).wait(timeout=PROCESS_TIMEOUT)
    return code, log.read_text()


def test_worker_joining_after_the_job_ended_exits_0_with_one_line(tmp_path: Path) -> None:
    with Lighthouse(PLAN, min_replicas=1, heartbeat_timeout=5.0, join_timeout=30.0) as lighthouse:
        code, printed = run_worker(lighthouse.url, tmp_path, "w0")  # the job's only worker, to its end
        assert code == 0, printed
        code, printed = run_worker(lighthouse.url, tmp_path, "w1")
    assert code == 0, printed
    assert "Traceback" not in printed
    assert "stalwart worker w1: the job had already committed its 3 steps" in printed
    assert not (tmp_path / "final-w1.pt").exists()
    events = [json.loads(line)["event"] for line in (tmp_path / "events-w1.jsonl").read_text().splitlines()]
    assert events == ["started", "joined", "joined_after_end"]


def test_late_joiner_under_min_replicas_3_is_told_at_once_and_is_no_failure(tmp_path: Path) -> None:
    """Three workers end the job; a fourth, whose quorum timeout is an hour, exits 0 long before it (the process
    bound), told that the job ended, and leaves cleanly. It used to wait out its quorum timeout (no quorum of one
    under ``min_replicas`` 3) and exit 1 with ``JoinError``, counted as a failure."""
    with Lighthouse(PLAN, min_replicas=3, heartbeat_timeout=5.0, join_timeout=30.0) as lighthouse:
        finishers = [
            ForkedWorker(worker_argv(lighthouse.url, tmp_path, f"w{n}"), os.environ, tmp_path / f"w{n}.log")
            for n in range(3)
        ]
        assert [worker.wait(timeout=PROCESS_TIMEOUT) for worker in finishers] == [0, 0, 0]
        failures = lighthouse.status()["counts"]["failures"]
        patient = {**os.environ, "STALWART_QUORUM_TIMEOUT": "3600"}
        late = ForkedWorker(worker_argv(lighthouse.url, tmp_path, "late"), patient, tmp_path / "late.log")
        try:
            code = late.wait(timeout=PROCESS_TIMEOUT)
        finally:
            late.kill()
        status = lighthouse.status()
    printed = (tmp_path / "late.log").read_text()
    assert code == 0, printed
    assert "stalwart worker late: the job had already committed its 3 steps" in printed
    assert status["counts"]["failures"] == failures == 0
    assert {member["member"]: member["state"] for member in status["members"]}["late"] == "left"
    events = [json.loads(line)["event"] for line in (tmp_path / "events-late.jsonl").read_text().splitlines()]
    assert events == ["started", "joined", "joined_after_end"]


def test_worker_with_a_wrong_token_says_so_in_one_line(tmp_path: Path) -> None:
    with Lighthouse(PLAN, min_replicas=1, token="right-token", join_timeout=30.0) as lighthouse:
        code, printed = run_worker(lighthouse.url, tmp_path, "w0", "--token", "wrong-token", fresh=True)
    assert code == 2
    assert "Traceback" not in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("stalwart worker w0: lighthouse answered 401")


def test_worker_pointed_where_nothing_listens_names_the_address(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, printed = run_worker(url, tmp_path, "w0", "--connect-timeout", "1")
    assert code == 2
    assert "Traceback" not in printed
    last = printed.strip().splitlines()[-1]
    assert f"cannot reach the lighthouse at {url}" in last
    assert "gave up after 1 s" in last


def test_plan_that_does_not_fit_the_dataset_is_refused_at_join(tmp_path: Path) -> None:
    with Lighthouse(EpochPlan(2000, 32), min_replicas=1, join_timeout=30.0) as lighthouse:
        code, printed = run_worker(lighthouse.url, tmp_path, "w0")
    assert code == 2
    assert "Traceback" not in printed
    last = printed.strip().splitlines()[-1]
    assert "dataset_size=2000" in last and "1797 samples" in last and "--dataset-size 1797" in last
    assert not list(tmp_path.glob("steps-*.jsonl")) or not (tmp_path / "steps-w0.jsonl").read_text()


@pytest.mark.parametrize(
    ("kill", "message"),
    [
        ("garbage", "expected STEP:WORKER items separated by commas"),
        ("5:9", "worker 9 in '5:9' is not one of the 4 workers (0 to 3)"),
        ("999:1", "step 999 in '999:1' is past the run's last step 59"),
    ],
)
def test_demo_kill_schedule_errors_are_usage_errors(kill: str, message: str) -> None:
    result = CliRunner().invoke(demo_command, ["--kill", kill])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_demo_reports_restarts_and_rejoins_with_sigstop(tmp_path: Path) -> None:
    """``--signal STOP`` alone injects the default failures; each stopped worker resumes and rejoins.

    ``--restart-after 0``: the demo sends SIGCONT once the lighthouse has left the stopped worker out of its quorum
    (an event, whatever the delay), so the world shrinks each time; a delay on top of that would only wait."""
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(
        demo_command,
        [
            "--workers",
            "3",
            "--steps",
            "16",
            "--step-seconds",
            "0",
            "--restart-after",
            "0",
            "--signal",
            "STOP",
            "--run-dir",
            str(tmp_path / "run"),
            "--report",
            str(report_path),
            "--plot",
            str(tmp_path / "plot.png"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "no --kill or --mtbf given: failing worker-1 at step 4 and worker-2 at step 8" in result.output
    report = json.loads(report_path.read_text())
    assert report["failures_injected"] == 2
    assert report["restarts"] == 2 and report["rejoins"] == 2 and report["failed_rejoins"] == []
    assert report["world_sizes"][-1] == 3 and min(report["world_sizes"]) < 3
    assert report["exactly_once"] and report["global_batch_as_planned"]
    assert report["loader_audit_mismatches"] == 0
    assert report["max_param_diff_vs_reference"] < 1e-4
    assert {event["signal"] for event in report["events"] if event["kind"] == "failure"} == {"STOP"}
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "SIGSTOP worker-1" in result.output and "worker-1 rejoined" in result.output
    # the command the demo prints, in this process (test_cli runs ``python -m stalwart`` itself in a fresh one)
    audit = CliRunner().invoke(audit_command, [str(tmp_path / "run" / "audit")])
    assert audit.exit_code == 0, audit.output


def test_sigterm_to_the_demo_ends_every_worker(tmp_path: Path) -> None:
    """``stalwart demo`` forked from the preloaded forkserver (the same entry and arguments as a fresh
    ``python -m stalwart demo``, without importing torch again); its workers come from its own forkserver."""
    run_dir = tmp_path / "run"
    arguments = [
        "demo",
        "--workers",
        "2",
        "--steps",
        "100000",
        "--kill",
        "none",
        "--run-dir",
        str(run_dir),
        "--no-compare",
    ]
    demo = ForkedWorker(arguments, os.environ, tmp_path / "demo.log", entry="stalwart.cli:main")
    try:

        def started_pids() -> list[int]:
            pids = []
            for path in run_dir.glob("events-*.jsonl"):
                pids += [json.loads(line)["pid"] for line in path.read_text().splitlines() if line.strip()]
            return pids if len(pids) >= 2 else []

        pids = wait_until(started_pids, timeout=PROCESS_TIMEOUT, what="both workers to start")
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=PROCESS_TIMEOUT) == 128 + signal.SIGTERM
    finally:
        if demo.poll() is None:
            demo.kill()
    for pid in pids:
        assert not _running(pid), f"worker process {pid} outlived the demo"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return stat_fields(pid)[0] != "Z"


def test_plot_marks_failures_by_signal_rejoins_and_heals(tmp_path: Path) -> None:
    events = [
        {"kind": "failure", "worker": 1, "step": 3, "time": 0.0, "signal": "KILL"},
        {"kind": "failure", "worker": 2, "step": 5, "time": 0.0, "signal": "STOP"},
        {"kind": "restart", "worker": 1, "step": 4, "time": 0.0, "how": "restart"},
        {"kind": "rejoin", "worker": 1, "step": 6, "time": 0.0, "quorum_id": 3, "world_size": 3},
        {"kind": "heal", "worker": 1, "step": 6, "time": 0.0},
        {"kind": "failed_rejoin", "worker": 2, "step": 7, "time": 0.0, "reason": "the job ended before it joined"},
        {"kind": "hold", "step": 4, "time": 0.0, "end": 1.0},
    ]
    world_sizes = [3, 3, 3, 2, 2, 1, 3, 3]
    report = RunReport(
        steps_committed=8,
        failures_injected=2,
        failures_survived=2,
        global_batch_sizes=[32] * 8,
        global_batch_as_planned=True,
        exactly_once=True,
        duplicates=0,
        missing=0,
        loader_audit_mismatches=0,
        recovery_seconds=[],
        losses=[2.0 - 0.1 * step for step in range(8)],
        world_sizes=world_sizes,
        final_loss=1.3,
        reference_losses=[2.0 - 0.1 * step for step in range(8)],
        events=events,
        world_size_history=world_size_history(world_sizes),
    )
    marks = event_marks(report)
    assert [(mark.label, mark.step) for mark in marks] == [
        ("failure (SIGKILL)", 3),
        ("failure (SIGSTOP)", 5),
        ("rejoin", 6),
        ("heal", 6),
        ("failed rejoin", 7),
    ]
    assert marks[0].color != marks[1].color
    labels = plot_report(report, tmp_path / "plot.png")
    assert labels == [
        "loss",
        "loss without failures",
        "world size",
        "failure (SIGKILL)",
        "failure (SIGSTOP)",
        "rejoin",
        "heal",
        "failed rejoin",
    ]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.world_size_history == [(0, 3), (3, 2), (5, 1), (6, 3)]


@pytest.mark.slow
def test_readme_training_example_runs_as_written(tmp_path: Path) -> None:
    """``examples/train.py`` (the README's script) with two workers and a token, as the README launches it."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    token = "a-shared-secret"
    with Lighthouse(None, min_replicas=2, start_replicas=2, token=token, join_timeout=60.0) as lighthouse:
        environment = {**os.environ, "STALWART_LIGHTHOUSE": lighthouse.url, "STALWART_LIGHTHOUSE_TOKEN": token}
        workers = [
            subprocess.Popen(
                [sys.executable, str(script)],
                env={**environment, "STALWART_MEMBER": f"w{index}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index in range(2)
        ]
        outputs = [worker.communicate(timeout=PROCESS_TIMEOUT) for worker in workers]
        status = lighthouse.status()
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr
    printed = [stdout for stdout, _ in outputs if stdout]
    assert len(printed) == 1 and "step 80: loss" in printed[0] and "world 2" in printed[0]  # the leader's lines
    assert status["ledger"]["step"] == 100 and status["plan"]["dataset_size"] == 1024  # the script's plan


def test_demo_against_a_lighthouse_whose_plan_does_not_fit_says_why(tmp_path: Path) -> None:
    with Lighthouse(EpochPlan(2000, 64), min_replicas=1, join_timeout=30.0) as lighthouse:
        result = CliRunner().invoke(
            demo_command,
            ["--workers", "1", "--steps", "4", "--lighthouse", lighthouse.url, "--run-dir", str(tmp_path / "run")],
        )
    assert result.exit_code == 1
    assert "the workers stopped after 0 of 4 steps" in result.output
    assert "worker-0: the lighthouse's plan has dataset_size=2000" in result.output
    assert "Traceback" not in result.output


def test_the_loader_audit_recomputes_each_step_from_the_plan() -> None:
    from stalwart.launch.report import loader_audit_mismatches
    from stalwart.runtime.consistency import index_checksum

    plan = EpochPlan(100, 10, seed=1)
    records = []
    for step in range(12):
        epoch, epoch_step = divmod(step, plan.steps_per_epoch)
        indices = plan.indices(epoch, plan.step_start(epoch_step), plan.step_start(epoch_step + 1))
        records.append({"step": step, "epoch": epoch, "loaded_checksum": f"{index_checksum(epoch, indices):016x}"})
    assert loader_audit_mismatches(plan, records) == 0
    wrong = plan.indices(0, 0, 10).copy()
    wrong[3] = plan.indices(0, 10, 11)[0]
    records[0] = {**records[0], "loaded_checksum": f"{index_checksum(0, wrong):016x}"}
    records[11] = {**records[11], "epoch": 0}
    assert loader_audit_mismatches(plan, records) == 2


def test_demo_with_parity_reports_the_sharded_state_and_its_repairs(tmp_path: Path) -> None:
    """``--parity 2,1``: workers killed and restarted; exactly once, the reference's parameters, state bytes."""
    report_path = tmp_path / "report.json"
    arguments = ["--workers", "3", "--steps", "16", "--step-seconds", "0", "--restart-after", "0.5"]
    arguments += ["--parity", "2,1", "--run-dir", str(tmp_path / "run"), "--report", str(report_path)]
    result = CliRunner().invoke(demo_command, arguments)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["exactly_once"] and report["global_batch_as_planned"]
    assert report["max_param_diff_vs_reference"] < 1e-4
    assert report["rejoins"] == 2 and report["world_sizes"][-1] == 3
    parameters = sum(p.numel() for p in digits_model(0).parameters())
    expected = state_bytes(place(Parity(2, 1), [socket.gethostname()] * 3), parameters, state_elements=3)
    assert sorted(report["state_bytes_per_worker"]) == sorted(expected)
    assert report["repairs"] >= 3 and report["repair_seconds"] > 0 and report["shards_lost"] == []
    assert "sharded state per worker (KiB)" in result.output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--overlap", "1.5"], "1.5 is not in the range 0.0<=x<=1.0"),
        (["--overlap", "0.5", "--parity", "2,1"], "choose --overlap (0.5) or --parity (2,1), not both"),
        (["--parity", "3,2"], "parity k + m must be at most the number of processes (4), got 3 + 2 = 5"),
        (["--parity", "seven"], "parity must be two integers K,M such as 7,1, got 'seven'"),
    ],
)
def test_demo_redundancy_errors_are_usage_errors(arguments: list[str], message: str) -> None:
    result = CliRunner().invoke(demo_command, arguments)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
