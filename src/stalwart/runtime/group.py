"""Replica groups: several processes (one ``torchrun`` launch) that act as one lighthouse member.

A replica group is a fault domain: the lighthouse sees one member, the group's
leader (intra-group rank 0) holds its heartbeat and asks for quorums, and the
group's share of each step is split among its processes by intra-group rank.
When any process of the group dies, torchrun's agent ends the others, the
leader's heartbeat socket closes, and the lighthouse treats the group as dead.

The leader relays each quorum answer to the other processes through the
group's own store (torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``), as
JSON under a sequence number: every process of the group enters quorum
formation at the same points (start, failed collective, reconfigure flag in
the all-reduce), so the n-th answer is the one all of them wait for. When the
lighthouse reports the quorum broken, the leader also raises a flag in the
group store so that the other processes abandon the collective too, and it
relays the lighthouse's request for a step boundary the same way.

A step's reduction can end differently on the processes of one group: a peer
in another group that dies mid-collective may have sent what some processes
needed and not what others did. The group is one member to the lighthouse, so
its processes must apply the step together or retry it together:
:meth:`GroupLink.agree` is a vote in the group's store after every reduction,
and after every sharded gather (the store lives as long as the group, whatever
happens to other groups).

A process waits for its peers' keys by looking, never in a blocking store
``get``: torchrun stops a group whose process died with SIGTERM to the
others, and a process blocked in the store's C++ wait runs no Python signal
handler. Asked to depart, it waits at most :data:`DEPARTURE_GRACE` more.

torchrun keeps its store when it restarts a failed group in place
(``--max-restarts``), so the keys live under the launch's restart count
(``TORCHELASTIC_RESTART_COUNT``): a restarted group never reads the answers
relayed to the one before it.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from stalwart.data.world import WorldInfo

_BROKEN_CHECK_SECONDS = 0.005
_POLL_FIRST, _POLL_MAX = 0.001, 0.05
"""Seconds between two looks at the store while waiting for a peer's key (doubling from the first to the most)."""
DEPARTURE_GRACE = 5.0
"""Seconds a process asked to depart (SIGTERM) still waits for a group peer's key. A live peer writes its vote or
answer within milliseconds of this process; under torchrun, a departure while a peer's key is missing means its
agent is stopping the group because a peer died, and waiting on (up to the quorum timeout) held the process past
the agent's 30 s grace, until SIGKILL."""


