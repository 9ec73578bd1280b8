"""Worker processes forked from one interpreter that imported torch once (multiprocessing's forkserver).

Why not ``python -m stalwart.launch.worker`` every time: a fresh interpreter
spends about 1.3 s of CPU importing torch before it does anything, and the
test suite and the demo start hundreds of workers. The forkserver imports
:data:`PRELOAD` once, in a clean single-threaded process started for the
purpose, and forks each worker from it (never from the caller, whose threads
could hold a lock at the fork). Each worker is still a process of its own,
with its own sockets, killed by real signals; :class:`ForkedWorker` answers
what :class:`subprocess.Popen` does (``pid``, ``poll``, ``wait``,
``send_signal``, ``kill``, ``returncode``). It runs the stalwart worker, or
another module's entry (the benchmarks' instrumented worker in quick runs).

A child gets the environment it is given, but what torch reads when it is
imported (``OMP_NUM_THREADS`` for OpenMP's pool) has the forkserver's values;
the Manager sets its thread count itself. A benchmark that measures what a
relaunch costs starts real interpreters instead
(``LocalCluster(..., preloaded=False)``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import multiprocessing.util  # its exit hook registers now, before this module's (which must run first)
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch._dynamo",  # imported by the first optimizer a worker builds: 0.4 s of CPU
    "stalwart.launch.worker",
]
"""Modules the forkserver imports before it forks anything (one missing is skipped, as multiprocessing does)."""

_ALSO_PRELOADED: list[str] = []
"""Modules a caller added with :func:`preload_also`."""

_STARTED: list[multiprocessing.process.BaseProcess] = []
"""Forked workers that may still run (ended ones are dropped at each start)."""


def preloaded_context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server preloaded with :data:`PRELOAD` (started on first use)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *_ALSO_PRELOADED])
    return context


def preload_also(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, for a caller that forks many workers of one kind (the tests'
    torchtitan groups: 1.9 s of CPU each for torchtitan's imports, paid once instead).

    The server imports them when it starts, at the first fork of this
    process: call this before it (a later call is kept for a server started
    again, and changes nothing of the running one). A module that cannot be
    imported is skipped there, as multiprocessing does with :data:`PRELOAD`.
    """
    for module in modules:
        if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"modules must be dotted module names (as 'torchtitan.train'), got {module!r}")
    _ALSO_PRELOADED.extend(module for module in modules if module not in _ALSO_PRELOADED)


def _run_entry(entry: str, argv: list[str], environ: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` (its ``entry``) with this environment and log."""
    # multiprocessing makes "forkserver" the default start method of a process the forkserver forked; a fresh
    # interpreter has the platform's default, and the worker's DataLoader workers must start as they would there
    # (their watchdog follows the process that started them: one forked by a forkserver outlives a killed worker)
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    module, function = entry.split(":")
    sys.argv = [module, *argv]
    getattr(importlib.import_module(module), function)()


class ForkedWorker:
    """A ``python -m MODULE`` process forked from the preloaded forkserver, used like ``subprocess.Popen``.

    ``argv``: the module's options; ``environ``: its whole environment;
    ``log_path``: where its stdout and stderr go (appended); ``entry``:
    ``MODULE:FUNCTION``, what ``python -m MODULE`` calls (the stalwart worker
    unless given; a benchmark's worker too), reading its options from
    ``sys.argv``.
    """

    def __init__(
        self,
        argv: Sequence[str],
        environ: Mapping[str, str],
        log_path: Path,
        entry: str = "stalwart.launch.worker:run",
    ) -> None:
        if entry.count(":") != 1 or not all(entry.split(":")):
            raise ValueError(f"entry must be 'MODULE:FUNCTION' (as 'stalwart.launch.worker:run'), got {entry!r}")
        self.args = [entry.split(":")[0], *argv]
        self._process = preloaded_context().Process(
            target=_run_entry,
            args=(entry, list(argv), dict(environ), os.getcwd(), str(log_path)),
            name=f"forked-{os.path.basename(log_path)}",
        )
        self._process.start()
        _STARTED[:] = [process for process in _STARTED if process.exitcode is None]
        _STARTED.append(self._process)

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None  # started in __init__
        return pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it), or None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signal_number: int) -> None:
        """Send a signal, unless the process has ended (as ``Popen.send_signal``)."""
        if self.poll() is None:
            # the forkserver, not this process, reaps the worker and then sends its exit status: between the two,
            # poll() still says "running" but the pid is gone (as Popen.send_signal, an ended process is no error)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@atexit.register
def _kill_live_workers() -> None:
    """At exit, SIGKILL forked workers still running: multiprocessing would otherwise wait for them to end.

    Registered after multiprocessing's own exit hook, so it runs first.
    """
    for process in _STARTED:
        if process.exitcode is None and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended since
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, signal.SIGKILL)
            process.join(10.0)
