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
Communicator is built.

Neither backend's rendezvous keeps to its timeout. NCCL's connect (blocking
mode, torch's default) waits for every rank with no timeout. Gloo's
``connectFullMesh`` (inside ``ProcessGroupGloo``'s constructor) applies the
timeout to each of its waits, not to the whole: one store key after another,
then one pair after another, and a pair's passive side waits for its
initiator whatever the initiator's fate. With a peer that fails its connects
at once (its routes to the others blackholed), the ranks waiting for it sat
five timeouts (50 s under a 10 s ``rendezvous_timeout``) in the constructor,
which cannot be interrupted. So both run on a helper thread
(:class:`_Rendezvous`): the Communicator gives it up at the rendezvous deadline
(or when ``abandon()`` turns true), aborts what exists of the group, and
raises; the thread ends when the backend gives up, and drops whatever it
built then. Before it connects each rank writes ``arrived/<rank>`` (with the
address of its reachability probe, :mod:`stalwart.runtime.probe`) to the
store, so that a rendezvous given up names the ranks that never came
(:func:`arrivals`). NCCL's watchdog times every collective out at the
group's timeout, not the collective's own, so the group's timeout is raised
to cover the longest collective (a heal's broadcast); the Communicator's own
deadlines come first. A collective whose communicator the watchdog aborted
completes without an error on the caller's work object, so its work result
is checked too.

Exit: the thread that destroys a retired group (:meth:`Communicator.retire`)
is not a daemon. A group's destructor runs in C++ with the GIL released; a
daemon thread still inside it when the interpreter finalizes takes the GIL
back on its way out, and Python (before 3.14) ends it with ``pthread_exit``,
whose forced unwinding through a ``noexcept`` C++ frame calls
``std::terminate``: ``terminate called without an active exception``, exit
134 after a correct run (the group ``close()`` retired, still being
destroyed, 17-25 ms after a heal's group, when the script returned). The
interpreter joins non-daemon threads before it finalizes, so an exit waits
for it: milliseconds, or a pending collective's timeout. The thread that
builds a group (:class:`_Rendezvous`) stays a daemon: a rendezvous given up
on a broken network sits in Gloo's connect for up to five rendezvous
timeouts (50 s by default), which an exit must not wait for, and it returns
into Python during the few milliseconds of a finalization only by a rare
coincidence, where the destroy thread of a just-retired group did so at
every late rejoin.

Everything above this module is device-agnostic: it hands over tensors on
``Communicator.device`` and never names a backend.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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
_ABANDON_CHECK = 0.025
_LAST_ABANDON_CHECK = 0.05
"""Seconds between two looks at ``abandon()`` while a Gloo collective is waited on: 25 ms, then 50 ms. A
wait for a peer still in its backward (tens of milliseconds) mostly ends before the first look, each look being a
wake-up the step pays for; a quorum the lighthouse reported broken is still given up within 50 ms."""
_GRACE = 1.0
"""Seconds past a collective's timeout before the Communicator gives up itself (the backend should have first)."""
ARRIVED = "arrived/"
"""Each rank's key in its group's store, written before it connects: its probe address (see :func:`arrivals`)."""
_MAX_ADDRESS = 300
"""Longest probe address read from a peer (a host name and a port)."""
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


class Failure(enum.Enum):
    """How a collective or a rendezvous ended: what a diagnosis of its peers starts from."""

    ERROR = "error"
    """The backend raised: a socket closed or reset, a connect refused, a store that did not answer."""
    TIMEOUT = "timeout"
    """Its deadline passed with a peer silent."""
    ABANDONED = "abandoned"
    """Given up because the lighthouse reported a member of the quorum dead."""


class CollectiveError(StalwartError, RuntimeError):
    """A collective or a group's rendezvous failed: a peer died, hung or never came.

    ``failure`` says how it ended; ``missing`` lists the ranks that never came
    to a rendezvous given up (empty for a collective).
    """

    def __init__(self, message: str, *, failure: Failure = Failure.ERROR, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.failure = failure
        self.missing = tuple(missing)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt_error, (str(self), self.failure, self.missing)


def _rebuilt_error(message: str, failure: Failure, missing: tuple[int, ...]) -> CollectiveError:
    """A pickled CollectiveError back (its keyword arguments are not positional)."""
    return CollectiveError(message, failure=failure, missing=missing)


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
        reach: str = "",
        before_collective: Callable[[], None] = lambda: None,
    ) -> None:
        """Rendezvous as ``rank`` of ``world_size`` on ``store`` (see :func:`quorum_store`).

        The rendezvous may take ``rendezvous_timeout`` seconds (default
        ``timeout``); each collective ``timeout`` seconds unless given its own.
        Given up, it raises :class:`CollectiveError` naming the ranks that
        never came. ``reach`` (the ``host:port`` of this process's probe
        listener, or empty) is published with this rank's arrival.

        ``host`` is the address peers reach this process on. While a collective
        runs (or an NCCL communicator connects), ``abandon()`` is polled: when it
        turns true (the lighthouse reports a dead member of the quorum) the
        collective is given up at once rather than at its timeout, since a
        survivor can be blocked on a peer that has itself left the collective.
        ``before_collective()`` runs before each collective is issued (the
        session's wait for a leader's ``on_leader`` work this process went on
        from); a :class:`CollectiveError` it raises fails that collective.
        """
        if not isinstance(reach, str) or len(reach) > _MAX_ADDRESS:
            raise ValueError(f"reach must be a host:port of at most {_MAX_ADDRESS} characters, got {reach!r:.80}")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.store = store
        self._abandon = abandon
        self._before_collective = before_collective
        self.timeout = timeout
        self._spread: torch.Tensor | None = None
        self._group_timeout = timeout if rendezvous_timeout is None else rendezvous_timeout
        group_timeout = datetime.timedelta(seconds=self._group_timeout)
        deadline = time.monotonic() + self._group_timeout
        try:
            store.set(f"{ARRIVED}{rank}", reach)
            # the builder's closures go to the helper thread only: a group given up is dropped there, never here
            rendezvous = _Rendezvous(*_group_builder(store, rank, world_size, group_timeout, device, host))
            self._group: Any | None = rendezvous.result(deadline, abandon)
            if device.type == "cuda":
                self._cover(timeout + _GRACE)
        except _GaveUp as given_up:
            self._group = None
            missing = _missing(store, rank, world_size)
            lacking = f"ranks {list(missing)} never came" if missing else "every rank came, not every peer connected"
            raise CollectiveError(
                f"rendezvous of rank {rank}/{world_size} failed: given up, {given_up} ({lacking})",
                failure=given_up.failure,
                missing=missing,
            ) from None
        except (RuntimeError, dist.DistError) as error:
            self._group = None
            missing = _missing(store, rank, world_size)
            lacking = f"; ranks {list(missing)} never came" if missing else ""
            raise CollectiveError(
                f"rendezvous of rank {rank}/{world_size} failed: {error}{lacking}",
                failure=_failure_of(error),
                missing=missing,
            ) from error

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
        except CollectiveError:
            raise
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
        except CollectiveError:
            raise
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
        """Abort the group and destroy it on a helper thread; the communicator is not used after.

        Gloo's abort does not end a collective still waiting on a live peer,
        and the group's destructor joins the thread running it: destroyed on
        the caller's thread (or wherever the garbage collector frees it, in
        the middle of a later step), it would stall that thread until the
        peer's group goes or the collective's timeout passes. A process that
        retires its groups closes their sockets at once, which ends its
        peers' waits. A retired communicator's collectives raise
        :class:`CollectiveError`; retiring it again does nothing.

        The helper is not a daemon (see the module docstring, "Exit"): the
        interpreter's exit waits for the destructor (milliseconds, at most the
        pending collective's timeout) instead of aborting the process.
        """
        if self._group is None:
            return
        self.abort()
        holder = [self._group]  # no local name may hold the group: the caller's frame would destroy it last
        self._group = None
        threading.Thread(target=holder.clear, name="stalwart-retired-group", daemon=False).start()

    def _live_group(self) -> Any:
        """The process group, for a collective about to be issued (after ``before_collective()``);
        :class:`CollectiveError` once :meth:`retire` handed it away (its quorum is gone)."""
        self._before_collective()
        return self._unretired_group()

    def _unretired_group(self) -> Any:
        """The process group, for what is not a collective; :class:`CollectiveError` once it was retired."""
        if self._group is None:
            raise CollectiveError(f"rank {self.rank}/{self.world_size}'s communicator was retired: its quorum is gone")
        return self._group

    def _cover(self, seconds: float) -> None:
        """Let NCCL's watchdog wait at least ``seconds`` on a collective (it times out at the group's timeout)."""
        if self.device.type == "cuda" and seconds > self._group_timeout:
            self._group_timeout = seconds
            self._unretired_group().set_timeout(datetime.timedelta(seconds=seconds))

    def _wait(self, work: dist.Work, name: str, deadline: float, setting: str) -> None:
        """Wait for ``work`` while watching ``abandon()`` and the deadline.

        Gloo: the work is waited on in C++ (its ``wait`` with a timeout, the
        GIL released), in slices of ``_ABANDON_CHECK`` seconds growing to
        ``_LAST_ABANDON_CHECK``, with ``abandon()`` and the deadline checked
        between them: a collective that completes within the first slice
        wakes this thread once and runs no Python on Gloo's thread, as DDP's
        own wait. NCCL: polled, since its work completes through the stream
        rather than on the host.
        """
        delay = _FIRST_POLL if self.device.type == "cuda" else _ABANDON_CHECK
        while not self._finished_within(work, delay):
            if self._abandon():
                raise CollectiveError(
                    f"{name} abandoned on rank {self.rank}: a member of this quorum is dead", failure=Failure.ABANDONED
                )
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{name} on rank {self.rank}/{self.world_size} passed its deadline (raise {setting} if the "
                    "peers are alive but slow)",
                    failure=Failure.TIMEOUT,
                )
            if self.device.type == "cuda":
                time.sleep(delay)
                delay = min(2 * delay, _LAST_POLL)
            else:
                delay = min(2 * delay, _LAST_ABANDON_CHECK)
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(
                f"{name} failed on rank {self.rank}/{self.world_size}: {error}", failure=_failure_of(error)
            ) from error
        failure = work_failure(work) if self.device.type == "cuda" else None
        if failure is not None:
            raise CollectiveError(
                f"{name} failed on rank {self.rank}/{self.world_size}: NCCL reported {failure}",
                failure=Failure.TIMEOUT if failure == "TIMEOUT" else Failure.ERROR,
            )

    def _finished_within(self, work: dist.Work, seconds: float) -> bool:
        """Whether ``work`` completed, or failed, within ``seconds`` (NCCL: whether it has, now)."""
        if self.device.type == "cuda":
            return bool(work.is_completed())
        try:
            work.wait(datetime.timedelta(seconds=seconds))
        except (RuntimeError, dist.DistError):  # the slice ran out, or the work failed (the last wait raises it)
            return bool(work.is_completed())
        return True


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


def arrivals(store: dist.Store, world_size: int) -> dict[int, str] | None:
    """The ranks of ``store``'s group that came to its rendezvous, each with the probe address it published ("" if
    none); None when the store stopped answering (nobody can be named then).

    One look when every rank came (a collective's failure), one per rank
    otherwise.
    """
    keys = [f"{ARRIVED}{rank}" for rank in range(world_size)]
    try:
        if store.check(keys):
            return {rank: _address(value) for rank, value in enumerate(store.multi_get(keys))}
        return {rank: _address(store.get(key)) for rank, key in enumerate(keys) if store.check([key])}
    except (RuntimeError, dist.DistError) as error:
        log.info("the quorum's store did not answer who came to the rendezvous (%s)", error)
        return None


def _address(value: bytes) -> str:
    """A published probe address, or "" when it is not one this process would read (not ASCII, too long)."""
    raw = bytes(value)
    return raw.decode("ascii") if len(raw) <= _MAX_ADDRESS and raw.isascii() else ""


def _missing(store: dist.Store, rank: int, world_size: int) -> tuple[int, ...]:
    """The ranks other than ``rank`` that never wrote their arrival to ``store`` (none named if it did not answer)."""
    came = arrivals(store, world_size)
    return () if came is None else tuple(peer for peer in range(world_size) if peer != rank and peer not in came)


def _failure_of(error: BaseException) -> Failure:
    """A backend's error as a :class:`Failure`: Gloo and NCCL say "timed out"/"timeout" when a deadline passed."""
    text = str(error).lower()
    return Failure.TIMEOUT if "timed out" in text or "timeout" in text else Failure.ERROR


class _GaveUp(Exception):
    """A rendezvous given up at its deadline or because the quorum broke."""

    def __init__(self, why: str, failure: Failure) -> None:
        super().__init__(why)
        self.failure = failure


class _Rendezvous:
    """One group's creation and connect on a helper thread, which the caller can give up without waiting for it.

    ``create`` builds the group (Gloo: its whole rendezvous, in the
    constructor); ``connect`` finishes it (NCCL: the eager connect). A thread
    whose rendezvous was given up aborts and drops what it built when the
    backend returns: a group's destructor can block, and this thread may.
    A daemon (see the module docstring, "Exit"): an exit does not wait for a
    rendezvous given up on a broken network.
    """

    def __init__(self, create: Callable[[], Any], connect: Callable[[Any], None]) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._group: Any | None = None
        self._failure: BaseException | None = None
        self._given_up = False
        threading.Thread(target=self._run, args=(create, connect), name="stalwart-rendezvous", daemon=True).start()

    def _run(self, create: Callable[[], Any], connect: Callable[[Any], None]) -> None:
        group: Any | None = None
        try:
            group = create()
            with self._lock:
                if not self._given_up:
                    self._group = group
            if self._group is group:
                connect(group)
        except BaseException as error:  # handed to the caller
            self._failure = error
        with self._lock:
            self._done.set()
            if self._given_up and group is not None:
                _abort(group)  # the caller has gone: this thread drops the group (its frame's end)

    def result(self, deadline: float, abandon: Callable[[], bool]) -> Any:
        """The connected group; the backend's error; :class:`_GaveUp` at ``deadline`` or once ``abandon()``."""
        delay = _FIRST_POLL
        while not self._done.wait(delay):
            abandoned = abandon()
            if (abandoned or time.monotonic() > deadline) and self._give_up():
                why = "a member of this quorum is dead" if abandoned else "its deadline passed"
                raise _GaveUp(why, Failure.ABANDONED if abandoned else Failure.TIMEOUT)
            delay = min(2 * delay, _LAST_POLL)
        if self._failure is not None:
            raise self._failure
        return self._group

    def _give_up(self) -> bool:
        """Give the rendezvous up unless it finished meanwhile; abort what exists of the group (NCCL: that ends its
        connect). The helper thread still holds the group, and drops it."""
        with self._lock:  # no local name holds the group: the helper thread's is the last reference
            if self._done.is_set():
                return False
            self._given_up = True
            if self._group is not None:
                _abort(self._group)
            self._group = None
        return True


def _abort(group: Any) -> None:
    """Abort ``group``, whatever its state."""
    with contextlib.suppress(RuntimeError):
        group.abort()


def _group_builder(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device, host: str
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """How to build a Gloo or NCCL group (their common base class is not typed in torch's stubs): what creates it
    and what connects it, both for :class:`_Rendezvous`'s helper thread.

    The NCCL group is created here, on the caller's thread (its constructor
    returns at once, and the CUDA device set is per thread); Gloo's
    constructor is its rendezvous.
    """
    if device.type == "cuda":
        changes = nccl_environment(os.environ)
        for name, value in changes.items():
            if _setting(os.environ, name) is not None:
                log.info("setting %s=%s: %s ends the process on a failure", name, value, _setting(os.environ, name))
        os.environ.update(changes)
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        return (lambda: group), (lambda made: made.eager_connect_single_device(device))
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return (lambda: dist.ProcessGroupGloo(store, rank, world_size, gloo)), (lambda _: None)
