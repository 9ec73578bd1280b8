"""Replica groups as torchrun would start them: two worker processes per group, against a lighthouse of their own."""

from __future__ import annotations

import datetime
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch.distributed as dist

from stalwart._validate import check_int
from stalwart.data.plan import EpochPlan
from stalwart.launch.processes import ForkedWorker

GROUP_STEPS = 24
GROUP_PLAN = EpochPlan(1797, 48, seed=0, local_batch_multiple=4)
"""The digits job for groups of two: every group's share splits by intra-group rank into multiples of 4."""
GROUP_TIMEOUT = 60.0
"""Seconds the group's store waits for a key, and ``end_group`` for the processes to end (bounds, not expectations)."""
_WATCH_SECONDS = 0.05


class ForkedGroup:
    """The processes of one replica group, started and ended as torchrun's agent does, without the agent.

    Why not ``torchrun --standalone``: its agent and each worker are fresh
    interpreters that import torch (seconds of CPU per launch). Here the
    workers are forked from the preloaded forkserver
    (:mod:`stalwart.launch.processes`) with the environment torchrun gives
    them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/
    ``MASTER_PORT`` of a store in this process standing for the agent's), and
    a watcher thread does the agent's job: when one process fails it SIGKILLs
    the others, and the group's ``returncode`` is 0 only if every process
    ended with 0 (1 otherwise, as torchrun's). torchrun itself is tested where
    it is the subject (``test_torchx``, ``test_sampler_dropin``). ``entry``:
    what each process runs (``MODULE:FUNCTION``, the stalwart worker unless
    given; the torchtitan tests' launcher too).
    """

    def __init__(
        self,
        argv: Sequence[str],
        environ: Mapping[str, str],
        log_path: Path,
        processes: int = 2,
        entry: str = "stalwart.launch.worker:run",
    ) -> None:
        check_int("processes", processes, minimum=1)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT)
        )
        common = {
            **environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self._store.port),
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 joins this store instead of hosting its own
        }
        self._workers = [
            ForkedWorker(argv, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}, log_path, entry)
            for rank in range(processes)
        ]
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._watch, name=f"group-watcher-{log_path.stem}", daemon=True).start()

    def _watch(self) -> None:
        """The agent's loop: the only poller of the processes (their exit status is read once)."""
        while True:
            codes = [worker.poll() for worker in self._workers]
            if any(code not in (None, 0) for code in codes):
                for worker, code in zip(self._workers, codes, strict=True):
                    if code is None:
                        worker.kill()
            if all(code is not None for code in codes):
                self.returncode = 0 if all(code == 0 for code in codes) else 1
                self._ended.set()
                return
            time.sleep(_WATCH_SECONDS)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until every process ended; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["stalwart.launch.worker"], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def worker_pids(self) -> dict[int, int]:
        """Intra-group rank -> pid."""
        return {rank: worker.pid for rank, worker in enumerate(self._workers)}

    def kill(self) -> None:
        """SIGKILL every process still running (the watcher then records the group's end)."""
        for worker in self._workers:
            worker.kill()


def launch_group(
    url: str, name: str, run_dir: Path, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> ForkedGroup:
    """Two digits workers forming replica group ``name``, for ``GROUP_STEPS`` steps.

    ``extra``: more worker options; ``env``: variables added to the group's
    environment. The log goes to ``run_dir/NAME.log``.
    """
    argv = [
        "--lighthouse", url, "--member", name, "--run-dir", str(run_dir),
        "--max-steps", str(GROUP_STEPS), "--max-microbatch", "4", "--collective-timeout", "1.0",
        "--step-seconds", "0.25", *extra,
    ]  # fmt: skip
    return ForkedGroup(argv, {**os.environ, **(env or {})}, run_dir / f"{name}.log")


def end_group(group: ForkedGroup) -> None:
    """SIGKILL a group's processes still running and wait for its end (bounded)."""
    group.kill()
    group.wait(timeout=GROUP_TIMEOUT)


def worker_pids(group: ForkedGroup) -> dict[int, int]:
    """Intra-group rank -> pid of the group's processes."""
    return group.worker_pids()
