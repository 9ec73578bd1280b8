"""The ``stalwart`` command line: lazy subcommands, a light ``import stalwart``, and one-line errors."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import stalwart
from stalwart.cli import SUBCOMMANDS, cli
from stalwart.cli.audit import EXIT_UNREADABLE, audit_command
from stalwart.cli.lighthouse import lighthouse_command
from stalwart.cli.redundancy import redundancy_command
from stalwart.cli.simulate import simulate_command
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import Changes, LighthouseState
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan

SUBPROCESS_GUARD_S = 300
"""Bounds a child process that should exit at once, so that a wrong implementation that serves fails, not hangs."""

PLAN = ["--dataset-size", "10", "--global-batch", "2"]


def run_python(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter and return the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_GUARD_S, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def run_stalwart(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``python -m stalwart ARGUMENTS`` in a real process."""
    return subprocess.run(
        [sys.executable, "-m", "stalwart", *arguments],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_GUARD_S,
        check=False,
    )


def process_refused(done: subprocess.CompletedProcess[str]) -> str:
    """Assert a real process exited non-zero with no traceback and one ``Error:`` line, its last; return that line."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    assert errors == lines[-1:], done.stderr
    return errors[0]


def refused(result: Result, *expected: str) -> str:
    """Assert a clean refusal: non-zero exit through click, no traceback, one ``Error:`` line holding ``expected``."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}"
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert result.output.rstrip().endswith(errors[0]), f"more than one line of message:\n{result.output}"
    for text in expected:
        assert text in errors[0]
    return errors[0]


