"""The lighthouse's event loop selector: every ready request served each iteration, members' sockets a batch at a time.

asyncio runs, in one iteration of its loop, the callbacks of every socket
its selector reports ready. After a failure at thousands of members every
survivor's heartbeat socket is ready at once (asks, heartbeats), so one
iteration took 150-430 ms, and a ``/healthz`` request (or a store request,
or a registration) needing two or three iterations waited behind them
(docs/design.md, "What a failure's stall is made of"). This selector keeps
two epoll sets: *bulk* file descriptors (the members' heartbeat websockets,
marked with :meth:`BulkCappedSelector.demote` once upgraded) are reported at
most ``bulk_per_select`` at a time, the rest (listening sockets, HTTP
requests, the loop's own wake-up pipe) always in full. Level-triggered epoll
reports a bulk socket left out again on the next call, and moves the ones
it reported behind the others still ready, so the batches take turns and
no socket's bytes are lost; the work is the same, cut into iterations short
enough for a request to pass between them.

Written here because the standard library's selectors report every ready
descriptor, and asyncio offers no priority between them; the bulk set is a
second epoll instance registered in the first, so one blocking wait covers
both.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import selectors
from collections.abc import Mapping
from typing import Any

from stalwart._validate import check_int

BULK_PER_SELECT = 64
"""Members' sockets reported per iteration at most, the turnstile and the push at the same number: 128 stalled less
than 256 in three interleaved pairs at 4,096 members (issue 40, sixth session), and 64 less than 128 after one
failure in six pairs once the failure's saves and collections were cut (eighth session; docs/design.md)."""