class GroupLink:
    """How the processes of one replica group share the leader's view of the lighthouse."""

    def __init__(
        self,
        world: WorldInfo,
        store: dist.Store | None = None,
        *,
        timeout: float = 120.0,
        leaving: Callable[[], bool] = lambda: False,
        departure_grace: float = DEPARTURE_GRACE,
    ) -> None:
        """``world`` is this process's place in its group; ``store`` is needed when the group has several processes.

        With several processes and no ``store``, torchrun's agent store is used
        (``MASTER_ADDR``/``MASTER_PORT``). A wait for a peer's key (a vote, the
        leader's answer) gives up after ``timeout`` seconds, or
        ``departure_grace`` seconds after ``leaving()`` turns true.
        """
        self.rank = world.rank
        self.size = world.world_size
        self.timeout = timeout
        self._leaving = leaving
        self._departure_grace = departure_grace
        if self.size > 1 and store is None:
            address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not address or not port or not port.isdigit():
                raise ValueError(
                    "a replica group of several processes needs a store: run under torchrun "
                    f"(MASTER_ADDR={address!r}, MASTER_PORT={port!r}) or pass group_store"
                )
            store = dist.TCPStore(address, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = None if store is None else dist.PrefixStore(f"stalwart/{restart}/", store)
        self._answers = 0
        self._votes = 0
        self._last_broken_check = 0.0
        self._boundaries: set[int] = set()

    @property
    def is_leader(self) -> bool:
        """True for the process that talks to the lighthouse."""
        return self.rank == 0

    def publish(self, answer: dict[str, Any]) -> None:
        """Leader: hand the group the next quorum answer (JSON)."""
        if self._store is not None:
            self._store.set(f"answer/{self._answers}", json.dumps(answer))
        self._answers += 1

    def receive(self) -> dict[str, Any]:
        """Other processes: the next quorum answer the leader published (waits up to ``timeout``)."""
        assert self._store is not None
        key = f"answer/{self._answers}"
        self._wait([key], "the leader's quorum answer")
        answer = json.loads(self._store.get(key))
        self._answers += 1
        return dict(answer)

    def agree(self, succeeded: bool) -> bool:
        """Every process: True only if every process of the group says its collective ``succeeded``.

        All of the group's processes vote after each reduction attempt (and
        each sharded gather), at the same points of the step, so the
        n-th vote is the same attempt on each of them. A process that finishes
        vote n knows that every process has finished reading vote n - 1, so it
        deletes its own key of that one: the store holds one vote per process.
        A group peer that dies ends the whole group (torchrun's agent, which
        sends this process SIGTERM), so the wait for its vote is bounded by
        that (see :data:`DEPARTURE_GRACE`) and by ``timeout``.
        """
        if self._store is None:
            return succeeded
        vote = self._votes
        self._votes += 1
        self._store.set(f"vote/{vote}/{self.rank}", "1" if succeeded else "0")
        keys = [f"vote/{vote}/{rank}" for rank in range(self.size) if rank != self.rank]
        self._wait(keys, f"the group's votes on collective {vote}")
        agreed = succeeded and all(value == b"1" for value in self._store.multi_get(keys))
        if vote > 0:
            self._store.delete_key(f"vote/{vote - 1}/{self.rank}")
        return agreed

    def _wait(self, keys: list[str], what: str) -> None:
        """Return once every one of ``keys`` is in the store; RuntimeError past ``timeout``, or past the departure
        grace once ``leaving()``. Looks (``check``, which never blocks) rather than waits in a blocking ``get``: a
        process blocked in the store's C++ wait runs no Python signal handler, so SIGTERM went unheard."""
        assert self._store is not None
        started = time.monotonic()
        deadline = started + self.timeout
        pause = _POLL_FIRST
        while not self._store.check(keys):
            now = time.monotonic()
            if self._leaving():
                deadline = min(deadline, now + self._departure_grace)
                if now >= deadline:
                    raise RuntimeError(
                        f"{what} did not come within {self._departure_grace:g} s of this process being asked to "
                        "depart (SIGTERM): its group is being stopped (a peer process died)"
                    )
            if now >= deadline:
                raise RuntimeError(f"{what} did not come within {self.timeout:g} s")
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(2 * pause, _POLL_MAX)

    def mark_boundary(self, quorum_id: int) -> None:
        """Leader: tell the group that the lighthouse wants quorum ``quorum_id`` at a step boundary."""
        if self._store is not None and quorum_id not in self._boundaries:
            self._boundaries.add(quorum_id)
            self._store.set(f"boundary/{quorum_id}", "1")

    def boundary(self, quorum_id: int) -> bool:
        """Other processes: whether the leader relayed a boundary request for quorum ``quorum_id``."""
        return self._store is not None and bool(self._store.check([f"boundary/{quorum_id}"]))

    def mark_broken(self, quorum_id: int, down: Sequence[str] = ()) -> None:
        """Leader: tell the group that quorum ``quorum_id`` has a dead member; ``down``: the members the lighthouse
        named (JSON)."""
        if self._store is not None:
            self._store.set(f"broken/{quorum_id}", json.dumps(list(down)))

    def broken_by(self, quorum_id: int) -> tuple[str, ...]:
        """Other processes: the members the leader relayed as down in quorum ``quorum_id`` (empty: none named, or
        the quorum is not marked broken)."""
        key = f"broken/{quorum_id}"
        if self._store is None or not self._store.check([key]):
            return ()
        down = json.loads(self._store.get(key))
        return tuple(down) if isinstance(down, list) else ()

    def broken(self, quorum_id: int) -> bool:
        """Other processes: whether the leader marked quorum ``quorum_id`` broken (checked every few ms)."""
        now = time.monotonic()
        if self._store is None or now - self._last_broken_check < _BROKEN_CHECK_SECONDS:
            return False
        self._last_broken_check = now
        return bool(self._store.check([f"broken/{quorum_id}"]))
