"""The quorum's store as a ``torch.distributed.Store``: every operation an authenticated request to the lighthouse.

Gloo's and NCCL's rendezvous, the heal metadata and the sharded state's
reshard read and write keys through a ``dist.Store``. :class:`LighthouseStore`
is one whose every operation is a ``POST /v1/store/{quorum_id}`` to the
lighthouse (over HTTPS when its URL is ``https://``), carrying the bearer
token and the quorum's store key that only quorum answers tell
(:mod:`stalwart.coord.store`). Nobody without both can read, list, write,
delete or wait on the quorum's keys; ``list_keys`` does not exist.

A blocking ``get``/``wait`` is a series of bounded waits on the lighthouse
until the store's timeout, so a lighthouse that restarts or a quorum that is
superseded (410) ends it at once with ``DistStoreError``, which the
Communicator turns into a failed collective. It is thread-safe: each thread
has its own kept-alive connection.
"""

from __future__ import annotations

import datetime
import http.client
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from stalwart.coord.protocol import (
    MAX_STORE_WAIT_S,
    STORE_KEY_HEADER,
    STORE_PATH,
    StoreAddress,
    StoreRequest,
    bearer_headers,
    store_value,
)

_RETRY_S = 0.05
"""Pause before asking again after a 503 (the lighthouse is busy or cannot persist)."""
_IDEMPOTENT = frozenset({"set", "get", "check", "wait", "num_keys", "multi_get", "delete", "compare_set"})
"""Operations sent again when a kept-alive connection turns out closed (``add`` and ``append`` are not)."""


class LighthouseStore(dist.Store):
    """The keys of quorum ``address.quorum_id``, on the lighthouse at ``address.url``; blocking calls wait up to
    ``timeout`` seconds."""

    def __init__(
        self, address: StoreAddress, timeout: float, *, token: str | None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        super().__init__()
        parts = urllib.parse.urlsplit(address.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the store's URL must be the lighthouse's http(s):// URL, got {address.url!r}")
        self.address = address
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._ssl = ssl_context if ssl_context is not None or not self._https else ssl.create_default_context()
        self._path = f"{parts.path.rstrip('/')}{STORE_PATH}/{address.quorum_id}"
        self._headers = {**bearer_headers(token), STORE_KEY_HEADER: address.key, "Content-Type": "application/json"}
        self._seconds = timeout
        self.set_timeout(datetime.timedelta(seconds=timeout))
        self._local = threading.local()

    # --- torch.distributed.Store ---------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._call(StoreRequest("set", (key,), (_bytes(value),)))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._seconds
        while True:
            remaining = deadline - time.monotonic()
            answer = self._call(StoreRequest("get", (key,), wait=_wait(remaining)))
            value = store_value(answer)
            if value is not None:
                return value
            if remaining <= 0:
                raise dist.DistStoreError(self._timed_out([key]))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(StoreRequest("add", (key,), amount=int(amount)))["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        answer = self._call(StoreRequest("compare_set", (key,), (_bytes(expected), _bytes(desired))))
        return store_value(answer) or b""

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(StoreRequest("check", tuple(keys)))["present"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._seconds if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if self.present_within(keys, remaining):
                return
            if remaining <= 0:
                raise dist.DistStoreError(self._timed_out(keys, seconds))

    def present_within(self, keys: list[str], seconds: float) -> bool:
        """Whether ``keys`` are all present within ``seconds`` (at most ``MAX_STORE_WAIT_S``): one bounded wait
        on the lighthouse, answered the moment the last key is set; False at the end of the wait, no error."""
        return bool(self._call(StoreRequest("wait", tuple(keys), wait=_wait(seconds)))["present"])

    def delete_key(self, key: str) -> bool:
        return bool(self._call(StoreRequest("delete", (key,)))["deleted"])

    def num_keys(self) -> int:
        return int(self._call(StoreRequest("num_keys"))["count"])

    def append(self, key: str, value: bytes | str) -> None:
        self._call(StoreRequest("append", (key,), (_bytes(value),)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        deadline = time.monotonic() + self._seconds
        while True:
            remaining = deadline - time.monotonic()
            values = self._call(StoreRequest("multi_get", tuple(keys), wait=_wait(remaining)))["values"]
            if values is not None:
                return [store_value({"value": value}) or b"" for value in values]
            if remaining <= 0:
                raise dist.DistStoreError(self._timed_out(keys))

    def multi_set(self, keys: list[str], values: Sequence[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def list_keys(self) -> list[str]:
        raise dist.DistStoreError("the quorum store does not list its keys")

    # --- transport -----------------------------------------------------------------------------------------

    def _call(self, request: StoreRequest) -> dict[str, Any]:
        """One operation: its answer's JSON; ``DistStoreError`` when the lighthouse refuses or cannot be reached."""
        body = json.dumps(request.to_body(), separators=(",", ":"))
        deadline = time.monotonic() + self._seconds + MAX_STORE_WAIT_S
        while True:
            status, data = self._exchange(request.op, body)
            if status == 200 and isinstance(data, dict):
                return data
            if status == 503 and time.monotonic() < deadline:
                time.sleep(_RETRY_S)
                continue
            error = data.get("error") if isinstance(data, dict) else None
            raise dist.DistStoreError(
                f"the lighthouse refused {request.op} on quorum {self.address.quorum_id}'s store ({status}: {error})"
            )

    def _exchange(self, op: str, body: str) -> tuple[int, Any]:
        for attempt in range(2):
            connection, reused = self._connection()
            try:
                connection.request("POST", self._path, body, self._headers)
                response = connection.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                self._local.connection = None
                if reused and attempt == 0 and op in _IDEMPOTENT:
                    continue  # the lighthouse closed the idle connection: once more on a new one
                raise dist.DistStoreError(
                    f"cannot reach quorum {self.address.quorum_id}'s store at {self.address.url}: {error}"
                ) from None
            try:
                return response.status, json.loads(raw)
            except ValueError:
                return response.status, {"error": raw[:200].decode(errors="replace")}
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            return connection, True
        timeout = self._seconds + MAX_STORE_WAIT_S
        if self._https:
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        self._local.connection = connection
        return connection, False

    def _timed_out(self, keys: Sequence[str], seconds: float | None = None) -> str:
        limit = self._seconds if seconds is None else seconds
        return f"timed out after {limit:g} s waiting for {list(keys)[:4]} in quorum {self.address.quorum_id}'s store"


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _wait(remaining: float) -> float:
    return max(0.0, min(MAX_STORE_WAIT_S, remaining))
