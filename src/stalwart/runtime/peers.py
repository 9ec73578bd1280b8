"""What one process checks and learns of its quorum's peers, apart from the session that joins the quorum.

- Before it trains beside them: the same FSDP2 layout (:func:`check_layout`)
  and the same dataset (:func:`check_data`), read from the quorum's store.
- After a collective failed: which of them it could not reach
  (:class:`PeerProbes`: each peer process probed at the listener address it
  published, the verdict of :mod:`stalwart.runtime.diagnosis`, and, while the
  leader's next quorum request waits, the same probes every
  :data:`REPROBE_INTERVAL`, reporting to the lighthouse those it reaches
  again, so that their cuts end at once).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch.distributed as dist

from stalwart.coord.client import LighthouseClient, LighthouseError, LighthouseUnreachable, QuorumAnswer
from stalwart.data.shard_identity import ShardIdentity, shard_difference
from stalwart.errors import PlanMismatchError, ShardingMismatchError
from stalwart.runtime.comm import CollectiveError, Failure, arrivals
from stalwart.runtime.diagnosis import Diagnosis, Verdict, diagnose
from stalwart.runtime.probe import LinkNeed, Reach, probe

log = logging.getLogger(__name__)
_T = TypeVar("_T")

REPLICATED = "replicated"
"""The layout a process of an unsharded model publishes (any group size is fine then)."""
MAX_PEER_TEXT = 4096
"""Longest layout or data fingerprint a peer may publish."""
STORE_LOOK_S = 2.0
"""Longest wait for the quorum's store while diagnosing a failure. It answers in milliseconds unless the lighthouse
is cut off from this process; then the diagnosis names no peer and the next quorum request, which the client
retries on fresh connections, is what waits. (A look on the store's kept-alive connection waited out its read
timeout, 12 s, and kept a worker whose NIC was down for 10 s out of the quorum 5 s after its link returned.)"""
REPROBE_INTERVAL = 1.0
"""Seconds between two probes of the members the last diagnosis could not reach, while a quorum request waits."""


# --- checks before training beside the peers ------------------------------------------------------


def check_layout(
    answer: QuorumAnswer, store: dist.Store, *, member: str, layout: str, group_rank: int, group_sizes: Sequence[int]
) -> None:
    """Refuse to train beside a group that shards differently (FSDP2), or shards when this one does not."""
    reference = _reference_rank(answer)
    if reference == answer.rank:
        return
    name = answer.members[reference]
    size, own_size = group_sizes[reference], group_sizes[answer.rank]
    theirs = peer_text(store, f"layout/{name}/{min(group_rank, size - 1)}")
    if (theirs == REPLICATED) != (layout == REPLICATED):
        raise ShardingMismatchError(
            f"replica group {member!r} {'does not shard' if layout == REPLICATED else 'shards'} its "
            f"model with FSDP2 and group {name!r} {'does' if theirs != REPLICATED else 'does not'}: every group "
            "of a job must run the same training script"
        )
    if layout == REPLICATED:
        return
    if size != own_size:
        raise ShardingMismatchError(
            f"replica group {member!r} shards its model over {own_size} processes and group "
            f"{name!r} over {size}: every FSDP2 group of a job needs the same number of processes"
        )
    if theirs != layout:
        raise ShardingMismatchError(
            f"process {group_rank} of replica group {member!r} holds its shard with layout "
            f"{layout}, group {name!r}'s with {theirs}: every group must fully_shard the same model "
            "the same way (see stalwart.runtime.sharding.sharding_layout)"
        )


def check_data(
    answer: QuorumAnswer, store: dist.Store, *, member: str, fingerprint: str, identities: Sequence[ShardIdentity]
) -> None:
    """Refuse to train beside a member whose dataset has other shards: the same index would be another sample."""
    reference = _reference_rank(answer)
    if reference == answer.rank:
        return
    name = answer.members[reference]
    theirs = peer_text(store, f"data/{name}/0")
    if theirs and fingerprint and theirs != fingerprint:
        difference = None
        try:
            listed = json.loads(store.get(f"data-shards/{name}/0"))
            their_shards = [ShardIdentity.from_list(item) for item in listed]
            difference = shard_difference(their_shards, identities, f"member {name!r}'s dataset")
        except (ValueError, TypeError):
            pass  # a peer's malformed list: the fingerprints' difference is the message
        raise PlanMismatchError(
            f"member {member!r} reads a dataset with fingerprint {fingerprint} and member "
            f"{name!r} one with {theirs}" + (f" ({difference})" if difference else "") + ": every member must "
            "read the same shards in the same order (the same row counts and contents; sort the file list)"
        )


def _reference_rank(answer: QuorumAnswer) -> int:
    """The member a joining process compares itself with: the heal's source, else rank 0."""
    heal = answer.heal
    return 0 if heal is None or heal.source_rank is None else heal.source_rank


