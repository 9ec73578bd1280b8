"""Durable checkpoints of a member's whole state through ``torch.distributed.checkpoint`` (DCP).

One member (the quorum's rank 0) writes every ``every_steps`` steps or
``every_seconds`` seconds, asynchronously (``dcp.async_save`` stages the
tensors, then writes them in the background while training goes on). A
checkpoint is the directory ``DIR/step-000000123/``: DCP's files for the
tensors and values (model and optimizer through
``torch.distributed.checkpoint.state_dict``, so the optimizer's state is keyed
by parameter names and loads into a fresh optimizer, plus every registered
state), and ``stalwart.json`` with the applied step, the ledger and its
digest. The JSON file is written last, atomically: a directory without it is
an unfinished checkpoint and is never loaded. Once the lighthouse vouches for
a checkpoint, older ones are deleted but for the ``keep - 1`` newest.

Every member holds the whole state (replicated training), so a checkpoint
loads at any world size. A member that is an FSDP2 group holds it across its
processes: all of them write their shards through a process group of their
own (``process_group``, Gloo, since the save runs on DCP's thread beside
the training's collectives), the group's rank 0 finishing the checkpoint, and
every process of a loading group reads what its shards need (DCP reshards),
so such a checkpoint loads at any number of groups.

DCP's metadata file is pickled: checkpoints are trusted files on the job's
own storage, never data received over the network; a worker loads only from
inside its own checkpoint directory, and a finished checkpoint's files are
readable by their owner only (0600, directories 0700).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.errors import StalwartError
from stalwart.runtime.config import Checkpointing
from stalwart.runtime.state import Stateful

log = logging.getLogger(__name__)

META_FILE = "stalwart.json"
FORMAT_VERSION = 1
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: half a second of CPU that a process that never
    checkpoints does not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _state_dicts() -> Any:
    """``torch.distributed.checkpoint.state_dict``, imported on first use (see :func:`_dcp`)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What DCP raises: its ``CheckpointException`` derives from ``BaseException`` (``except Exception`` misses it)."""
    return (Exception, _dcp().api.CheckpointException)


class CheckpointError(StalwartError, RuntimeError):
    """A checkpoint cannot be written or loaded (the message names the directory and why)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``stalwart.json`` records of a checkpoint: the applied step, the ledger there and its digest."""

    step: int
    ledger: dict[str, Any]
    digest: str

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"format": FORMAT_VERSION, "step": self.step, "ledger": self.ledger, "digest": self.digest}

    @classmethod
    def read(cls, directory: Path) -> CheckpointMeta:
        """Read ``directory/stalwart.json``; :class:`CheckpointError` if it is missing or malformed."""
        path = directory / META_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["format"] != FORMAT_VERSION:
                raise ValueError(f"format {data['format']!r} is not {FORMAT_VERSION}")
            return cls(int(data["step"]), dict(data["ledger"]), str(data["digest"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{directory} is not a finished stalwart checkpoint: {error}") from None


def write_meta(directory: Path, meta: CheckpointMeta) -> None:
    """Write ``stalwart.json`` atomically and durably: the file's bytes, then the rename, then the directory."""
    staging = directory / f".{META_FILE}.tmp"
    with open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "w", encoding="utf-8") as file:
        file.write(json.dumps(meta.to_json()))
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, directory / META_FILE)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def owner_only(directory: Path) -> None:
    """Make a checkpoint's files (DCP's pickled metadata among them) readable by their owner only."""
    directory.chmod(DIRECTORY_MODE)
    for path in directory.rglob("*"):
        path.chmod(DIRECTORY_MODE if path.is_dir() else FILE_MODE)


def checkpoint_directory(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lies under ``root``."""
    return root / f"step-{step:09d}"


def _step_of(directory: Path) -> int:
    return int(directory.name.removeprefix("step-"))


def finished_checkpoints(root: Path) -> list[Path]:
    """The finished checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.glob("step-*") if (path / META_FILE).is_file())