@pytest.fixture
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lighthouse that should have been refused fails the test instead of serving forever."""

    def serve_forever(self: Lighthouse) -> None:
        self.stop()
        raise AssertionError("the lighthouse was started instead of refused")

    monkeypatch.setattr(Lighthouse, "serve_forever", serve_forever)


def save_state(path: Path, state: dict[str, Any]) -> None:
    store = StateStore(path)
    try:
        store.save(Changes(revision=1, core=state, formation=None, members={}, events=[]), saved_at=0.0)
    finally:
        store.close()


# --- the group ---------------------------------------------------------------------------------------------------


def test_help_lists_every_subcommand_without_importing_them() -> None:
    report = run_python(
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from stalwart.cli import cli\n"
        "result = CliRunner().invoke(cli, ['--help'])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'stalwart.cli.')))\n"
        "print(json.dumps({'exit_code': result.exit_code, 'output': result.output, 'loaded': loaded}))\n"
    )
    assert report["exit_code"] == 0, report["output"]
    assert report["loaded"] == []
    listed = report["output"].split("Commands:")[1]
    for name, (_, _, short_help) in SUBCOMMANDS.items():
        assert name in listed
        assert " ".join(short_help.split()[:3]) in " ".join(listed.split())


def test_python_m_stalwart_runs_the_group() -> None:
    done = run_stalwart("--help")
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_resolves_and_shows_its_help(name: str) -> None:
    module, attribute, _ = SUBCOMMANDS[name]
    command = getattr(importlib.import_module(module), attribute)
    assert isinstance(command, click.Command) and command.name == name
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert f"Usage: cli {name}" in result.output


def test_unknown_subcommand_is_a_usage_error() -> None:
    refused(CliRunner().invoke(cli, ["lighthose"]), "lighthose")


@pytest.mark.parametrize(
    "command", [audit_command, lighthouse_command, redundancy_command, simulate_command], ids=lambda c: c.name
)
def test_every_option_has_help(command: click.Command) -> None:
    silent = [param.name for param in command.params if isinstance(param, click.Option) and not param.help]
    assert silent == []


# --- the package -------------------------------------------------------------------------------------------------


def test_import_stalwart_does_not_import_torch() -> None:
    report = run_python(
        "import json, sys\n"
        "import stalwart\n"
        "listed = dir(stalwart)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'listed': listed}))\n"
    )
    assert report["torch"] is False
    assert set(stalwart.__all__) <= set(report["listed"])


def test_public_names_resolve_to_their_definitions_and_every_error_is_a_stalwart_error() -> None:
    from stalwart import (  # the names a user's first script imports
        Checkpointing,
        ElasticLoader,
        EpochPlan,
        Lighthouse,
        ManagedDistributedSampler,
        Manager,
        Overlap,
        Parity,
        StalwartError,
    )
    from stalwart.redundancy.config import Overlap as overlap_class
    from stalwart.runtime.config import Checkpointing as checkpointing_class
    from stalwart.runtime.loader import ElasticLoader as loader_class
    from stalwart.runtime.manager import Manager as manager_class

    assert (Manager, ElasticLoader, Overlap, Checkpointing) == (
        manager_class,
        loader_class,
        overlap_class,
        checkpointing_class,
    )
    assert Lighthouse is stalwart.coord.server.Lighthouse
    assert {EpochPlan, ManagedDistributedSampler, Parity} <= {getattr(stalwart, name) for name in stalwart.__all__}
    assert "DataLedger" not in stalwart.__all__  # data-plane internals stay in stalwart.data
    errors = [getattr(stalwart, name) for name in stalwart.__all__ if name.endswith(("Error", "Unreachable"))]
    assert len(errors) >= 15
    assert all(issubclass(error, StalwartError) for error in errors)
    for name in stalwart.__all__:
        assert getattr(stalwart, name).__name__ == name


def test_unknown_public_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'stalwart' has no attribute 'Manger'"):
        _ = stalwart.Manger
    with pytest.raises(ImportError):
        from stalwart import Manger  # noqa: F401


# --- lighthouse errors -------------------------------------------------------------------------------------------


def test_corrupt_state_file_is_refused_in_one_line(tmp_path: Path, never_serve: None) -> None:
    state = tmp_path / "state.db"
    state.write_text("not a database at all\n" * 100)
    line = refused(CliRunner().invoke(lighthouse_command, ["--min-replicas", "1", "--state", str(state)]), str(state))
    assert "not a stalwart lighthouse state" in line and "--state" in line


def test_corrupt_state_file_leaves_no_traceback_in_a_real_process(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    state.write_text("garbage")
    line = process_refused(run_stalwart("lighthouse", "--min-replicas", "1", "--state", str(state), *PLAN))
    assert line.startswith(f"Error: {state} is not a stalwart lighthouse state")


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param({"something": "else"}, id="no-plan"),
        pytest.param({"ledger": {"plan": EpochPlan(10, 2).to_dict()}}, id="plan-only"),
    ],
)
def test_malformed_stored_state_is_refused(tmp_path: Path, never_serve: None, stored: dict[str, Any]) -> None:
    state = tmp_path / "state.db"
    save_state(state, stored)
    line = refused(CliRunner().invoke(lighthouse_command, ["--min-replicas", "1", "--state", str(state)]), str(state))
    assert "not a stalwart lighthouse state" in line


def test_state_in_a_missing_directory_is_a_usage_error(tmp_path: Path, never_serve: None) -> None:
    missing = tmp_path / "no" / "such"
    result = CliRunner().invoke(lighthouse_command, ["--min-replicas", "1", "--state", str(missing / "s.db"), *PLAN])
    refused(result, "--state", str(missing))
    assert result.exit_code == 2  # click's status for a usage error
    assert not missing.exists()


def test_plan_contradicting_the_state_is_a_usage_error(tmp_path: Path, never_serve: None) -> None:
    state = tmp_path / "state.db"
    save_state(state, LighthouseState(EpochPlan(10, 2)).state_dict())
    arguments = ["--min-replicas", "1", "--state", str(state), "--dataset-size", "99"]
    refused(CliRunner().invoke(lighthouse_command, arguments), "--dataset-size", "99", str(state))


def test_balance_contradicting_the_state_is_a_usage_error(tmp_path: Path, never_serve: None) -> None:
    state = tmp_path / "state.db"
    save_state(state, LighthouseState(EpochPlan(10, 2), balance_every=5).state_dict())
    arguments = ["--min-replicas", "1", "--state", str(state), "--balance-every", "0"]
    refused(CliRunner().invoke(lighthouse_command, arguments), "--balance-every", "balance_every=5", str(state))


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--dataset-size", "10"], ("--dataset-size and --global-batch go together", "--global-batch is missing")),
        (["--global-batch", "2"], ("--dataset-size is missing",)),
        (["--seed", "3", "--window", "2"], ("--seed, --window describe a plan", "--dataset-size and --global-batch")),
    ],
)
def test_a_partial_plan_is_a_usage_error(never_serve: None, arguments: list[str], expected: tuple[str, ...]) -> None:
    """Without --dataset-size and --global-batch the plan is the first worker's; half a plan is a mistake."""
    refused(CliRunner().invoke(lighthouse_command, ["--min-replicas", "1", *arguments]), *expected)