def peer_text(store: dist.Store, key: str) -> str:
    """A peer's text value (a layout, a fingerprint); malformed (not UTF-8, too long) is a failed collective."""
    return decoded(key, bytes(store.get(key)))


def decoded(key: str, raw: bytes) -> str:
    """The text a peer stored under ``key``; malformed (not UTF-8, too long) is a failed collective."""
    try:
        if len(raw) > MAX_PEER_TEXT:
            raise ValueError(f"{len(raw)} bytes, over {MAX_PEER_TEXT}")
        return raw.decode("utf-8")
    except ValueError as error:
        raise CollectiveError(f"a peer's {key!r} in the quorum's store is malformed ({error})") from None


# --- after a collective failed ---------------------------------------------------------------------


class PeerProbes:
    """Which peers of its quorum ``member`` could not reach when a collective failed, and their probes again."""

    def __init__(self, member: str) -> None:
        self.member = member
        self._view: tuple[QuorumAnswer, dist.Store, list[int]] | None = None
        """The current quorum, its store and group sizes, once known: what :meth:`diagnose` reads and probes."""
        self._unreachable: tuple[str, ...] = ()
        """The members the last diagnosis could not reach: sent with the next quorum request (the leader's)."""
        self._cut: dict[str, list[str]] = {}
        """The probe addresses of the members the last diagnosis could not reach (cut off or on a slow link), probed
        again while the leader's quorum request waits; empty once a quorum is adopted."""
        self._need: LinkNeed | None = None
        """What those probes must carry (the last diagnosis's need)."""

    def watch(self, answer: QuorumAnswer, store: dist.Store, group_sizes: list[int]) -> None:
        """The quorum to diagnose from now on (its store answered with every member's group size)."""
        self._view = (answer, store, group_sizes)

    def unwatch(self) -> None:
        """No quorum to diagnose (a new one is being connected)."""
        self._view = None

    def adopted(self) -> None:
        """A new quorum was adopted: the members cut from the last one are no longer probed."""
        self._cut = {}

    def take_unreachable(self) -> tuple[str, ...]:
        """The members the last diagnosis could not reach, once (for the next quorum request)."""
        unreachable, self._unreachable = self._unreachable, ()
        return unreachable

    def diagnose(self, error: CollectiveError, *, need: LinkNeed | None = None) -> Diagnosis:
        """What each peer member of the current quorum looked like when ``error`` happened (probed now, bounded by
        :data:`~stalwart.runtime.probe.PROBE_TIMEOUT` and ``need.window``); the leader reports the unreachable ones
        with its next quorum request.

        Processes are read from the quorum's store: those that never wrote
        their arrival never came; the others are probed at the address they
        published, carrying ``need``'s bytes when the failure was a deadline
        (a peer on a link too slow for them is reported like a cut-off one).
        Nothing is known before the group sizes were read.
        """
        if self._view is None or error.failure is Failure.ABANDONED:
            # abandoned: the lighthouse named a member dead and leaves it out itself; a probe of a peer whose NIC
            # died would hold the quorum request up to PROBE_TIMEOUT for nothing
            return Diagnosis(error.failure, {})
        answer, store, sizes = self._view
        came = _within(STORE_LOOK_S, lambda: arrivals(store, sum(sizes)))
        if came is None:
            return Diagnosis(error.failure, {})
        owners = [member for member, size in zip(answer.members, sizes, strict=True) for _ in range(size)]
        peers = {rank: member for rank, member in enumerate(owners) if member != self.member}
        addresses = {rank: came[rank] for rank in peers if came.get(rank)}
        found = probe(addresses, need=need if error.failure is Failure.TIMEOUT else None)
        reached: dict[str, list[Reach | None]] = {member: [] for member in answer.members if member != self.member}
        for rank, member in peers.items():
            if rank not in came:
                reached[member].append(None)
            elif rank in found:
                reached[member].append(found[rank])
        diagnosis = diagnose(error.failure, reached)
        self._unreachable = diagnosis.unreachable
        self._cut = {
            member: [address for rank, address in addresses.items() if peers[rank] == member]
            for member, verdict in diagnosis.verdicts.items()
            if verdict in (Verdict.CUT_OFF, Verdict.SLOW_LINK)
        }
        self._need = need
        return diagnosis

    def reprobing(self, client: LighthouseClient) -> Reprobe:
        """A context manager probing the members cut from the last quorum while a quorum request waits."""
        return Reprobe(self.member, client, dict(self._cut), self._need)


