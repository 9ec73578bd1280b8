"""Change stamps for the lighthouse's persisted parts: what a save writes follows from what changed. Pure: no I/O.

A persisted part derives from :class:`Tracked`: every assignment to one of
its attributes after construction stamps the part with the next value of a
process-wide counter, and a ``dict`` it is given becomes a
:class:`TrackedDict` whose every mutation stamps the part too (a copy of
it: change it through the attribute, not through the dict given). So the save
(:mod:`~stalwart.coord.snapshot`) compares each part's stamp with the one it
saved last, and no mutation has to remember to mark itself: a new field is
tracked as soon as it is assigned. A part lists the attributes that are not
persisted in ``UNTRACKED`` (caches, queues the save drains by itself), and may
not hold a plain ``list`` or ``set`` in a tracked attribute (their in-place
changes would go unseen: use a tuple or a frozenset). Values inside a tracked
attribute (a ledger, a frozen record) are changed by assigning them again.

:class:`TrackedDict` also records, when asked (``keys=True``), which keys
changed, so that a part kept as one row per key (the members) saves the rows
that changed only. Hand-written rather than a library's observable
containers: the save needs a stamp comparable across parts and the set of
changed keys, both in constant time per mutation.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_STAMPS = itertools.count(1)
"""Process-wide, so that a part replaced by a fresh one still stamps its owner later than anything before."""


def next_stamp() -> int:
    """A stamp later than every one handed out before (thread-safe: ``next`` on a count holds the GIL)."""
    return next(_STAMPS)


class Tracked:
    """A persisted part: ``stamp`` grows with every change of a tracked attribute (0: unchanged since built)."""

    UNTRACKED: ClassVar[frozenset[str]] = frozenset()
    """Attributes that are not persisted (caches, queues drained apart): assigning them stamps nothing."""

    stamp: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.UNTRACKED:
            if type(value) is dict:
                value = TrackedDict(value, owner=self)
            elif isinstance(value, TrackedDict):
                value.owner = self
            elif isinstance(value, list | set):
                raise TypeError(
                    f"{type(self).__name__}.{name} is persisted: a {type(value).__name__}'s in-place changes would "
                    "not be saved; give it a tuple or a frozenset, or list it in UNTRACKED"
                )
            try:  # not ``name in self.__dict__``: reading ``__dict__`` makes every later attribute read slower
                object.__getattribute__(self, name)
            except AttributeError:
                pass  # its first assignment: construction, no change
            else:
                object.__setattr__(self, "stamp", next_stamp())
        object.__setattr__(self, name, value)

    def changed(self) -> None:
        """Stamp the part (its :class:`TrackedDict` attributes call this on every mutation)."""
        object.__setattr__(self, "stamp", next_stamp())


class TrackedDict(dict[K, V]):
    """A dict whose every mutation stamps it (``stamp``) and its ``owner`` part; with ``keys`` it records which
    keys changed (:meth:`take_keys`)."""

    __slots__ = ("keys_changed", "owner", "stamp")  # no instance dict: lookups stay as fast as a dict's

    def __init__(
        self, data: Mapping[K, V] | Iterable[tuple[K, V]] = (), *, owner: Tracked | None = None, keys: bool = False
    ) -> None:
        super().__init__(data)
        self.owner = owner
        self.stamp = 0
        self.keys_changed: set[K] | None = set() if keys else None

    def _changed(self, keys: Iterable[Any]) -> None:
        self.stamp = next_stamp()
        if self.owner is not None:
            self.owner.changed()
        if self.keys_changed is not None:
            self.keys_changed.update(keys)

    def take_keys(self) -> set[K]:
        """The keys changed since the last call (empty unless built with ``keys``)."""
        taken = self.keys_changed or set()
        if self.keys_changed is not None:
            self.keys_changed = set()
        return taken

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self._changed((key,))

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._changed((key,))

    def pop(self, key: K, *default: Any) -> Any:
        if key not in self:
            return super().pop(key, *default)
        value = super().pop(key)
        self._changed((key,))
        return value

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        self._changed((key,))
        return key, value

    def setdefault(self, key: K, default: V = None) -> V:  # type: ignore[assignment]
        if key in self:
            return self[key]
        self[key] = default
        return default

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> TrackedDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        keys = list(self)
        super().clear()
        self._changed(keys)