def test_block_order_options_reach_the_plan_and_are_checked(tmp_path: Path, never_serve: None) -> None:
    arguments = ["--min-replicas", "1", *PLAN, "--block-size", "4", "--window", "5"]
    refused(CliRunner().invoke(lighthouse_command, arguments), "window must be in [1, 3], got 5")
    state = tmp_path / "state.db"
    save_state(state, LighthouseState(EpochPlan(10, 2, block_size=4)).state_dict())
    arguments = ["--min-replicas", "1", "--state", str(state), "--block-size", "2"]
    refused(CliRunner().invoke(lighthouse_command, arguments), "--block-size", "block_size=2", "block_size=4")


def test_empty_token_is_a_bad_parameter(never_serve: None) -> None:
    result = CliRunner().invoke(lighthouse_command, ["--min-replicas", "1", "--token", "", *PLAN])
    refused(result, "--token", "secrets.token_urlsafe(32)")
    assert result.exit_code == 2


def test_token_help_says_how_to_make_one_and_where_it_comes_from() -> None:
    (token,) = [param for param in lighthouse_command.params if param.name == "token"]
    assert isinstance(token, click.Option) and token.help is not None
    assert 'python -c "import secrets; print(secrets.token_urlsafe(32))"' in token.help
    assert "STALWART_LIGHTHOUSE_TOKEN" in token.help


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--min-replicas", "3", "--start-replicas", "2"], ("--start-replicas", "3", "2")),
        (["--min-replicas", "1", "--host", "0.0.0.0"], ("0.0.0.0", "no token is set", "--insecure")),
        (["--min-replicas", "1", "--header-timeout", "0"], ("--header-timeout", "0")),
        (["--min-replicas", "1", "--header-timeout", "inf"], ("--header-timeout", "inf", "3600")),
    ],
)
def test_contradicting_replicas_and_ports_are_bad_parameters(
    never_serve: None, arguments: list[str], expected: tuple[str, ...]
) -> None:
    refused(CliRunner().invoke(lighthouse_command, [*arguments, *PLAN]), *expected)


@pytest.mark.parametrize("flag", ["--port"])
def test_port_in_use_is_one_sentence_naming_the_address(flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_stalwart("lighthouse", "--min-replicas", "1", flag, str(port), *PLAN)
    line = process_refused(done)
    assert line.startswith(f"Error: 127.0.0.1:{port} ({flag}) is already in use;")


# --- audit and simulate errors -----------------------------------------------------------------------------------


def test_audit_of_a_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = CliRunner().invoke(audit_command, [str(missing)])
    refused(result, str(missing))
    assert result.exit_code == EXIT_UNREADABLE


def test_audit_of_a_directory_without_audit_files_names_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(audit_command, [str(tmp_path)])
    refused(result, f"cannot audit {tmp_path}", "audit.json")
    assert result.exit_code == EXIT_UNREADABLE


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--global-batch", "4", "--multiple", "5"], ("--multiple", "5")),
        (["--global-batch", "11", "--multiple", "4", "--drop-last"], ("dataset_size", "11")),
    ],
)
def test_simulate_refuses_a_plan_that_cannot_be(arguments: list[str], expected: tuple[str, ...]) -> None:
    result = CliRunner().invoke(simulate_command, ["--dataset-size", "11", "--workers", "2", *arguments])
    refused(result, *expected)


def test_the_lighthouse_and_its_command_import_no_torch() -> None:
    """The control plane reads plans and the ledger (``stalwart.data``) without the workers' torch."""
    code = (
        "import sys, stalwart.cli.lighthouse, stalwart.coord.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
