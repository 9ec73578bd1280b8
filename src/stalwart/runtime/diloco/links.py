"""DiLoCo's links between replica groups: the group's and the cross-group communicators and the exchanges on them.

Each quorum gets, on its store, a communicator of the group's own processes
(its inner steps' reductions, the gather of an exchanged fragment's slices)
and one of the processes at the same rank in every group (the fragments'
exchanges, on a thread of their own so that an exchange overlaps the next
inner steps). The configuration is compared across groups when they
connect, and processes one mid-round exchange behind take the fragment from
one ahead.

FSDP2 groups: process r of each group holds shard r of every parameter, so
it exchanges its whole shards with process r of the others (the cross-group
communicator as before) and nothing is gathered in the group; the group's
communicator carries only the inner steps' tails (FSDP2's reduce-scatter
sums the gradients in the group, and a communicator of this process alone
takes the reducer's buckets); and a process one mid-round exchange behind
takes the fragment from the same rank of a group ahead.

What is exchanged when is :class:`~stalwart.runtime.diloco.rounds.RoundLoop`'s.
"""

from __future__ import annotations

import contextlib
import json
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalwart.errors import PlanMismatchError
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.diloco import exchange
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.diloco.outer import Fragment, OuterState
from stalwart.runtime.engine import StepEngine
from stalwart.runtime.events import Event
from stalwart.runtime.heal import transfer_state
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.sharding import local_tensor

_WAIT_POLL = 0.005
"""Seconds between two looks at the lighthouse while an exchange is awaited."""


class GroupBrokenError(CollectiveError):
    """A reduction inside this replica group failed: a process of the group died or hung (the group restarts)."""


@dataclass
class Traffic:
    """What this process sent to other groups, and how (for the lighthouse's figures and the benchmark)."""

    bytes: int = 0
    """Bytes sent over the cross-group link (ring algorithms' count, see :func:`exchange.sent_bytes`)."""
    exchanges: int = 0
    collectives: int = 0
    largest: int = 0
    """The most bytes of one exchange (the peak a link must carry at once)."""
    log: list[dict[str, Any]] = field(default_factory=list)
    """One entry per collective step: ``kind`` (``exchange``: a fragment's, ``tail``: the round's end), round,
    fragment, bytes, collectives, overlap (inner steps it ran behind), alone (a tail with no exchange beside it)."""

    def record(self, round_: int, fragment: int, nbytes: int, collectives: int, overlap: int) -> None:
        """A fragment's exchange."""
        self.bytes += nbytes
        self.exchanges += 1
        self.collectives += collectives
        self.largest = max(self.largest, nbytes)
        self.log.append(
            {"kind": "exchange", "round": round_, "fragment": fragment, "bytes": nbytes,
             "collectives": collectives, "overlap": overlap}
        )  # fmt: skip

    def record_tail(self, round_: int, nbytes: int, *, alone: bool) -> None:
        """The round's tail all-reduce (``alone``: no exchange ran beside it, so it waits a round trip of its own)."""
        self.bytes += nbytes
        self.collectives += 1
        self.log.append({"kind": "tail", "round": round_, "bytes": nbytes, "collectives": 1, "alone": alone})


class _FragmentGlobals:
    """One fragment's globals as the state a reconcile moves; a receiver merges them as the exchange it missed."""

    def __init__(self, fragment: Fragment) -> None:
        self.fragment = fragment
        self.received: list[torch.Tensor] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"params": [param.detach() for param in self.fragment.globals]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.received = list(state["params"])

    def merge(self) -> None:
        """The exchange a peer completed, applied here: the new globals, and the local update they imply."""
        fragment, received = self.fragment, self.received
        pending = fragment.pending
        assert pending is not None and received is not None
        with torch.no_grad():
            offset = 0
            for (local, global_), new in zip(fragment.pieces(), received, strict=True):
                new = local_tensor(new)
                step = pending.delta[offset : offset + global_.numel()].view_as(global_)
                local.add_((new - global_ + step).to(local.dtype))
                global_.copy_(new)
                offset += global_.numel()
        fragment.pending = None


