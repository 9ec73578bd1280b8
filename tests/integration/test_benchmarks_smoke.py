"""Smoke tests of the benchmarks: ``--quick`` runs end to end and prints its tables.

Benchmarks are not tests: nothing here judges a timing or a memory number,
only that the runs that should have been measured were.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_benchmark(
    *args: str, module: str = "benchmarks.data_plane", timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "240"}  # wide enough that no header wraps
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_quick_run_prints_every_table_and_goal() -> None:
    completed = _run_benchmark("--quick")
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout
    for title in (
        "1. First batch of an epoch",
        "2. Ledger cost per step",
        "3. Index throughput of EpochPlan.indices on one core",
        "4. A member's reads from shards against a sequential read of the same shards",
        "Goals",
    ):
        assert title in output
    for header in (
        "torch first batch (ms)",
        "stalwart first batch (ms)",
        "speed ratio",
        "torch peak memory (MiB)",
        "stalwart peak memory (MiB)",
        "memory ratio",
        "median (us)",
        "M indices/s",
        "member rows/s",
        "sequential rows/s",
    ):
        assert header in output
    assert "(estimate)" in output  # the stalwart-only row says torch's figures are extrapolated
    statuses = ("met:", "MISSED:", "not measured:")
    goal_lines = [line for line in output.splitlines() if line.lstrip().startswith(statuses)]
    assert len(goal_lines) == 4


def test_redundancy_quick_run_measures_every_codec() -> None:
    completed = _run_benchmark("--quick", "--sections", "1", module="benchmarks.redundancy")
    assert completed.returncode == 0, completed.stderr
    assert "2. Partial redundancy" not in completed.stdout
    assert "1. Parity codec throughput" in completed.stdout
    for leading in (
        ("(7, 1)", "XOR"),
        ("(6, 2)", "Reed-Solomon, pyeclib isa_l_rs_cauchy"),
        ("(6, 2)", "Reed-Solomon, pyeclib isa_l_rs_vand"),
    ):
        cells = _table_row(completed.stdout, *leading)
        assert all(cell.replace(",", "").isdigit() for cell in cells[-3:]), cells


def test_redundancy_quick_training_run_measures_every_row() -> None:
    completed = _run_benchmark("--quick", "--sections", "2", module="benchmarks.redundancy", timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout
    assert "2. Partial redundancy in training" in output and "1. Parity codec" not in output
    # columns: configuration, state, vs formula, step, by run, vs overlap 0, vs DDP, CPU vs DDP, peak, recovery,
    # reshard, lost, vs checkpoint-restart
    ddp = _table_row(output, "DDP")
    assert ddp[2] == "1.000" and ddp[6] == ddp[7] == "1.000x" and float(ddp[8]) > 0, ddp
    assert _table_row(output, "overlap 0")[9:11] == ["lost", "lost"]  # no copy: one failure loses a shard
    for label in ("overlap 1/4", "parity (3, 1)"):
        cells = _table_row(output, label)
        assert cells[2] == "1.000", cells  # measured state bytes equal the formula's
        assert cells[7].endswith("x") and float(cells[7][:-1]) > 0, cells  # its CPU per step against DDP's
        assert all(float(cells[index]) > 0 for index in (3, 8, 9, 10)), cells
        assert cells[11] == "0" and cells[12].endswith("x"), cells  # no step lost; against checkpoint-restart
    restart = _table_row(output, "checkpoint-restart, K=4")
    assert float(restart[8]) > 0 and float(restart[9]) > 0, restart  # its peak memory and averaged recovery
    assert restart[10].startswith("first step ") and restart[11] == "0 (2 trained twice)", restart  # step 6 from 4
    assert "no step lost (2 survivable failure runs, 0 steps lost)" in output
    assert "faster than checkpoint-restart's" in output


# The two refusals run the benchmarks' ``main`` in this process: argparse refuses before anything is measured,
# and a fresh interpreter would spend 3-8 s importing what the refusal never reaches. They import the benchmarks
# themselves (2.9 s), so that collecting this module (every pytest process, `-m "not integration"` too) does not.
def test_redundancy_rejects_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import redundancy

    with pytest.raises(SystemExit) as exited:
        redundancy.main(["--sections", "3"])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "--sections" in stderr and "'3'" in stderr


def test_unknown_argument_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import data_plane

    with pytest.raises(SystemExit) as exited:
        data_plane.main(["--no-such-option"])
    assert exited.value.code == 2
    assert "--no-such-option" in capsys.readouterr().err


def _table_row(output: str, *leading: str) -> list[str]:
    """The cells of the first table row whose leading cells are ``leading``."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("\u2502")][1:-1]  # rich's vertical box line
        if cells[: len(leading)] == list(leading):
            return cells
    raise AssertionError(f"no table row starts with {leading}")


