"""``stalwart redundancy``: state per process against ZeRO and DDP, failures survived, and usage errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from stalwart.cli import cli

WORLD = ["redundancy", "--processes", "64", "--nodes", "8"]


def run(*arguments: str) -> Result:
    return CliRunner().invoke(cli, list(arguments), terminal_width=200, env={"COLUMNS": "200"})


def row(result: Result, name: str) -> list[str]:
    """The cells of the comparison table's row ``name``."""
    for line in result.output.splitlines():
        cells = [cell.strip() for cell in line.split("\u2502")][1:-1]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in:\n{result.output}")


def test_overlap_against_zero_and_ddp() -> None:
    result = run(*WORLD, "--overlap", "0.125")
    assert result.exit_code == 0, result.output
    assert "64 processes on 8 nodes (8 each), 7,000,000,000 parameters, adam" in result.output
    assert row(result, "ZeRO")[1:] == ["overlap 0", "0 copies", "1.22 GiB", "1.00x", "1.6%", "no failure"]
    assert row(result, "chosen")[1:] == [
        "overlap 0.125",
        "8 copies",
        "11.00 GiB",
        "9.00x",
        "14.1%",
        "any 8 processes, any 7 nodes",
    ]
    assert row(result, "DDP")[3:] == ["78.23 GiB", "64.00x", "100.0%", "any 63 processes, any 7 nodes"]
    assert "any 3 nodes and any 4 more processes" in result.output


@pytest.mark.parametrize(
    ("parity", "cells", "state", "survives"),
    [
        ("7,1", "7 cells + 1 parity", "1.34 GiB", "any 1 process, any 1 node"),  # moments only: (1 + 2 / 21) ZeRO
        ("6,2", "6 cells + 2 parity", "1.49 GiB", "any 2 processes, any 2 nodes"),
    ],
)
def test_parity(parity: str, cells: str, state: str, survives: str) -> None:
    result = run(*WORLD, "--parity", parity)
    assert result.exit_code == 0, result.output
    chosen = row(result, "chosen")
    assert (chosen[2], chosen[3], chosen[-1]) == (cells, state, survives)


@pytest.mark.parametrize(
    ("size", "shown"), [("1.3B", "1,300,000,000"), ("7e9", "7,000,000,000"), ("350m", "350,000,000"), ("12", "12")]
)
def test_parameter_counts(size: str, shown: str) -> None:
    result = run(*WORLD, "--overlap", "0", "--parameters", size, "--optimizer", "sgd")
    assert result.exit_code == 0, result.output
    assert f"{shown} parameters, sgd: 2 fp32 state elements" in result.output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--overlap", "1.5"], "Invalid value for '--overlap': overlap must be in [0, 1], got 1.5"),
        (["--overlap", "nan"], "Invalid value for '--overlap': overlap must be in [0, 1], got nan"),
        (["--parity", "7"], "Invalid value for '--parity': parity must be two integers K,M such as 7,1, got '7'"),
        (["--parity", "7,0"], "Invalid value for '--parity': parity m must be in [1, inf], got 0"),
        (["--parity", "60,5"], "parity k + m must be at most the number of processes (64), got 60 + 5 = 65"),
        (["--overlap", "0.1", "--parity", "7,1"], "give exactly one of --overlap F and --parity K,M"),
        ([], "give exactly one of --overlap F and --parity K,M"),
        (["--overlap", "0", "--parameters", "lots"], "'lots' is not a parameter count such as 7e9, 1.3B or 350M"),
        (["--overlap", "0", "--parameters", "1.5"], "'1.5' must be a whole number of parameters, at least 1"),
        (["--overlap", "0", "--parameters", "0"], "'0' must be a whole number of parameters, at least 1"),
        (["--overlap", "0", "--optimizer", "lion"], "'lion' is not one of 'adam', 'sgd'"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_value(arguments: list[str], message: str) -> None:
    result = run(*WORLD, *arguments)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    ("world", "message"),
    [
        (["--processes", "8", "--nodes", "9"], "Invalid value for '--nodes': must be at most --processes (8), got 9"),
        (["--processes", "2000"], "2000 is not in the range 1<=x<=1024"),
        (
            ["--processes", "8", "--nodes", "2"],
            "cannot place parity (7, 1) over 8 processes on 2 nodes so that one node's loss is survived: "
            "node 'node0' has 4 processes",
        ),
    ],
)
def test_a_world_that_cannot_hold_the_choice_is_refused(world: list[str], message: str) -> None:
    result = run("redundancy", *world, "--parity", "7,1")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
