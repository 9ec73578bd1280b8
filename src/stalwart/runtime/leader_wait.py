"""The waits on a leader's ``on_leader`` work: its done-mark on the quorum's store, waited for now or deferred.

The leader runs the work and sets ``leader/<n>`` in the quorum's store; every
other process waits for that key with held store requests (each answered the
moment the key is set), watching the lighthouse for a broken quorum between
them, so that no collective is pending while the leader works. A process with
nothing to serve defers the wait to its next collective (:meth:`LeaderWaits.defer`,
:meth:`LeaderWaits.settle`); one that may be asked for its optimizer shards
(``ask_waiters``) waits at once and serves the asks. The counters are the
quorum's: every process numbers the same calls the same way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from stalwart.errors import JoinError
from stalwart.runtime.comm import CollectiveError, Failure
from stalwart.runtime.diagnosis import LeaderLoss
from stalwart.runtime.store import LighthouseStore

log = logging.getLogger(__name__)

LEADER_POLL = 0.05
"""Seconds a waiting process's wait on the store lasts while the leader runs its own work (at most), between two
looks for a broken quorum and for the leader's asks."""
FIRST_LEADER_POLL = 0.002
"""The first wait's length when the leader may ask for shards, doubled at each wait up to ``LEADER_POLL``: its
asks are seen between waits. The leader's "done" ends a wait the moment it is set (the lighthouse answers the held
request), so with nothing to serve every wait is ``LEADER_POLL`` long: short ones would only cost requests, and
wake the waiting processes while the leader works."""


@dataclass(frozen=True)
class QuorumView:
    """What a wait needs of the quorum: its store, its leader, and the watch for its breaking."""

    store: LighthouseStore
    leader: str
    quorum_id: int
    group_rank: int
    abandon: Callable[[], bool]
    """True once the lighthouse reported the quorum broken."""
    broken_by: Callable[[], tuple[str, ...]]
    """The members the lighthouse named when it did."""


@dataclass(frozen=True)
class _Deferred:
    key: str
    deadline: float
    lost: Callable[[LeaderLoss], None]
    """Told when the quorum broke instead (the leader died in its work)."""
    report: Any
    """What the heartbeat reported when the process went on: it reports that until the wait ends."""


class LeaderWaits:
    """One process's ``on_leader`` calls in the current quorum: their keys, the asks, the deferred wait."""

    def __init__(self, member: str, leader_timeout: float, timeout_name: str) -> None:
        self.member = member
        self.leader_timeout = leader_timeout
        self.timeout_name = timeout_name
        """How errors name ``leader_timeout`` (with its setting)."""
        self.calls = 0
        self.asks = 0
        self._deferred: _Deferred | None = None

    def reset(self) -> None:
        """A new quorum: its store numbers the calls from 0; a wait deferred in the old one is over."""
        self.calls = 0
        self.asks = 0
        self._deferred = None

    @property
    def pending(self) -> bool:
        """Whether a leader's work this process went on from may still run (:meth:`defer`)."""
        return self._deferred is not None

    @property
    def held_report(self) -> Any:
        """While a deferred wait runs: the heartbeat's report as it was when the process went on (else None), so
        that it does not look ahead of a leader busy in its work (the lighthouse evicts a member that peers ahead
        of it wait on)."""
        deferred = self._deferred
        return None if deferred is None else deferred.report

    def next_key(self) -> str:
        """The done-mark of the next ``on_leader`` call."""
        self.calls += 1
        self.asks = 0
        return f"leader/{self.calls}"

    def next_ask(self, group_rank: int) -> str:
        """(The leader, inside its work.) The key that asks its counterparts to serve their shards once more."""
        self.asks += 1
        return f"leader/{self.calls}/ask/{self.asks}/{group_rank}"

    def lead(self, view: QuorumView, key: str, run: Callable[[], Any]) -> Any:
        """Run the work, then mark it done for the waiting processes."""
        result = run()
        if view.group_rank == 0:
            # a done-mark the waiters miss is covered by their broken-quorum watch
            with contextlib.suppress(RuntimeError, dist.DistError):
                view.store.set(key, "done")
        return result

    def wait(self, view: QuorumView, key: str, serve: Callable[[], None] | None) -> LeaderLoss | None:
        """Wait for the done-mark ``key`` now, serving the leader's asks; the loss when the quorum broke first."""
        return self._wait(view, key, time.monotonic() + self.leader_timeout, serve)

    def defer(self, key: str, lost: Callable[[LeaderLoss], None], report: Any) -> None:
        """Wait for ``key`` at the next :meth:`settle` instead (before the next collective); the heartbeat reports
        ``report`` until then (:attr:`held_report`)."""
        self._deferred = _Deferred(key, time.monotonic() + self.leader_timeout, lost, report)

    def settle(self, view: QuorumView) -> None:
        """The deferred wait, if any; :class:`CollectiveError` when the quorum broke instead (``lost`` told)."""
        deferred = self._deferred
        if deferred is None:
            return
        try:
            loss = self._wait(view, deferred.key, deferred.deadline, None)
        finally:
            self._deferred = None  # the report held while waiting: the leader's work is over (or lost)
        if loss is not None:
            deferred.lost(loss)
            raise CollectiveError(loss.describe(), failure=Failure.ABANDONED)

    def _wait(self, view: QuorumView, key: str, deadline: float, serve: Callable[[], None] | None) -> LeaderLoss | None:
        served = 0
        delay = LEADER_POLL if serve is None else FIRST_LEADER_POLL
        while time.monotonic() < deadline:
            try:
                if view.store.present_within([key], delay):  # answered the moment the leader marks it done
                    return None
                asked = serve is not None and view.store.check([f"{key}/ask/{served + 1}/{view.group_rank}"])
            except (RuntimeError, dist.DistError):
                return LeaderLoss(view.leader, view.quorum_id, ())  # the store is gone: so is the quorum
            if asked:
                assert serve is not None
                try:
                    serve()
                except CollectiveError as error:
                    log.warning("%s: the leader's gather failed (%s)", self.member, error)
                    return LeaderLoss(view.leader, view.quorum_id, view.broken_by())
                served += 1
                continue
            if view.abandon():
                return LeaderLoss(view.leader, view.quorum_id, view.broken_by())
            delay = min(2 * delay, LEADER_POLL)
        raise JoinError(
            f"{self.member}: the quorum's leader {view.leader} did not finish its on_leader work within "
            f"{self.timeout_name}"
        )