class _EpollSet:
    """One epoll instance and the keys registered in it."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.keys: dict[int, selectors.SelectorKey] = {}

    def add(self, key: selectors.SelectorKey) -> None:
        self.epoll.register(key.fd, _epoll_mask(key.events))
        self.keys[key.fd] = key

    def remove(self, fd: int) -> selectors.SelectorKey:
        key = self.keys.pop(fd)
        with contextlib.suppress(OSError):  # closed already (asyncio may unregister a socket after closing it)
            self.epoll.unregister(fd)
        return key

    def modify(self, key: selectors.SelectorKey) -> None:
        self.epoll.modify(key.fd, _epoll_mask(key.events))
        self.keys[key.fd] = key

    def poll(self, timeout: float, most: int) -> list[tuple[int, int]]:
        return self.epoll.poll(timeout, most)


class BulkCappedSelector(selectors.BaseSelector):
    """A selector for asyncio's loop (Linux: epoll) whose demoted descriptors are reported ``bulk_per_select`` at a
    time, and every other one whenever ready (see the module docstring)."""

    def __init__(self, bulk_per_select: int = BULK_PER_SELECT) -> None:
        self.bulk_per_select = check_int("bulk_per_select", bulk_per_select, minimum=1)
        self._priority = _EpollSet()
        self._bulk = _EpollSet()
        self._priority.epoll.register(self._bulk.epoll.fileno(), select.EPOLLIN)
        self._map = _KeyMap(self)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = _fd_of(fileobj)
        _check_events(events)
        if fd in self._priority.keys or fd in self._bulk.keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is already registered")
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._priority.add(key)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = self._registered_fd(fileobj)
        return self._set_of(fd).remove(fd)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = self._registered_fd(fileobj)
        found = self._set_of(fd)
        key = found.keys[fd]
        if events != key.events:
            _check_events(events)
            key = key._replace(events=events, data=data)
            found.modify(key)
        elif data != key.data:
            key = key._replace(data=data)
            found.keys[fd] = key
        return key

    def demote(self, fileobj: Any) -> bool:
        """Report ``fileobj`` (a member's socket) with the bulk, at most ``bulk_per_select`` of them a time; False
        when it is not registered (closed meanwhile)."""
        fd = _fd_of(fileobj)
        if fd not in self._priority.keys:
            return fd in self._bulk.keys
        self._bulk.add(self._priority.remove(fd))
        return True

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        wait = -1.0 if timeout is None else max(timeout, 0.0)
        most = max(len(self._priority.keys) + 1, 1)
        ready: list[tuple[selectors.SelectorKey, int]] = []
        try:
            priority_events = self._priority.poll(wait, most)
        except InterruptedError:
            return ready
        bulk_ready = False
        for fd, mask in priority_events:
            key = self._priority.keys.get(fd)
            if key is None:
                bulk_ready = bulk_ready or fd == self._bulk.epoll.fileno()
                continue
            ready.append((key, _selector_events(mask) & key.events))
        if bulk_ready:
            for fd, mask in self._bulk.poll(0, self.bulk_per_select):
                key = self._bulk.keys.get(fd)
                if key is not None:
                    ready.append((key, _selector_events(mask) & key.events))
        return ready

    def close(self) -> None:
        self._priority.epoll.close()
        self._bulk.epoll.close()
        self._priority.keys.clear()
        self._bulk.keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map

    @property
    def bulk(self) -> int:
        """Descriptors reported with the bulk."""
        return len(self._bulk.keys)

    def _set_of(self, fd: int) -> _EpollSet:
        return self._bulk if fd in self._bulk.keys else self._priority

    def _registered_fd(self, fileobj: Any) -> int:
        fd = _fd_of(fileobj)
        if fd not in self._priority.keys and fd not in self._bulk.keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is not registered")
        return fd

    def keys_of(self, fd: int) -> selectors.SelectorKey | None:
        """The key registered for ``fd``, in either set."""
        return self._priority.keys.get(fd) or self._bulk.keys.get(fd)

    def registered(self) -> list[int]:
        """Every registered descriptor."""
        return [*self._priority.keys, *self._bulk.keys]


class _KeyMap(Mapping[Any, selectors.SelectorKey]):
    """``get_map()``: both sets' keys by file object or descriptor, as asyncio looks them up."""

    def __init__(self, selector: BulkCappedSelector) -> None:
        self._selector = selector

    def __len__(self) -> int:
        return len(self._selector.registered())

    def __getitem__(self, fileobj: Any) -> selectors.SelectorKey:
        try:
            fd = _fd_of(fileobj)
        except ValueError:
            raise KeyError(fileobj) from None
        key = self._selector.keys_of(fd)
        if key is None:
            raise KeyError(fileobj)
        return key

    def __iter__(self) -> Any:
        return iter(self._selector.registered())


def _fd_of(fileobj: Any) -> int:
    fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
    if not isinstance(fd, int) or fd < 0:
        raise ValueError(f"invalid file descriptor {fd!r} of {fileobj!r}")
    return fd


def _check_events(events: int) -> None:
    if not events or events & ~(selectors.EVENT_READ | selectors.EVENT_WRITE):
        raise ValueError(f"events must be EVENT_READ and/or EVENT_WRITE, got {events!r}")


def _epoll_mask(events: int) -> int:
    return (select.EPOLLIN if events & selectors.EVENT_READ else 0) | (
        select.EPOLLOUT if events & selectors.EVENT_WRITE else 0
    )


def _selector_events(mask: int) -> int:
    readable = mask & ~select.EPOLLOUT  # errors and hang-ups wake the reader, as the standard selectors do
    return (selectors.EVENT_READ if readable else 0) | (selectors.EVENT_WRITE if mask & ~select.EPOLLIN else 0)


class LoopSelector:
    """The lighthouse loop's selector: a :class:`BulkCappedSelector` on Linux (epoll); asyncio's default elsewhere,
    where nothing is demoted."""

    def __init__(self) -> None:
        self.capped: BulkCappedSelector | None = None
        """The selector of the loop made last (None before, or without epoll)."""

    def new_loop(self) -> asyncio.AbstractEventLoop:
        """A new event loop over a new selector."""
        if not hasattr(select, "epoll"):
            return asyncio.new_event_loop()
        self.capped = BulkCappedSelector()
        return asyncio.SelectorEventLoop(self.capped)

    def demote(self, fileobj: Any) -> None:
        """Report ``fileobj`` (a member's heartbeat socket) with the bulk, where the selector caps it."""
        if self.capped is not None:
            self.capped.demote(fileobj)