class GroupLinks:
    """The communicators of one quorum for DiLoCo, and the fragment exchange in flight on them (one at most)."""

    def __init__(self, keeper: QuorumKeeper, engine: StepEngine, config: DiLoCo, outer: OuterState) -> None:
        self._keeper = keeper
        self._engine = engine
        self._config = config
        self._outer = outer
        self.traffic = Traffic()
        self.inner: Communicator | None = None
        """The group's own processes (None between quorums)."""
        self.cross: Communicator | None = None
        """The processes at this process's rank in every group (None between quorums)."""
        self.solo: Communicator | None = None
        """This process alone (FSDP2 groups: the inner steps' gradient buckets, which FSDP2 reduced; else None)."""
        self._abandon = threading.Event()
        self._exchanges = ThreadPoolExecutor(1, thread_name_prefix="stalwart-exchange")
        self._future: Future[tuple[torch.Tensor, float]] | None = None
        self._future_fragment: Fragment | None = None
        self._reconciles = 0

    def relaunch(self) -> None:
        """Launch again, in the new quorum, the mid-round exchange a failure interrupted (re-encoded if needed)."""
        for fragment in self._outer.fragments:
            if fragment.pending is not None and fragment.pending.merge:
                self._submit(fragment, self._reencoded(fragment))

    def launch(self, fragment: Fragment, *, merge: bool) -> None:
        """Start ``fragment``'s exchange on the exchange thread (the weight is the group's window)."""
        session = self._keeper.session
        comm = self.cross
        assert comm is not None
        pending = self._outer.launch(fragment, session.group.rank, session.group.size, comm.world_size, merge=merge)
        self._submit(fragment, pending.prepared)

    def _reencoded(self, fragment: Fragment) -> exchange.Prepared:
        """The pending exchange's payload for the current quorum (encoded again if the groups changed)."""
        pending = fragment.pending
        comm, group = self.cross, self._keeper.session.group
        assert pending is not None and comm is not None
        if pending.prepared.members == comm.world_size:
            return pending.prepared
        return self._outer.reencode(fragment, group.rank, group.size, comm.world_size).prepared

    def _submit(self, fragment: Fragment, prepared: exchange.Prepared) -> None:
        comm = self.cross
        assert comm is not None and self._future is None
        self._engine.events.notify(Event.EXCHANGE_STARTED, self._keeper.ledger.step)
        self._future = self._exchanges.submit(exchange.run, comm, prepared)
        self._future_fragment = fragment

    def await_exchange(self) -> tuple[Fragment, torch.Tensor, float]:
        """Wait for the exchange in flight, watching the lighthouse; the fragment's gathered sum and weight."""
        future, fragment = self._future, self._future_fragment
        assert future is not None and fragment is not None
        session = self._keeper.session
        try:
            while not future.done():
                if session.abandon():
                    self._abandon.set()
                futures.wait([future], timeout=_WAIT_POLL)
            failure = future.exception()
        finally:
            self._future = self._future_fragment = None
        self._agree(fragment, failure)
        reduced, weight = future.result()
        pending = fragment.pending
        assert pending is not None
        whole = self._gather(fragment, reduced)
        comm = self.cross
        assert comm is not None
        config = self._config
        nbytes = exchange.sent_bytes(config.codec, pending.prepared.numel, comm.world_size, config.int8_block)
        self.traffic.record(
            self._keeper.ledger.step,
            fragment.index,
            nbytes,
            exchange.collectives(self._config.codec),
            self._config.overlap_steps if pending.merge else 0,
        )
        return fragment, whole, weight

    def _agree(self, fragment: Fragment, failure: BaseException | None) -> None:
        """FSDP2 groups: the group's processes apply ``fragment``'s exchange all or none (each exchanged its shards).

        A dead group can leave the exchange completed on some processes of a
        live group and failed on others; then every process of the group takes
        it as failed (the exchange is relaunched or withdrawn in the next
        quorum), as the replicated groups' gather of the slices does.
        """
        if failure is not None and not isinstance(failure, CollectiveError):
            raise failure
        if not self._outer.sharded:
            return
        comm = self.inner
        assert comm is not None
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self._engine.device)
        try:
            comm.start_all_reduce_sum(failed)()
        except CollectiveError as error:
            what = f"the group's vote on fragment {fragment.index}'s exchange failed"
            raise GroupBrokenError(f"{what}: {error}") from error
        if failure is not None:
            raise failure
        if failed.item():
            raise CollectiveError(f"fragment {fragment.index}'s exchange failed on another process of this group")

    def _gather(self, fragment: Fragment, reduced_slice: torch.Tensor) -> torch.Tensor:
        """Every slice of the fragment's reduced sum, from the group's processes (the whole fragment)."""
        comm = self.inner
        assert comm is not None
        if comm.world_size == 1 or self._outer.sharded:
            return reduced_slice
        length = fragment.slice_length(comm.world_size)
        piece = torch.zeros(length, dtype=torch.float32, device=reduced_slice.device)
        piece[: reduced_slice.numel()] = reduced_slice[:length]
        try:
            return comm.all_gather(piece)[: fragment.numel]
        except CollectiveError as error:
            raise GroupBrokenError(
                f"the gather of fragment {fragment.index} inside the group failed: {error}"
            ) from error

    def drop(self) -> None:
        """Abandon an exchange in flight (its quorum is gone): it is relaunched, or healed, after the next quorum."""
        if self._future is not None:
            self._abandon.set()
            with contextlib.suppress(Exception):
                self._future.result(timeout=self._config.round_timeout)
            self._future = self._future_fragment = None
        for comm in (self.inner, self.cross, self.solo):
            if comm is not None:
                comm.retire()  # not destroyed here: an exchange abandoned on a live peer would hold this thread
        self.inner = self.cross = self.solo = None
        self._abandon.clear()

    def connect(self) -> None:
        """The group's communicator and this process's cross-group one, on the quorum's store; the config checked."""
        keeper, engine = self._keeper, self._engine
        session = keeper.session
        comm = session.comm
        answer = session.answer
        assert comm is not None and answer is not None
        store = comm.store
        group = session.group
        mine = json.dumps(self._config.describe(), sort_keys=True)
        try:
            store.set(f"diloco/config/{keeper.member}/{group.rank}", mine)
            reference = answer.members[0]
            theirs = store.get(f"diloco/config/{reference}/0").decode()
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(
                f"quorum {answer.quorum_id}'s store gave no DiLoCo configuration ({error}): a member died, or trains "
                "without sync=DiLoCo(...)"
            ) from error
        if theirs != mine:
            raise PlanMismatchError(
                f"member {keeper.member!r} trains with DiLoCo {mine} and member {reference!r} with {theirs}: every "
                "member must give the Manager the same sync=DiLoCo(...)"
            )
        timeouts = keeper.timeouts
        options: dict[str, Any] = {
            "device": engine.device,
            "host": session.transport.host,
            "rendezvous_timeout": timeouts.rendezvous_timeout,
        }
        self.inner = Communicator(
            dist.PrefixStore(f"diloco/inner/{keeper.member}/", store),
            group.rank,
            group.size,
            timeout=timeouts.collective_timeout,
            **options,
        )
        self.cross = Communicator(
            dist.PrefixStore(f"diloco/outer/{group.rank}/", store),
            answer.rank,
            len(answer.members),
            timeout=self._config.round_timeout,
            abandon=self._abandon.is_set,
            **options,
        )
        if self._outer.sharded:
            self.solo = Communicator(
                dist.PrefixStore(f"diloco/solo/{keeper.member}/{group.rank}/", store),
                0,
                1,
                timeout=timeouts.collective_timeout,
                **options,
            )

    def reconcile(self, mid_round: list[int]) -> None:
        """Processes one mid-round exchange behind take that fragment's globals and outer state from one ahead.

        With FSDP2 groups, among the processes at this rank of every group (each holds its shards only).
        """
        if not mid_round:
            return
        comm = self.cross if self._outer.sharded else self._keeper.session.comm
        assert comm is not None
        counts = [int(value) for value in comm.all_gather(torch.tensor([float(self._outer.syncs)])).tolist()]
        ahead = max(counts)
        if min(counts) == ahead:
            return
        if ahead - min(counts) > 1:
            raise RuntimeError(f"processes are {ahead - min(counts)} fragment exchanges apart ({counts}); at most 1")
        source = counts.index(ahead)
        fragment = self._outer.fragments[mid_round[(ahead - 1) % len(mid_round)]]
        behind = self._outer.syncs < ahead
        if behind and fragment.pending is None:
            raise RuntimeError(
                f"{self._keeper.member}: fragment {fragment.index}'s exchange was applied by a peer but never "
                "launched here"
            )
        self._reconciles += 1
        received = _FragmentGlobals(fragment)
        timeouts = self._keeper.timeouts
        transfer_state(
            comm,
            source,
            {"globals": received, "optimizer": fragment.optimizer},
            ahead,
            is_target=behind,
            key=f"diloco/reconcile/{self._reconciles}",
            max_bytes=None,
            timeout=timeouts.heal_timeout,
            min_bandwidth=timeouts.heal_min_bandwidth,
        )
        if behind:
            received.merge()
            self._outer.syncs = ahead

    def close(self) -> None:
        """Stop the exchange thread (the Manager is closed)."""
        self.drop()
        self._exchanges.shutdown(wait=False)