def test_runtime_quick_run_prints_every_table_and_goal() -> None:
    env = {**os.environ, "COLUMNS": "240"}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.runtime", "--quick"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout
    for title in (
        "1. Per-step time and memory without failures",
        "1b. Where a step's time goes",
        "2. Recovery: signal to the next step committed by a new quorum",
        "3. Work lost per failure",
        "Goals",
    ):
        assert title in output
    for header in (
        "median (ms)",
        "vs DDP",
        "CPU vs DDP",
        "peak memory (MiB)",
        "memory vs DDP (MiB)",
        "all-reduce (ms)",
        "failure to quorum (s)",
        "sample-gradients recomputed",
        "samples lost (never trained)",
    ):
        assert header in output
    for row in ("torchft", "SIGKILL", "SIGSTOP", "checkpoint-restart, K=10"):
        assert row in output
    # Table 1's columns: model, workers, variant, median, p90, vs DDP, by round, CPU, CPU vs DDP, peak memory, ...
    for variant in ("ddp", "stalwart", "fsdp2"):  # measured, not a "not run" note
        cells = _table_row(output, "tiny", "2", variant)
        assert float(cells[3]) > 0 and float(cells[7]) > 0 and float(cells[9]) >= 0, cells
        assert cells[5].endswith("x") and cells[8].endswith("x"), cells
    assert _table_row(output, "tiny", "2", "ddp")[5] == "1.000x"  # the baseline
    statuses = ("met:", "MISSED:", "not measured:")
    goal_lines = [line for line in output.splitlines() if line.lstrip().startswith(statuses)]
    assert len(goal_lines) == 9


def test_hsdp_recovery_measures_a_failure() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.hsdp_recovery", "--quick"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "240"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "recovery (s)" in completed.stdout and "rejoin (s)" in completed.stdout
    assert "recovery from a SIGKILL under 1 s" in completed.stdout
    assert "not measured" not in completed.stdout


def test_stragglers_quick_run_measures_both_runs() -> None:
    env = {**os.environ, "COLUMNS": "240"}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.stragglers", "--quick"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # columns: round, order, equal (ms), balanced (ms), ratio, weights, exact
    cells = _table_row(completed.stdout, "1", "equal then balanced")
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0, cells
    assert len(cells[5].split()) == 3 and cells[6] == "yes", cells


def test_lighthouse_scale_runs_every_phase(tmp_path: Path) -> None:
    report = tmp_path / "scale.json"
    arguments = ["--members", "48", "--processes", "1", "--seconds", "0.5", "--step-seconds", "0.1"]
    completed = _run_benchmark(
        *arguments, "--report", str(report), "--compare", str(report), module="benchmarks.lighthouse_scale"
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = json.loads(report.read_text())
    assert "error" not in result, result["error"]
    assert result["joined"] == 48 and len(result["steady"]) == 3
    for phase in ("failure", "mass_failure"):
        measured = result[phase]
        assert measured["quorums"] == 1 and measured["answered"] == measured["survivors"], measured
        assert measured["formed_ms"] is not None and measured["push_observers_ms"] is not None, measured
    for title in ("One lighthouse, simulated members on 127.0.0.1", "Before and after", "Goals"):
        assert title in completed.stdout


def test_goodput_quick_run_replays_the_trace_against_every_system() -> None:
    completed = _run_benchmark("--quick", module="benchmarks.goodput", timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout
    assert "Goodput under one failure trace" in output
    # columns: system, failures, failure-free (s), with failures (s), vs stalwart, goodput, by round,
    # per worker-second, lost, twice, note
    measured = ["stalwart", "checkpoint-restart"]
    torchft = _table_row(output, "torchft")
    if torchft[1] == "-":
        assert "not installed" in torchft[-1], torchft
    else:
        measured.append("torchft")
    for system in measured:
        cells = _table_row(output, system)
        assert int(cells[1]) >= 1, cells  # the trace's failures reached every system
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[5].endswith("%") and cells[7].endswith("%"), cells
    stalwart = _table_row(output, "stalwart")
    assert (stalwart[8], stalwart[9]) == ("0", "0"), stalwart  # exactly once through the failures
    assert _table_row(output, "checkpoint-restart")[8] == "0"  # it rolls back: nothing lost
    statuses = ("met:", "MISSED:", "not measured:")
    goal_lines = [line for line in output.splitlines() if line.lstrip().startswith(statuses)]
    assert len(goal_lines) == 3


def test_streams_quick_run_measures_every_case_and_goal() -> None:
    completed = _run_benchmark("--quick", module="benchmarks.data_streams", timeout=300)
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout
    assert "Hugging Face stream, 8 JSON-lines shards of 400 rows" in output and "Goals" in output
    for case in ("split_dataset_by_node", "+ shuffle", "ShardedStream", "interleave=4", "content keys"):
        assert output.count(case) >= 2, case  # at 2 x 2 and at 3 x 2
    assert "NO" not in output.split("Goals")[0], "every case covered the epoch exactly once"
    goal_lines = [line for line in output.splitlines() if line.lstrip().startswith(("met:", "MISSED:"))]
    assert len(goal_lines) == 2
