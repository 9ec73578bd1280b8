"""The quorum store the lighthouse serves: the keys one quorum's processes rendezvous, heal and reshard through.

It replaces an open ``torch.distributed.TCPStore``: every request comes over
the lighthouse's own HTTP(S) port with the bearer token, and names the store
key that only the quorum's answers carry (``docs/protocol.md``, "The quorum
store"). Only the current quorum has a store: forming the next one deletes
the older one's keys and ends its waits (410), so keys never pile up; a
quorum formed ahead and withdrawn has its store ended so at once (it never
runs). Each store is capped in value size, total bytes, keys and pending
waits, and a wait lasts at most :data:`~stalwart.coord.protocol.MAX_STORE_WAIT_S` per
request (the client asks again until its own timeout). A request names each
key once (400 naming a repeated one), and one answer carries at most
``answer_bytes`` of values (413 naming the limit and the size): a
``multi_get`` naming a large key 4,096 times would otherwise build hundreds of
MiB. Answers hold the values as bytes; :func:`encode_answer` makes their JSON
(the server does it off the event loop when it is large).

The values and their semantics (``compare_set`` as c10d's stores) are plain
Python; the waits are asyncio futures woken per key, so a set costs what
waits on that key. No I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stalwart.coord.protocol import StoreRequest, store_answer_values
from stalwart.coord.wire import RequestError


@dataclass(frozen=True)
class StoreLimits:
    """Caps on one quorum's store."""

    value_bytes: int = 16 << 20
    """Largest value (heal metadata of a very large model fits)."""
    total_bytes: int = 128 << 20
    keys: int = 1 << 16
    waits: int = 1 << 14
    """Store requests waiting for keys at once."""
    answer_bytes: int = 16 << 20
    """Most bytes of values one answer carries: a ``multi_get`` returns together what one ``get`` may."""


class StoreGone(RequestError):
    """The quorum's store no longer exists (a newer quorum formed, the quorum was withdrawn, or the lighthouse
    restarted): 410."""

    def __init__(self, quorum_id: int) -> None:
        super().__init__(
            410,
            f"quorum {quorum_id}'s store is gone: a newer quorum formed, the quorum was withdrawn or the lighthouse "
            "restarted; ask for a quorum",
            code="store_gone",
            quorum_id=quorum_id,
        )


