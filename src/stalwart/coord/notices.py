"""What the lighthouse tells a member on its heartbeat socket, kept as thread-safe flags for the worker.

A ``{"type": "reconfigure"}`` notice for the member's quorum asks it to come
to a step boundary (:attr:`Notices.reconfigure_requested`); with ``broken``
a member of that quorum is dead (:attr:`Notices.quorum_broken`, and ``down``
names whom it lost); with ``left_out`` a newer quorum went on without this
member, which abandons what it runs and joins again. The flags are set on the
client's loop and read by the worker's threads; a quorum joined clears them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any


class Notices:
    """The reconfigure notices a member received for its quorum (``quorum_id``: the last it joined)."""

    def __init__(self) -> None:
        self._reconfigure = threading.Event()
        self._broken = threading.Event()
        self.quorum_id: int | None = None
        """The quorum this member is in (None before its first)."""
        self.down: tuple[str, ...] = ()
        """The members the lighthouse named when it reported the quorum broken (empty before, or from a lighthouse
        that does not name them)."""

    @property
    def reconfigure_requested(self) -> bool:
        """True once the lighthouse asked the quorum to come to a step boundary."""
        return self._reconfigure.is_set()

    @property
    def quorum_broken(self) -> bool:
        """True once the lighthouse reported a member of this member's quorum dead."""
        return self._broken.is_set()

    def joined(self, quorum_id: int) -> None:
        """This member is in quorum ``quorum_id`` now: the notices of the last one are forgotten."""
        self.quorum_id = quorum_id
        self._reconfigure.clear()
        self._broken.clear()
        self.down = ()

    def receive(self, notice: Mapping[str, Any]) -> None:
        """A ``reconfigure`` message; one about another quorum than this member's is ignored."""
        quorum_id = notice.get("quorum_id")
        if notice.get("left_out") is True:
            # a newer quorum went on without this member: abandon what it runs and join again
            if isinstance(quorum_id, int) and self.quorum_id is not None and quorum_id > self.quorum_id:
                self._reconfigure.set()
                self._broken.set()
        elif quorum_id is None or self.quorum_id is None or quorum_id == self.quorum_id:
            self._reconfigure.set()
            if notice.get("broken") is True:
                down = notice.get("down")
                if isinstance(down, list) and all(isinstance(member, str) for member in down):
                    self.down = tuple(down)
                self._broken.set()