class Checkpointer:
    """Decides when to checkpoint and writes one checkpoint at a time in the background, keeping the newest.

    ``on_finished(directory, meta)`` is called (on DCP's writer thread) once a
    checkpoint is finished, so that it is reported at once, even while the
    training loop waits.
    """

    def __init__(
        self,
        config: Checkpointing,
        *,
        on_finished: Callable[[Path, CheckpointMeta], None] | None = None,
        process_group: Any = None,
        finishes: bool = True,
    ) -> None:
        """``process_group``: the processes that write each checkpoint together (None: this one alone);
        ``finishes``: this process marks a written checkpoint finished (the group's rank 0)."""
        self.process_group = process_group
        self.finishes = finishes
        self.root = config.path
        self.every_steps = config.every_steps
        self.every_seconds = config.every_seconds
        self.keep = config.keep
        self.on_finished = on_finished
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._idle = threading.Event()
        self._idle.set()

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether a checkpoint of ``step`` is due (and none is still being written).

        Never at step 0: there is nothing to save yet, and reading a fresh
        optimizer's state through ``get_state_dict`` would initialise it (a
        zero step), leaving the writer's optimizer unlike its peers'. Never
        when a finished checkpoint of that step exists: a job resumed from it
        holds the same state, and other members may be loading it. ``last``:
        the job's last step, checkpointed whatever the cadence.
        """
        if not self._idle.is_set() or step == self._last_step or step == 0:
            return False
        if (checkpoint_directory(self.root, step) / META_FILE).is_file():
            return False  # finished already (the one a resumed job loaded): never rewrite what others may load
        if last:
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds

    def start(self, states: dict[str, Stateful], meta: CheckpointMeta) -> None:
        """Start writing ``states`` at ``meta.step`` (the tensors are staged before this returns)."""
        directory = checkpoint_directory(self.root, meta.step)
        shutil.rmtree(directory, ignore_errors=True)
        self.root.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        directory.mkdir(mode=DIRECTORY_MODE, exist_ok=True)
        self._last_step, self._last_time = meta.step, time.monotonic()
        self._idle.clear()
        try:
            response = _dcp().async_save(
                _state_to_save(states), checkpoint_id=str(directory), process_group=self.process_group
            )
        except _dcp_errors() as error:
            self._idle.set()
            raise CheckpointError(f"cannot start the checkpoint of step {meta.step} in {directory}: {error}") from None
        except BaseException:
            self._idle.set()
            raise
        future = response if isinstance(response, Future) else response.upload_completion
        future.add_done_callback(lambda done: self._finish(done, directory, meta))

    def prune(self, vouched_step: int) -> None:
        """Delete finished checkpoints older than ``vouched_step`` (the one the lighthouse now resumes from),
        keeping the ``keep - 1`` newest of them. Never one at or after it: a checkpoint the lighthouse
        does not vouch for yet (written, not yet reported) may be the next it resumes from."""
        older = [path for path in finished_checkpoints(self.root) if _step_of(path) < vouched_step]
        for path in older[: max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no checkpoint is being written (and the last one was reported); False on timeout."""
        return self._idle.wait(timeout)

    def _finish(self, future: Future[Any], directory: Path, meta: CheckpointMeta) -> None:
        """Mark a written checkpoint finished (``stalwart.json``, atomically) and hand it to ``on_finished``.

        In a group only rank 0 does: DCP completes its save once every
        process's files are written, so nothing is left to wait for then.
        """
        try:
            future.result()
            if not self.finishes:
                return
            owner_only(directory)
            write_meta(directory, meta)
            if self.on_finished is not None:
                self.on_finished(directory, meta)
        except _dcp_errors() as error:  # disk full, a failed write: the next due step writes again
            log.warning("checkpoint of step %d in %s failed: %s", meta.step, directory, error)
        finally:
            self._idle.set()


def load_checkpoint(
    directory: str | os.PathLike[str], states: dict[str, Stateful], *, process_group: Any = None
) -> CheckpointMeta:
    """Load a finished checkpoint into ``states`` (model, optimizer and registered states); returns its meta.

    ``process_group``: the processes that load it together (an FSDP2 group's, each reading its shards).
    """
    directory = Path(directory)
    meta = CheckpointMeta.read(directory)
    template = _state_to_save(states)
    try:
        _dcp().load(template, checkpoint_id=str(directory), process_group=process_group)
    except _dcp_errors() as error:
        raise CheckpointError(f"cannot load the checkpoint in {directory}: {error}") from None
    model, optimizer = states["model"], states["optimizer"]
    assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
    _state_dicts().set_state_dict(
        model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optimizer"]
    )
    for name, obj in states.items():
        if name not in ("model", "optimizer"):
            obj.load_state_dict(template["states"][name])
    return meta


def _state_to_save(states: dict[str, Stateful]) -> dict[str, Any]:
    """DCP's state dict: model and optimizer keyed by parameter names, then every other state by name."""
    model, optimizer = states["model"], states["optimizer"]
    assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
    model_state, optimizer_state = _state_dicts().get_state_dict(model, optimizer)
    others = {name: obj.state_dict() for name, obj in states.items() if name not in ("model", "optimizer")}
    return {"model": model_state, "optimizer": optimizer_state, "states": others}