class QuorumStore:
    """The keys of one quorum, their caps and the requests waiting for keys."""

    def __init__(self, quorum_id: int, limits: StoreLimits) -> None:
        self.quorum_id = quorum_id
        self.key = secrets.token_urlsafe(32)
        """The credential its answers carry (never persisted: a restarted lighthouse hands out new ones)."""
        self.limits = limits
        self.values: dict[str, bytes] = {}
        self.size = 0
        self.closed = False
        self._waits: dict[str, list[asyncio.Future[None]]] = {}
        self._waiting = 0

    def check_key(self, given: str | None) -> None:
        """403 unless ``given`` is this store's key."""
        if given is None or not hmac.compare_digest(given.encode(), self.key.encode()):
            raise RequestError(403, f"missing or wrong store key for quorum {self.quorum_id}'s store", code="forbidden")

    async def apply(self, request: StoreRequest) -> dict[str, Any]:
        """Run one operation; the answer's JSON."""
        op, keys = request.op, request.keys
        _check_distinct(keys)
        if op in ("get", "wait", "multi_get") and request.wait > 0:
            await self._wait_for(keys, request.wait)
        if self.closed:
            raise StoreGone(self.quorum_id)
        if op == "set":
            self._put(keys[0], request.values[0])
            return {}
        if op == "append":
            self._put(keys[0], self.values.get(keys[0], b"") + request.values[0])
            return {}
        if op == "get":
            return {"value": self.values.get(keys[0])}
        if op == "multi_get":
            found = [self.values.get(key) for key in keys]
            if any(value is None for value in found):
                return {"values": None}
            size = sum(len(value) for value in found if value is not None)
            if size > self.limits.answer_bytes:
                raise RequestError(
                    413, f"the values of these {len(keys)} keys hold {size} bytes, over the store's limit of "
                    f"{self.limits.answer_bytes} bytes per answer; ask for fewer keys at a time",
                    cap="answer_bytes", size=size,
                )  # fmt: skip
            return {"values": found}
        if op == "add":
            return {"value": self._add(keys[0], request.amount)}
        if op == "compare_set":
            return {"value": self._compare_set(keys[0], *request.values)}
        if op in ("check", "wait"):
            return {"present": all(key in self.values for key in keys)}
        if op == "delete":
            return {"deleted": self._delete(keys[0])}
        return {"count": len(self.values)}  # num_keys

    def close(self) -> None:
        """Delete every key and end the waits (they answer 410)."""
        self.closed = True
        self.values.clear()
        self.size = 0
        for waits in self._waits.values():
            for wait in waits:
                if not wait.done():
                    wait.set_result(None)
        self._waits.clear()

    # --- values --------------------------------------------------------------------------------------------

    def _put(self, key: str, value: bytes) -> None:
        limits = self.limits
        if len(value) > limits.value_bytes:
            raise RequestError(
                413, f"a store value may have {limits.value_bytes} bytes, got {len(value)}", field="value"
            )
        old = self.values.get(key)
        if old is None and len(self.values) >= limits.keys:
            raise RequestError(507, f"quorum {self.quorum_id}'s store holds {limits.keys} keys, its cap", cap="keys")
        size = self.size + len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if size > limits.total_bytes:
            raise RequestError(
                507, f"quorum {self.quorum_id}'s store would hold {size} bytes, over its cap of {limits.total_bytes}",
                cap="total_bytes",
            )  # fmt: skip
        self.values[key] = value
        self.size = size
        for wait in self._waits.pop(key, ()):
            if not wait.done():
                wait.set_result(None)

    def _add(self, key: str, amount: int) -> int:
        current = self.values.get(key, b"0")
        try:
            value = int(current.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise RequestError(400, f"store key {key!r} does not hold an integer", field="key") from None
        if abs(value) > 1 << 62:
            raise RequestError(400, f"store key {key!r} would pass 2^62", field="amount")
        self._put(key, str(value).encode("ascii"))
        return value

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's semantics: set ``desired`` if the key holds ``expected`` (or is absent and ``expected`` empty);
        returns the value the key then holds, or ``expected`` when it is absent and stays so."""
        current = self.values.get(key)
        if (current is None and not expected) or current == expected:
            self._put(key, desired)
            return desired
        return expected if current is None else current

    def _delete(self, key: str) -> bool:
        value = self.values.pop(key, None)
        if value is None:
            return False
        self.size -= len(key) + len(value)
        return True

    # --- waits ---------------------------------------------------------------------------------------------

    async def _wait_for(self, keys: Iterable[str], seconds: float) -> None:
        """Until every key is present, the store closes or ``seconds`` pass (the answer then says what is there)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        for key in keys:
            while key not in self.values and not self.closed:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return
                if self._waiting >= self.limits.waits:
                    raise RequestError(
                        503, f"{self.limits.waits} store requests already wait on quorum {self.quorum_id}'s store",
                        cap="waits", retry=True,
                    )  # fmt: skip
                wait = loop.create_future()
                self._waits.setdefault(key, []).append(wait)
                self._waiting += 1
                try:
                    await asyncio.wait({wait}, timeout=remaining)
                finally:
                    self._waiting -= 1
                    waits = self._waits.get(key)
                    if waits is not None:
                        with contextlib.suppress(ValueError):
                            waits.remove(wait)
                        if not waits:
                            del self._waits[key]


def _check_distinct(keys: tuple[str, ...]) -> None:
    """400 naming the first key a request names twice."""
    if len(set(keys)) == len(keys):
        return
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise RequestError(400, f"keys names {key[:80]!r} more than once: name each key once", field="keys")
        seen.add(key)


def answer_bytes(answer: dict[str, Any]) -> int:
    """Bytes of values an answer of :meth:`QuorumStore.apply` carries (what its JSON costs to build)."""
    values = answer.get("values") or [answer.get("value")]
    return sum(len(value) for value in values if isinstance(value, bytes))


def encode_answer(answer: dict[str, Any]) -> bytes:
    """The JSON of an answer of :meth:`QuorumStore.apply`: its values in base64 (None for a key not there)."""
    wire = dict(answer)
    for name in ("value", "values"):
        value = wire.get(name)
        if isinstance(value, bytes):
            wire[name] = store_answer_values([value])[0]
        elif isinstance(value, list):
            wire[name] = store_answer_values(value)
    return json.dumps(wire, separators=(",", ":")).encode()


class QuorumStores:
    """The store of the current quorum: opened when it forms, the older one's deleted at once."""

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._current: QuorumStore | None = None

    def open(self, quorum_id: int) -> QuorumStore:
        """The store of quorum ``quorum_id`` (created, and any older one deleted, when it is new)."""
        current = self._current
        if current is not None and current.quorum_id == quorum_id:
            return current
        if current is not None:
            current.close()
        self._current = QuorumStore(quorum_id, self.limits)
        return self._current

    def end(self, quorum_id: int) -> None:
        """Delete quorum ``quorum_id``'s keys and end its waits (410): the quorum will never run (formed ahead, then
        withdrawn), and a member waiting there for a peer's keys must ask again now. Its store stays the current
        one, closed (opened so if it was not yet), so that every later request to it is answered 410 as well (an
        answer naming the quorum may still be on its way) until the next quorum forms."""
        store = self.open(quorum_id)
        if not store.closed:
            store.close()

    def get(self, quorum_id: int) -> QuorumStore:
        """Quorum ``quorum_id``'s store; :class:`StoreGone` (410) when it is not the current one."""
        current = self._current
        if current is None or current.quorum_id != quorum_id:
            raise StoreGone(quorum_id)
        return current

    def close(self) -> None:
        """End every wait (the lighthouse stops)."""
        if self._current is not None:
            self._current.close()
            self._current = None

    @property
    def keys(self) -> int:
        """How many keys the current store holds."""
        return 0 if self._current is None else len(self._current.values)