class Reprobe:
    """While a quorum request waits: probe the members ``cut`` (their addresses) every :data:`REPROBE_INTERVAL`,
    carrying ``need``'s bytes, and tell the lighthouse those every process of which answered (each round: the
    lighthouse ends only cuts that still stand, and a peer's report may come after the first).

    A context manager: the probing runs on a daemon thread from entry to exit.
    """

    def __init__(self, member: str, client: LighthouseClient, cut: dict[str, list[str]], need: LinkNeed | None) -> None:
        self._member = member
        self._client = client
        self._cut = {peer: addresses for peer, addresses in cut.items() if addresses}
        self._need = need
        self._stop = threading.Event()

    def __enter__(self) -> Reprobe:
        if self._cut:
            threading.Thread(target=self._run, name="stalwart-reprobe", daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()  # not joined: a probe in flight ends by its own timeout and reports nothing after this

    def _run(self) -> None:
        told: set[str] = set()
        while not self._stop.wait(REPROBE_INTERVAL):
            addresses = {(peer, i): address for peer, listed in self._cut.items() for i, address in enumerate(listed)}
            found = probe(addresses, need=self._need)
            reached = [
                peer
                for peer in self._cut
                if all(found[(peer, i)] is Reach.REACHABLE for i in range(len(self._cut[peer])))
            ]
            if not reached or self._stop.is_set():
                continue
            try:
                ended = self._client.report_reached(reached)
            except (LighthouseError, LighthouseUnreachable, TimeoutError, RuntimeError) as error:  # closed: done
                log.info("%s: could not tell the lighthouse it reaches %s again: %s", self._member, reached, error)
                continue
            if set(reached) - told:
                log.warning("%s: reaches %s again (%d cut(s) ended)", self._member, ", ".join(reached), ended)
                told.update(reached)


def _within(seconds: float, call: Callable[[], _T]) -> _T | None:
    """``call()``'s result, or None when it did not return within ``seconds``.

    It runs on a daemon thread of its own, left to end by its own timeouts: a
    store client's connection is per thread, so the look goes out on a new
    connection, never on one a dead path left waiting.
    """
    results: list[_T] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.append(call())
        finally:
            done.set()

    threading.Thread(target=run, name="stalwart-diagnosis", daemon=True).start()
    return results[0] if done.wait(seconds) and results else None
