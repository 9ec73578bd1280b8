"""Preemption as a departure: a request to leave the quorum at the next step boundary, and the SIGTERM handler.

A preempted machine gets SIGTERM and a grace period (Kubernetes'
``terminationGracePeriodSeconds``, a cloud's spot notice, torchrun's
``--shutdown-timeout``). Handled as a crash, the others would wait for its
heartbeat to time out, abandon the step's all-reduce and recover its share.
Instead the request is only recorded here (a signal handler may run between
any two bytecodes of the main thread: it must not touch the quorum), and the
:class:`~stalwart.runtime.manager.Manager` acts on it at the next step
boundary: the request rides in the step's reduced tail, so every member
learns it from the same all-reduce, and after the step commits the departing
member leaves announced (``/v1/leave``) while the others form the next quorum
without it (docs/design.md, "Preemption").

:class:`Departure` is the request; a cloud's preemption notice (a poller of
the instance metadata, say) calls ``manager.request_departure()``, from any
thread.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Departure:
    """This process's wish to leave at the next step boundary, and the SIGTERM handler that records it.

    The request is a plain attribute (``reason``) written once, atomic under
    the GIL, so that the signal handler, a preemption-notice thread and the
    training loop may all touch it without a lock of their own (a plain lock
    taken in a signal handler can deadlock the thread it interrupted; the
    handler's one log line goes through logging's re-entrant locks).
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        """Why this process departs (the first request's reason), or None while none was made."""
        self._previous: Any = None
        self._installed = False
        self._signalled = False

    @property
    def requested(self) -> bool:
        """True once a departure was requested (it is never withdrawn)."""
        return self.reason is not None

    def request(self, reason: str) -> None:
        """Record a departure for ``reason`` (a non-empty string); a second request keeps the first reason."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        if self.reason is None:
            self.reason = reason

    @property
    def installed(self) -> bool:
        """Whether this object's SIGTERM handler is installed."""
        return self._installed

    def install(self) -> None:
        """Make SIGTERM request a departure (main thread only), chaining to the handler installed before.

        The previous handler is called after the request is recorded, unless it
        is the default action (which would end the process at once) or
        ``SIG_IGN``. Where it is the default action, a second SIGTERM takes it:
        the process ends at once (an impatient operator, a loop that never
        reaches a boundary).
        """
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "sigterm=True needs the Manager to be built in the main thread (Python runs signal handlers there "
                "only); build it there, or pass sigterm=False and call manager.request_departure() yourself"
            )
        if self._installed:
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def uninstall(self) -> None:
        """Put back the handler found by :meth:`install` (when this one is still the installed one)."""
        if not self._installed:
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:  # None: a handler not installed from Python
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Record the request; chain to a handler of the user's; a second SIGTERM takes the default action."""
        previous = self._previous
        if self._signalled and previous in (signal.SIG_DFL, None):
            self.uninstall()  # the default action is back: the second signal ends the process now
            signal.raise_signal(signum)
            return
        self._signalled = True
        if not self.requested:
            log.warning("SIGTERM: this worker leaves the quorum at the next step boundary")
        self.request("SIGTERM")
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)


def departing_members(ranks: Sequence[int], members: Sequence[str], group_sizes: Sequence[int]) -> tuple[str, ...]:
    """The members (replica groups) that leave: those with a process among ``ranks`` (quorum ranks), in rank order.

    A group leaves whole when any one of its processes asks (torchrun forwards
    SIGTERM to each, but not at the same instant; a notice poller may run in
    one process only), so that its processes never disagree.
    """
    if len(members) != len(group_sizes):
        raise ValueError(f"{len(members)} members but {len(group_sizes)} group sizes")
    leaving = set(ranks)
    chosen = []
    start = 0
    for member, size in zip(members, group_sizes, strict=True):
        if leaving.intersection(range(start, start + size)):
            chosen.append(member)
        start += size
    if leaving and (min(leaving) < 0 or max(leaving) >= start):
        raise ValueError(f"ranks {sorted(leaving)} are not all in the quorum's {start} processes")
    return tuple(chosen)
