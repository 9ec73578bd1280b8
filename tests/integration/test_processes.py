"""Workers forked from the preloaded forkserver behave as ``python -m stalwart.launch.worker`` processes do.

The worker's own environment, working directory and log reach the child (not
the forkserver's, which started earlier), exit statuses and signals read as
``subprocess.Popen``'s, and a wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from stalwart.launch.processes import ForkedWorker
from stalwart.testing.groups import ForkedGroup
from stalwart.testing.waiting import wait_until

TIMEOUT = 120.0  # a bound on a busy machine, not an expectation
UNREACHABLE = ["--lighthouse", "http://127.0.0.1:9", "--member", "w", "--max-steps", "2"]


def test_the_environment_and_log_are_the_workers_own_and_its_exit_status_is_popens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    environ = {**os.environ, "STALWART_COLLECTIVE_TIMEOUT": "not-a-number"}
    log = tmp_path / "worker.log"
    worker = ForkedWorker([*UNREACHABLE, "--run-dir", "run"], environ, log)
    assert worker.wait(timeout=TIMEOUT) == 1 == worker.returncode == worker.poll()
    text = log.read_text()
    assert "STALWART_COLLECTIVE_TIMEOUT='not-a-number' must be a positive finite number" in text
    assert (tmp_path / "run").is_dir(), "the run directory is relative to the caller's working directory"
    usage = ForkedWorker(["--no-such-option"], os.environ, log)
    assert usage.wait(timeout=TIMEOUT) == 2, "argparse's usage error keeps its exit status"
    assert "the following arguments are required: --lighthouse" in log.read_text()


def test_a_signal_ends_it_as_popen_reports_and_a_wait_is_bounded(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = ForkedWorker([*UNREACHABLE, "--run-dir", str(tmp_path), "--connect-timeout", "600"], os.environ, log)
    assert worker.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(timeout=0.2)
    wait_until(lambda: log.exists(), timeout=TIMEOUT, what="the forked worker to open its log")
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=TIMEOUT) == -signal.SIGKILL
    worker.kill()  # an ended worker is not signalled again (its pid may be another process's by now)


def test_another_module_runs_as_python_dash_m_would_and_a_malformed_entry_is_refused(tmp_path: Path) -> None:
    source, target = tmp_path / "in.json", tmp_path / "out.json"
    source.write_text('{"b": 1, "a": [2]}')
    tool = ForkedWorker(
        ["--sort-keys", "--compact", str(source), str(target)], os.environ, tmp_path / "tool.log", "json.tool:main"
    )
    assert tool.wait(timeout=TIMEOUT) == 0, (tmp_path / "tool.log").read_text()
    assert target.read_text().strip() == '{"a":[2],"b":1}', "the options reached the entry through sys.argv"
    for entry in ("json.tool", "json.tool:", ":main", "a:b:c"):
        with pytest.raises(ValueError, match=f"entry must be 'MODULE:FUNCTION'.*got '{entry}'"):
            ForkedWorker([], os.environ, tmp_path / "never.log", entry)


def test_a_forked_group_runs_any_entry_with_torchruns_variables_and_ends_as_torchrun_does(tmp_path: Path) -> None:
    entry, log = "tests.integration.forked_rank:main", tmp_path / "group.log"
    with pytest.raises(ValueError, match=r"processes must be in \[1, inf\], got 0"):
        ForkedGroup([str(tmp_path)], os.environ, log, 0, entry)
    group = ForkedGroup([str(tmp_path)], os.environ, log, 2, entry)
    assert group.wait(timeout=TIMEOUT) == 0, log.read_text()
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(found["RANK"], found["LOCAL_RANK"], found["WORLD_SIZE"]) for found in seen] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"] is not None
    failing = ForkedGroup(
        [str(tmp_path), "--failing-rank", "1", "--status", "3", "--others-wait"], os.environ, log, 2, entry
    )
    assert failing.wait(timeout=TIMEOUT) == 1, "a process failed: the group failed, as torchrun's agent reports it"
