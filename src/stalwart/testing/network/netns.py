"""The network-fault harness's I/O half: a private bridge of network namespaces, processes in them, and faults.

:class:`Bridge` builds a :class:`~stalwart.testing.network.topology.Topology`
(root only: ``ip netns``, veth pairs, a bridge), runs processes inside its
namespaces (:meth:`Bridge.spawn`: ``ip netns exec``; :meth:`Bridge.fork`: a
stalwart worker forked from the preloaded forkserver, which enters its
namespace with ``setns``), talks to servers there from a thread that entered
the namespace (:meth:`Bridge.call_in`), and injects the faults real networks have:

- :meth:`Bridge.set_link`: a node's NIC down (or up again);
- :meth:`Bridge.set_blackhole`: a blackhole route on one side only (an asymmetric cut);
- :meth:`Bridge.set_partition`: a silent drop both ways between two nodes;
- :meth:`Bridge.set_rate`: a token-bucket rate limit on a node's link.

Leaving the ``with`` block (or a failure, or the interpreter's exit: a
finalizer) kills the processes it started and deletes its namespaces, which
deletes every interface, route and rule in them. Namespaces of a dead owner
(a test killed before its cleanup) are swept when a bridge is made.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from stalwart.launch.processes import ForkedWorker
from stalwart.testing.network.topology import (
    Topology,
    blackhole_command,
    drop_command,
    link_command,
    owner_tag,
    rate_commands,
    setup_commands,
    stale_namespaces,
    subnet_for,
)

T = TypeVar("T")
COMMAND_TIMEOUT = 30.0
"""Seconds one ``ip``/``tc`` command may take (they take milliseconds; a busy machine more)."""
STOP_TIMEOUT = 10.0
"""Seconds a process has to end after SIGKILL before the cleanup goes on without it."""
NAMESPACE_VARIABLE = "STALWART_NETNS"
"""The environment variable that tells :func:`run_worker_in_namespace` which namespace to enter."""
_CLONE_NEWNET = 0x40000000
_COUNTER = itertools.count()


class Process(Protocol):
    """What the cleanup needs of a started process (``subprocess.Popen`` and ``ForkedWorker`` both have it)."""

    def poll(self) -> int | None: ...
    def send_signal(self, signal_number: int) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace``: the sockets it opens from now on are there."""
    with open(f"/run/netns/{namespace}", "rb") as handle:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")


def run_worker_in_namespace() -> None:
    """A forked worker's entry (:meth:`Bridge.fork`): enter ``$STALWART_NETNS``, then run the stalwart worker."""
    from stalwart.launch.worker import run

    enter_namespace(os.environ[NAMESPACE_VARIABLE])
    run()


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip``/``tc``), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not installed"
    return None


def _run(command: Sequence[str]) -> None:
    """Run one ``ip``/``tc`` command; ``RuntimeError`` with its stderr when it fails."""
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")


def _list_namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces this harness made for processes that no longer run; returns their names."""
    stale = stale_namespaces(_list_namespaces(), _pid_alive)
    for name in stale:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            _run(["ip", "netns", "del", name])
    return stale


def _remove(namespaces: list[str], processes: list[Process]) -> None:
    """Kill ``processes`` and delete ``namespaces`` (the cleanup; also the finalizer, so no state of its own)."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.kill()
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)
    for name in reversed(namespaces):
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            _run(["ip", "netns", "del", name])


class Bridge:
    """Nodes (each a network namespace with one address) on a private bridge; a context manager.

    ``nodes``: short lowercase names (``"lh"``, ``"w0"``...). The network is
    built on ``__enter__`` and removed, with every process started in it, on
    ``__exit__`` (:meth:`close`).
    """

    def __init__(self, nodes: Sequence[str]) -> None:
        counter = next(_COUNTER)
        self.topology = Topology(owner_tag(os.getpid(), counter), subnet_for(os.getpid(), counter), tuple(nodes))
        self.processes: list[Process] = []
        self._made: list[str] = []
        self._finalizer = weakref.finalize(self, _remove, self._made, self.processes)

    def __enter__(self) -> Bridge:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        sweep_stale()
        try:
            for command in setup_commands(self.topology):
                _run(command)
                if command[:3] == ["ip", "netns", "add"]:
                    self._made.append(command[3])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the processes started here and delete the namespaces (idempotent)."""
        self._finalizer()

    def address(self, node: str) -> str:
        """``node``'s address on the bridge."""
        return self.topology.address(node)

    def namespace(self, node: str) -> str:
        """``node``'s network namespace."""
        return self.topology.namespace(node)

    def spawn(
        self, node: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``node``'s namespace, its stdout and stderr appended to ``log_path``.

        ``ip netns exec`` executes the command in place, so the process's pid
        is the command's: a signal sent to it reaches the command itself.
        """
        command = ["ip", "netns", "exec", self.namespace(node), *argv]
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env or os.environ)
            )
        self.processes.append(process)
        return process

    def fork(self, node: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> ForkedWorker:
        """Start ``python -m stalwart.launch.worker ARGV`` inside ``node``'s namespace, forked from the preloaded
        forkserver (:mod:`~stalwart.launch.processes`): torch is imported already, so it starts in a fraction of
        a second instead of the seconds a fresh interpreter takes on a busy machine."""
        environ = {**env, NAMESPACE_VARIABLE: self.namespace(node)}
        process = ForkedWorker(argv, environ, log_path, entry=f"{__name__}:run_worker_in_namespace")
        self.processes.append(process)
        return process

    def call_in(self, node: str, function: Callable[[], T], timeout: float = 30.0) -> T:
        """``function()`` on a thread that entered ``node``'s namespace: the sockets it opens are there.

        How the test process talks to a server in a namespace (the
        lighthouse's ``/v1/status``) without starting an interpreter there.
        """
        outcome: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                enter_namespace(self.namespace(node))
                outcome.append(function())
            except BaseException as error:  # handed to the caller below
                failure.append(error)

        thread = threading.Thread(target=run, name=f"in-{self.namespace(node)}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"call in {self.namespace(node)} did not return within {timeout} s")
        if failure:
            raise failure[0]
        return outcome[0]

    def set_link(self, node: str, up: bool) -> None:
        """``node``'s NIC down (it reaches nobody, nobody reaches it) or up again."""
        _run(link_command(self.topology, node, up))

    def set_blackhole(self, node: str, peers: Sequence[str], cut: bool) -> None:
        """On ``node``'s side only, route ``peers`` into a blackhole (``cut``) or restore them: asymmetric."""
        for peer in peers:
            _run(blackhole_command(self.topology, node, peer, cut))

    def set_partition(self, left: Sequence[str], right: Sequence[str], cut: bool) -> None:
        """Silently drop every packet between any node of ``left`` and any of ``right`` (both ways), or stop."""
        for a in left:
            for b in right:
                _run(drop_command(self.topology, a, b, cut))
                _run(drop_command(self.topology, b, a, cut))

    def set_rate(self, node: str, rate: str | None) -> None:
        """Limit ``node``'s link both ways to ``rate`` (``"128kbit"``), or lift the limit (None)."""
        for command in rate_commands(self.topology, node, rate):
            _run(command)
