"""The one device-specific piece: process groups per quorum, Gloo on CPU and NCCL on GPU.

A quorum's process group is created from the quorum's store on the
lighthouse (:func:`quorum_store`, authenticated: :mod:`stalwart.runtime.store`),
so that every quorum rendezvouses afresh and a dead quorum's group is simply
abandoned (and aborted). The collectives themselves (Gloo's and NCCL's
sockets) are not authenticated: like torch.distributed, they assume a trusted
training network. Collectives have a timeout: a peer
that was SIGKILLed makes Gloo raise at once (its sockets close), a hung
(SIGSTOPped) peer makes it raise after the collective's timeout (the
communicator's ``timeout``, or a heal's own deadline); both surface as
:class:`CollectiveError`, which the Manager answers by asking for a new quorum.

On NCCL a failure must raise too, not end the process, and a dead quorum
must not hold the next one up. What torch 2.13's ``ProcessGroupNCCL`` does by
default, and what this module sets (only where unset, see
:func:`nccl_environment`) before it creates an NCCL group:

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly). The default, 3
  (SkipCleanUp), and torchrun's 1 (TearDown) make the watchdog thread rethrow
  a timed-out or failed collective's error, which ends the process. 2 aborts
  the group's communicators instead; the collective then raises. A user's 1
  or 3 is overridden (logged); a user's 0 (no handling) is kept: the Manager
  aborts the group itself.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``. With it on, a failure anywhere sets the
  process-wide (and, through the lighthouse's store, fleet-wide) dump signal,
  and the heartbeat monitor of the process's first NCCL group dumps, sleeps
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (8 min) and then ends the process
  unless that group was aborted before (aborted during the sleep, its
  destructor waits the sleep out).
- ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0``. The watchdog sleeps four times
  this (default 15 s) after any failure before it cleans up, holding the
  group's work list; dropping the group waits for it.

``TORCH_NCCL_BLOCKING_WAIT`` is not needed (nor touched): collectives are
polled with ``is_completed()`` and waited on only once complete.

An NCCL group is bound to this process's GPU (``torch.cuda.set_device``) and
connected eagerly, so that its rendezvous, like Gloo's, happens when the
Communicator is built. NCCL's connect (blocking mode, torch's default) waits
for every rank with no timeout, so it runs on a helper thread: the
Communicator gives it up at the rendezvous deadline (or when ``abandon()``
turns true), aborts the group and raises; a connect that never returns
leaves that thread behind. NCCL's watchdog times every collective out at the
group's timeout, not the collective's own, so the group's timeout is raised
to cover the longest collective (a heal's broadcast); the Communicator's own
deadlines come first. A collective whose communicator the watchdog aborted
completes without an error on the caller's work object, so its work result
is checked too.

Everything above this module is device-agnostic: it hands over tensors on
``Communicator.device`` and never names a backend.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, WorkResult  # type: ignore[attr-defined]

from stalwart.coord.protocol import StoreAddress
from stalwart.errors import StalwartError
from stalwart.runtime.store import LighthouseStore

_FIRST_POLL = 20e-6
_LAST_POLL = 1e-3
"""Polling a collective starts every 20 us (a small model's all-reduce is done in ~100 us) and backs off to 1 ms."""
_ABANDON_CHECK = 0.005
"""Seconds between two looks at ``abandon()`` while a Gloo collective's future is awaited."""
_GRACE = 1.0
"""Seconds past a collective's timeout before the Communicator gives up itself (the backend should have first)."""
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
_TEAR_DOWN_MODES = frozenset({"1", "3"})
"""TearDown and SkipCleanUp: both end the process on a collective's timeout or error."""
NCCL_ENVIRONMENT = {
    ASYNC_ERROR_HANDLING: CLEAN_UP_ONLY,
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
}
"""What an NCCL group needs for its failures to raise (see the module docstring)."""
_ALIASES = {ASYNC_ERROR_HANDLING: ("NCCL_ASYNC_ERROR_HANDLING",)}
"""Older names torch still reads when the ``TORCH_`` one is unset."""

log = logging.getLogger(__name__)
_Options = TypeVar("_Options", dist.AllToAllOptions, AllgatherOptions)


COLLECTIVE_SETTING = "collective_timeout (environment variable STALWART_COLLECTIVE_TIMEOUT)"
HEAL_SETTING = "heal_timeout or heal_min_bandwidth (STALWART_HEAL_TIMEOUT, STALWART_HEAL_MIN_BANDWIDTH)"


class CollectiveError(StalwartError, RuntimeError):
    """A collective or a group's rendezvous failed: a peer died, hung or never came."""


class Communicator:
    """A process group for one quorum, with the collectives the runtime needs."""

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
        runs (or an NCCL communicator connects), ``abandon()`` is polled: when it
        turns true (the lighthouse reports a dead member of the quorum) the
        collective is given up at once rather than at its timeout, since a
        survivor can be blocked on a peer that has itself left the collective.
        """
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.store = store
        self._abandon = abandon
        self.timeout = timeout
        self._spread: torch.Tensor | None = None
        self._group_timeout = timeout if rendezvous_timeout is None else rendezvous_timeout
        group_timeout = datetime.timedelta(seconds=self._group_timeout)
        try:
            self._group: Any | None = _new_group(store, rank, world_size, group_timeout, device, host)
            if device.type == "cuda":
                _connect(self._group, device, time.monotonic() + self._group_timeout, abandon)
                self._cover(timeout + _GRACE)
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
            work = self._live_group().allreduce([tensor], options)
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(
                f"all-reduce could not start on rank {self.rank}/{self.world_size}: {error}"
            ) from error
        return lambda: self._wait(work, "all-reduce", time.monotonic() + self.timeout + _GRACE, COLLECTIVE_SETTING)

    def broadcast(self, tensors: list[torch.Tensor], source_rank: int, *, timeout: float | None = None) -> None:
        """Overwrite ``tensors`` on every rank with the source rank's, all within ``timeout`` seconds.

        ``timeout`` defaults to the communicator's collective timeout; a heal
        passes one that fits the bytes it moves.
        """
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        self._cover(total + _GRACE)
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank = source_rank
            options.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
            self._wait(self._live_group().broadcast([tensor], options), "broadcast", deadline + _GRACE, HEAL_SETTING)

    def publish(self, key: str, value: str) -> None:
        """Put ``value`` under ``key`` in the quorum's store; :class:`CollectiveError` if the store is gone."""
        try:
            self.store.set(key, value)
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"rank {self.rank} could not write {key!r} to the quorum's store: {error}") from error

    def read(self, key: str) -> bytes:
        """The value a peer put under ``key``, waiting the store's timeout; :class:`CollectiveError` if it never came.

        A peer that died before writing its key looks like this, and is
        handled as a failed collective is.
        """
        try:
            return bytes(self.store.get(key))
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"rank {self.rank} got no {key!r} from the quorum's store: {error}") from error

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` (equal sizes on every rank), concatenated in rank order.

        ``out`` (``world_size`` times ``tensor``'s elements, its dtype and
        device) receives it when given, so that a step's gather reuses one
        buffer instead of allocating its size again.
        """
        if out is None:
            out = torch.empty(tensor.numel() * self.world_size, dtype=tensor.dtype, device=tensor.device)
        gathered, flat = out, tensor.reshape(-1)
        if self.device.type == "cuda":
            options = self._options(AllgatherOptions)
            self._run(lambda: self._live_group()._allgather_base(gathered, flat, options), "all-gather")
            return out
        # Gloo's all-gather is a ring: world_size - 1 steps, each waiting on the previous one's peer. Its
        # all-to-all posts every exchange at once: with 8 processes on 2 cores, 3M elements took half the time
        # and half the CPU (the redundancy benchmark's gather). The same bytes arrive in the same order.
        spread = self._spread_buffer(flat)
        spread.view(self.world_size, flat.numel()).copy_(flat.expand(self.world_size, flat.numel()))
        exchange = self._options(dist.AllToAllOptions)
        self._run(lambda: self._live_group().alltoall_base(gathered, spread, [], [], exchange), "all-gather")
        return out

    def _spread_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        """Room for ``world_size`` copies of ``flat`` (Gloo's all-gather): the largest asked for so far, kept."""
        size = flat.numel() * self.world_size * flat.element_size()
        if self._spread is None or self._spread.numel() < size:
            self._spread = torch.empty(size, dtype=torch.uint8, device=flat.device)
        return self._spread[:size].view(flat.dtype)

    def all_gather_bytes(self, payload: bytes, limit: int) -> list[bytes]:
        """Every rank's ``payload`` (at most ``limit`` bytes each), in rank order: its length, then its bytes.

        For a small record each rank must read from every other (the sharded
        state's reshard): two collectives instead of a store round trip per
        peer. A length over ``limit`` is a failed collective on every rank.
        """
        sizes = self.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=self.device)).tolist()
        longest = max(sizes)
        if longest > limit:
            raise CollectiveError(f"rank {sizes.index(longest)} sent a record of {longest} bytes, over {limit}")
        padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = self.all_gather(padded.to(self.device)).cpu().view(self.world_size, -1)
        return [gathered[rank, :size].numpy().tobytes() for rank, size in enumerate(sizes)]

    def all_to_all(
        self, tensor: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Send ``send_sizes[r]`` consecutive elements of ``tensor`` to each rank ``r``; what each rank sent here.

        Both size lists are per rank, in rank order; the result holds what
        rank 0 sent, then rank 1, and so on (in ``out`` when given: their sum
        of elements, ``tensor``'s dtype and device).
        """
        if out is None:
            out = torch.empty(sum(receive_sizes), dtype=tensor.dtype, device=tensor.device)
        received = out
        self._run(
            lambda: self._live_group().alltoall_base(
                received, tensor, receive_sizes, send_sizes, self._options(dist.AllToAllOptions)
            ),
            "all-to-all",
        )
        return out

    def _options(self, kind: Callable[[], _Options]) -> _Options:
        """A collective's options whose timeout is the Communicator's own deadline (``timeout`` and a grace): left
        unset, the backend times it out at the group's timeout, the rendezvous's, which can come first (a gather
        gave a slow peer 10 s with a collective timeout of 60 s)."""
        options = kind()
        options.timeout = datetime.timedelta(seconds=self.timeout + _GRACE)
        return options

    def _run(self, start: Callable[[], dist.Work], name: str) -> None:
        """Start a collective and wait for it within the collective timeout (``CollectiveError`` on failure)."""
        try:
            work = start()
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"{name} could not start on rank {self.rank}/{self.world_size}: {error}") from error
        self._wait(work, name, time.monotonic() + self.timeout + _GRACE, COLLECTIVE_SETTING)

    def abort(self) -> None:
        """Abandon the group (NCCL: ``ncclCommAbort`` ends its kernels; Gloo: a collective already waiting on a live
        peer runs on to its timeout, see :meth:`retire`)."""
        if self._group is None:
            return
        with contextlib.suppress(RuntimeError):
            self._group.abort()

    def retire(self) -> None:
        """Abort the group and destroy it on a daemon thread; the communicator is not used after.

        Gloo's abort does not end a collective still waiting on a live peer,
        and the group's destructor joins the thread running it: destroyed on
        the caller's thread (or wherever the garbage collector frees it, in
        the middle of a later step), it would stall that thread until the
        peer's group goes or the collective's timeout passes. A process that
        retires its groups closes their sockets at once, which ends its
        peers' waits. A retired communicator's collectives raise
        :class:`CollectiveError`; retiring it again does nothing.
        """
        if self._group is None:
            return
        self.abort()
        holder = [self._group]
        self._group = None
        threading.Thread(target=holder.clear, name="stalwart-retired-group", daemon=True).start()

    def _live_group(self) -> Any:
        """The process group; :class:`CollectiveError` once :meth:`retire` handed it away (its quorum is gone)."""
        if self._group is None:
            raise CollectiveError(f"rank {self.rank}/{self.world_size}'s communicator was retired: its quorum is gone")
        return self._group

    def _cover(self, seconds: float) -> None:
        """Let NCCL's watchdog wait at least ``seconds`` on a collective (it times out at the group's timeout)."""
        if self.device.type == "cuda" and seconds > self._group_timeout:
            self._group_timeout = seconds
            self._live_group().set_timeout(datetime.timedelta(seconds=seconds))

    def _wait(self, work: dist.Work, name: str, deadline: float, setting: str) -> None:
        """Wait for ``work`` while watching ``abandon()`` and the deadline.

        Gloo: the work's future wakes this thread the moment it completes (a
        poll's sleep would add a scheduler wake-up per check on a busy
        machine); ``abandon()`` is checked every ``_ABANDON_CHECK`` seconds
        meanwhile. NCCL: polled, since its future completes through the
        stream rather than on the host.
        """
        done = threading.Event()
        if self.device.type != "cuda":
            work.get_future().add_done_callback(lambda _: done.set())
        delay = _FIRST_POLL
        while not (done.is_set() or work.is_completed()):
            if self._abandon():
                raise CollectiveError(f"{name} abandoned on rank {self.rank}: a member of this quorum is dead")
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{name} on rank {self.rank}/{self.world_size} passed its deadline (raise {setting} if the "
                    "peers are alive but slow)"
                )
            if self.device.type == "cuda":
                time.sleep(delay)
                delay = min(2 * delay, _LAST_POLL)
            else:
                done.wait(_ABANDON_CHECK)
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(f"{name} failed on rank {self.rank}/{self.world_size}: {error}") from error
        failure = work_failure(work) if self.device.type == "cuda" else None
        if failure is not None:
            raise CollectiveError(f"{name} failed on rank {self.rank}/{self.world_size}: NCCL reported {failure}")


def quorum_store(
    address: StoreAddress, timeout: float, *, token: str | None, ssl_context: ssl.SSLContext | None = None
) -> dist.Store:
    """The quorum's store on the lighthouse (:class:`~stalwart.runtime.store.LighthouseStore`): every request
    authenticated with ``token`` and the quorum's store key; blocking calls wait up to ``timeout`` seconds."""
    try:
        return LighthouseStore(address, timeout, token=token, ssl_context=ssl_context)
    except ValueError as error:
        raise CollectiveError(f"cannot use the quorum's store: {error}") from error


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


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set in ``environ`` before an NCCL group is created (see the module docstring).

    :data:`NCCL_ENVIRONMENT`'s values where unset (or blank), and CleanUpOnly
    over an error handling mode that ends the process; any other value the
    user set is kept.
    """
    changes = {}
    for name, value in NCCL_ENVIRONMENT.items():
        current = _setting(environ, name)
        if current is None or (name == ASYNC_ERROR_HANDLING and current in _TEAR_DOWN_MODES):
            changes[name] = value
    return changes


def work_failure(work: Any) -> str | None:
    """The failure the backend recorded on a completed ``work`` (``"TIMEOUT"``...), None if none (yet).

    NCCL's watchdog records a timeout or error in the work's result before it
    aborts the communicator; the aborted collective then completes, and the
    caller's work object raises nothing.
    """
    result = work.get_future_result()
    if not result.done():
        return None
    value = int(result.value())
    return None if value == int(WorkResult.SUCCESS) else WorkResult(value).name


def _setting(environ: Mapping[str, str], name: str) -> str | None:
    """``name``'s value as torch reads it (or its older alias's), None when unset or blank."""
    for key in (name, *_ALIASES.get(name, ())):
        value = environ.get(key, "").strip()
        if value:
            return value
    return None


def _connect(group: Any, device: torch.device, deadline: float, abandon: Callable[[], bool]) -> None:
    """Create ``group``'s NCCL communicator on a helper thread; abort the group and raise if it is not up in time."""
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            group.eager_connect_single_device(device)
        except BaseException as error:  # handed to the caller
            failure.append(error)

    thread = threading.Thread(target=connect, name="stalwart-nccl-connect", daemon=True)
    thread.start()
    delay = _FIRST_POLL
    while thread.is_alive():
        abandoned = abandon()
        if abandoned or time.monotonic() > deadline:
            with contextlib.suppress(RuntimeError):
                group.abort()
            why = "a member of this quorum is dead" if abandoned else "not every rank came before the deadline"
            raise CollectiveError(f"NCCL communicator on {device} not created: {why}")
        thread.join(delay)
        delay = min(2 * delay, _LAST_POLL)
    if failure:
        raise failure[0]


def _new_group(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device, host: str
) -> Any:
    """A Gloo or NCCL group (their common base class is not typed in torch's stubs)."""
    if device.type == "cuda":
        changes = nccl_environment(os.environ)
        for name, value in changes.items():
            if _setting(os.environ, name) is not None:
                log.info("setting %s=%s: %s ends the process on a failure", name, value, _setting(os.environ, name))
        os.environ.update(changes)
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
