"""The one device-specific piece: process groups per quorum, Gloo on CPU and NCCL on GPU.

A quorum's process group is created from the lighthouse's TCPStore under the
quorum's prefix, so that every quorum rendezvouses afresh and a dead quorum's
group is simply abandoned (and aborted). Collectives have a timeout: a peer
that was SIGKILLed makes Gloo raise at once (its sockets close), a hung
(SIGSTOPped) peer makes it raise after the collective's timeout (the
communicator's ``timeout``, or a heal's own deadline); both surface as
:class:`CollectiveError`, which the Manager answers by asking for a new quorum.

Everything above this module is device-agnostic: it hands over tensors on
``Communicator.device`` and never names a backend.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

_FIRST_POLL = 20e-6
_LAST_POLL = 1e-3
"""Polling a collective starts every 20 us (a small model's all-reduce is done in ~100 us) and backs off to 1 ms."""
_GRACE = 1.0
"""Seconds past a collective's timeout before the Communicator gives up itself (the backend should have first)."""


class CollectiveError(RuntimeError):
    """A collective or a group's rendezvous failed: a peer died, hung or never came."""


class Communicator:
    """A process group for one quorum, with the two collectives the runtime needs."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        timeout: float,
        device: torch.device,
        host: str = "127.0.0.1",
        abandon: Callable[[], bool] = lambda: False,
        rendezvous_timeout: float | None = None,
    ) -> None:
        """Rendezvous as ``rank`` of ``world_size`` on ``store`` (see :func:`quorum_store`).

        The rendezvous may take ``rendezvous_timeout`` seconds (default
        ``timeout``); each collective ``timeout`` seconds unless given its own.

        ``host`` is the address peers reach this process on. While a collective
        runs, ``abandon()`` is polled: when it turns true (the lighthouse reports
        a dead member of the quorum) the collective is given up at once rather
        than at its timeout, since a survivor can be blocked on a peer that has
        itself left the collective.
        """
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.store = store
        self._abandon = abandon
        self.timeout = timeout
        group_timeout = datetime.timedelta(seconds=timeout if rendezvous_timeout is None else rendezvous_timeout)
        try:
            self._group: Any = _new_group(store, rank, world_size, group_timeout, device, host)
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"rendezvous of rank {rank}/{world_size} failed: {error}") from error

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start summing ``tensor`` across the group in place; call the result to wait for it.

        On failure the launch or the waiting raises :class:`CollectiveError`
        and the tensor's content is undefined. The waiting gives up
        ``timeout`` seconds after it starts (a bucket launched early in
        backward waits for its peers' backward too).
        """
        options = dist.AllreduceOptions()
        options.timeout = datetime.timedelta(seconds=self.timeout)
        try:
            work = self._group.allreduce([tensor], options)
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(
                f"all-reduce could not start on rank {self.rank}/{self.world_size}: {error}"
            ) from error
        return lambda: self._wait(work, "all-reduce", time.monotonic() + self.timeout + _GRACE)

    def broadcast(self, tensors: list[torch.Tensor], source_rank: int, *, timeout: float | None = None) -> None:
        """Overwrite ``tensors`` on every rank with the source rank's, all within ``timeout`` seconds.

        ``timeout`` defaults to the communicator's collective timeout; a heal
        passes one that fits the bytes it moves.
        """
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank = source_rank
            options.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
            self._wait(self._group.broadcast([tensor], options), "broadcast", deadline + _GRACE)

    def abort(self) -> None:
        """Abandon the group: pending collectives end, sockets close."""
        with contextlib.suppress(RuntimeError):
            self._group.abort()

    def _wait(self, work: dist.Work, name: str, deadline: float) -> None:
        delay = _FIRST_POLL
        while not work.is_completed():
            if self._abandon():
                raise CollectiveError(f"{name} abandoned on rank {self.rank}: a member of this quorum is dead")
            if time.monotonic() > deadline:
                raise CollectiveError(f"{name} on rank {self.rank}/{self.world_size} passed its deadline")
            time.sleep(delay)
            delay = min(2 * delay, _LAST_POLL)
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"{name} failed on rank {self.rank}/{self.world_size}: {error}") from error


def quorum_store(host: str, port: int, prefix: str, timeout: float) -> dist.Store:
    """The quorum's view of the lighthouse's TCPStore: every key under ``prefix``."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as error:
        raise CollectiveError(f"cannot reach the quorum's store at {host}:{port}: {error}") from error
    return dist.PrefixStore(prefix, store)


def default_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """The GPU of this process's ``LOCAL_RANK`` (torchrun's) when CUDA is available (NCCL), else the CPU (Gloo).

    Without ``LOCAL_RANK`` it is CUDA's current device; two processes of one
    launch must not share a GPU, so a ``LOCAL_RANK`` that is not a valid
    device index is an error naming it.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = (os.environ if environ is None else environ).get("LOCAL_RANK")
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if not local_rank.isdigit() or int(local_rank) >= count:
        raise ValueError(f"LOCAL_RANK must be a GPU index in [0, {count - 1}], got {local_rank!r}")
    return torch.device("cuda", int(local_rank))


def device_rng_states() -> dict[str, Any]:
    """The accelerator's generators as stateful objects under reserved names: ``rng/cuda`` when CUDA is available."""
    if torch.cuda.is_available():
        return {"rng/cuda": _CudaRNGState()}
    return {}


class _CudaRNGState:
    """Every CUDA device's default generator (``torch.cuda.get_rng_state_all()``)."""

    def state_dict(self) -> dict[str, Any]:
        return {"states": torch.cuda.get_rng_state_all()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.cuda.set_rng_state_all([state.cpu() for state in state_dict["states"]])


def _new_group(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device, host: str
) -> Any:
    """A Gloo or NCCL group (their common base class is not typed in torch's stubs)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
