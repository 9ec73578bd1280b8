"""Workers forked from the preloaded forkserver behave as ``python -m stalwart.launch.worker`` processes do.

The worker's own environment, working directory and log reach the child (not
the forkserver's, which started earlier), exit statuses and signals read as
``subprocess.Popen``'s, and a wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from stalwart.launch.processes import ForkedWorker
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
