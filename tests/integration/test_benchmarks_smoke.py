"""Smoke tests of the benchmarks: ``--quick`` runs end to end and prints its tables.

Benchmarks are not tests: nothing here judges a timing or a memory number,
only that the runs that should have been measured were.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_quick(capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """Run a benchmark's ``main`` in this process; what it printed to stdout (its exit status must be 0).

    The README's commands are ``python -m benchmarks.NAME``, and one test below
    runs one that way; the others call the same ``main`` here, where torch,
    the library and the forkserver that forks their workers are already
    loaded: a fresh interpreter and its own forkserver cost 4-8 s of CPU per
    benchmark before it measured anything. The module is imported here, not
    at collection, which every pytest process does (``-m "not integration"`` too).
    """

    def run(module: str, *args: str) -> str:
        environ = dict(os.environ)  # what the benchmark sets for its own children is not left to later tests
        os.environ["COLUMNS"] = "240"  # wide enough that no header wraps
        capsys.readouterr()
        try:
            code = importlib.import_module(module).main(list(args))
        finally:
            os.environ.clear()
            os.environ.update(environ)
        output = capsys.readouterr().out
        assert code in (0, None), output[-3000:]
        return output

    return run


@pytest.mark.slow
def test_quick_run_prints_every_table_and_goal(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.data_plane", "--quick")
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
    """As the README runs it, ``python -m benchmarks.redundancy`` in a fresh interpreter (its cheapest section)."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.redundancy", "--quick", "--sections", "1"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "240"},  # wide enough that no header wraps
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
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


def test_redundancy_quick_training_run_measures_every_row(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.redundancy", "--quick", "--sections", "2")
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
    assert re.search(r"(met|MISSED): overlap 0 step time at most 1\.02x DDP's \(\d+\.\d{3}x\)", output), output


def test_sharded_wire_quick_run_measures_every_variant(run_quick: Callable[..., str]) -> None:
    """Every variant timed; bytes by the algorithms' counts (4 processes: 3/4 of the gradient per collective).

    The workers check first that the reduce-scattered path delivers the all-reduce's shards, forwards and
    gather (a wrong one ends them, and the run with them).
    """
    output = run_quick("benchmarks.sharded_wire", "--quick")
    expected = {
        "ddp": ("1.500", "1.000x"),
        "zero-1": ("2.250", "1.500x"),
        "zero-2": ("1.500", "1.000x"),
        "zero-2 +1": ("1.750", "1.167x"),
        "zero-2 +2": ("2.000", "1.333x"),
    }
    for variant, sent in expected.items():
        cells = _table_row(output, variant)
        assert tuple(cells[1:3]) == sent, cells
        assert float(cells[3].split()[0]) > 0 and cells[4].endswith("x") and float(cells[6]) >= 0, cells
    assert _table_row(output, "ddp")[4] == "1.000x"


# The refusals, too, run the benchmarks' ``main`` in this process: argparse refuses before anything is measured.
def test_redundancy_rejects_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import redundancy

    with pytest.raises(SystemExit) as exited:
        redundancy.main(["--sections", "3"])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "--sections" in stderr and "'3'" in stderr


def test_redundancy_refuses_a_run_dir_that_holds_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Records are appended to: an earlier run's would be read as this one's."""
    from benchmarks import redundancy

    (tmp_path / "earlier-worker-0.jsonl").write_text("{}\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        redundancy.main(["--sections", "2", "--run-dir", str(tmp_path)])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "--run-dir" in stderr and str(tmp_path) in stderr


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


def test_runtime_quick_run_prints_every_table_and_goal(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.runtime", "--quick")
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


def test_hsdp_recovery_measures_a_failure(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.hsdp_recovery", "--quick")
    assert "recovery (s)" in output and "rejoin (s)" in output
    assert "recovery from a SIGKILL under 1 s" in output
    assert "not measured" not in output


def test_stragglers_quick_run_measures_both_runs(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.stragglers", "--quick")
    # columns: round, order, equal (ms), balanced (ms), ratio, weights, exact
    cells = _table_row(output, "1", "equal then balanced")
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0, cells
    assert len(cells[5].split()) == 3 and cells[6] == "yes", cells


def test_lighthouse_scale_runs_every_phase(tmp_path: Path, run_quick: Callable[..., str]) -> None:
    report = tmp_path / "scale.json"
    arguments = ["--members", "48", "--processes", "1", "--seconds", "0.5", "--step-seconds", "0.1"]
    output = run_quick("benchmarks.lighthouse_scale", *arguments, "--report", str(report), "--compare", str(report))
    (result,) = json.loads(report.read_text())
    assert "error" not in result, result["error"]
    assert result["joined"] == 48 and len(result["steady"]) == 3
    for phase in ("failure", "mass_failure"):
        measured = result[phase]
        # one quorum; or one formed ahead of the survivors' requests that a stale report withdrew (or a later death
        # broke), then one from the requests (docs/protocol.md, "Forming a failure quorum ahead")
        formed, ahead = measured["quorums"], measured["quorums_ahead"]
        assert 1 <= formed <= 2 and formed - ahead <= 1, measured
        assert measured["answered"] == measured["survivors"], measured
        assert measured["formed_ms"] is not None and measured["push_observers_ms"] is not None, measured
        assert measured["seen_after_ms"] <= measured["last_seen_ms"] <= measured["formed_ms"], measured
    for title in ("One lighthouse, simulated members on 127.0.0.1", "Before and after", "Goals"):
        assert title in output


def test_goodput_quick_run_replays_the_trace_against_every_system(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.goodput", "--quick")
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


@pytest.mark.slow
def test_streams_quick_run_measures_every_case_and_goal(run_quick: Callable[..., str]) -> None:
    output = run_quick("benchmarks.data_streams", "--quick")
    assert "Hugging Face stream, 8 JSON-lines shards of 120 rows" in output and "Goals" in output
    for case in ("split_dataset_by_node", "+ shuffle", "ShardedStream", "interleave=4", "content keys"):
        assert output.count(case) >= 2, case  # at 2 x 2 and at 3 x 2
    assert "NO" not in output.split("Goals")[0], "every case covered the epoch exactly once"
    goal_lines = [line for line in output.splitlines() if line.lstrip().startswith(("met:", "MISSED:"))]
    assert len(goal_lines) == 2
