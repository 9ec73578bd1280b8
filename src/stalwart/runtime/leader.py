"""Leader-only work (``Manager.on_leader``): the leader runs it, the others wait without a collective.

While the leader works (an evaluation, the user's own checkpoint), the
others go on with the next step's forward and backward, as DDP's ranks do
while rank 0 evaluates, and wait for the leader before their next collective
(the step's reduction holds its buckets until then), watching the lighthouse
for its death (bounded by ``leader_timeout``), so that nothing times out.
With sharded optimizer state they wait at once instead: ``optimizer.state_dict()``
inside the work gathers the whole state onto the leader, and the waiting
processes send their shards when asked. A leader lost meanwhile, or a gather
that failed, re-forms the quorum (a reduction that waited for it fails and
is recovered like any other).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.diagnosis import LeaderLoss
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)


class LeaderWork:
    """Runs work on the quorum's leading group; ``lockstep`` False (DiLoCo's groups): the others go on at once."""

    def __init__(self, keeper: QuorumKeeper, sharded: ShardedOptimizer | None, *, lockstep: bool) -> None:
        self._keeper = keeper
        self._sharded = sharded
        self._lockstep = lockstep
        self._leading = False
        """Inside the work on the leader: a gather of the sharded state asks the waiting processes."""

    def run(self, work: Callable[[], Any]) -> Any:
        """``work()`` on the leading group's processes (its result; None elsewhere): the others wait before their
        next collective, or here when they may have shards to serve."""
        keeper = self._keeper
        session = keeper.session
        if session.answer is None or session.comm is None:
            raise RuntimeError("on_leader() needs a quorum: call it inside the manager.steps() loop")
        leads = session.answer.rank == 0
        if not self._lockstep:  # groups are not in lockstep within a round: the others go on
            return work() if leads else None
        serve = None if self._sharded is None else self._serve_gather
        if not leads and serve is None:  # nothing to serve: wait before the next collective, not here
            session.defer_leader(self._lost)
            return None
        self._leading = leads
        try:
            loss, result = session.wait_for_leader(leads, work, serve)
        except CollectiveError as error:  # only the gather of optimizer.state_dict() runs collectives in there
            log.warning(
                "%s: on_leader's work stopped: gathering the optimizer state failed (%s); the quorum re-forms "
                "before the next step",
                keeper.member,
                error,
            )
            keeper.want_boundary()
            return None
        finally:
            self._leading = False
        if loss is not None:
            self._lost(loss)
        return result

    def _lost(self, loss: LeaderLoss) -> None:
        self._keeper.leader_lost(loss)
        log.warning("%s: %s; the quorum re-forms before the next step", self._keeper.member, loss.describe())

    def gather_whole_state(self) -> dict[int, dict[str, Any]]:
        """The user's ``optimizer.state_dict()`` under sharded state: the whole state, gathered (a collective).

        On the leader inside :meth:`run`, the waiting processes are asked to
        send their shards; elsewhere every process calls it together.
        """
        session = self._keeper.session
        zero, comm = self._sharded, session.grad_comm
        assert zero is not None
        if comm is None:
            raise RuntimeError(
                "optimizer.state_dict() with sharded optimizer state (redundancy=) gathers the state from the "
                "quorum's processes: call it inside the manager.steps() loop, before manager.close()"
            )
        if self._leading:
            session.ask_waiters()
        else:
            session.meet("optimizer.state_dict()")
        moments = zero.gather_moments(comm, to_rank=0 if self._leading else None)
        assert moments is not None  # every rank receives, or this is the leader's: rank 0 of the communicator
        return moments

    def _serve_gather(self) -> None:
        """A waiting process's part of the leader's :meth:`gather_whole_state` (its shard to the leader)."""
        grad_comm = self._keeper.session.grad_comm
        assert self._sharded is not None and grad_comm is not None
        self._sharded.gather_moments(grad_comm, to_rank=0)
