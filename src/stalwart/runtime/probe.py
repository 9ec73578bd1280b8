"""Peer reachability: a listener every process keeps, and the probe that tells a cut-off peer from a dead or slow one.

A failed rendezvous or collective says only that some peer did not answer.
To tell the lighthouse which peers this member cannot reach (it forms the
next quorum among members that reach one another), and to say in the error
whether a peer looked dead, cut off or slow, each process listens on a tiny
TCP socket on its transport host (:class:`ProbeListener`, port 0, published
with its arrival in the quorum's store) and, after a failure, connects to each
peer's (:func:`probe`): a connect that succeeds is a reachable peer, one
refused is a host whose process is gone, one that times out or finds no route
is a peer cut off from this one.

This is hand-written on purpose: it is the project's own reachability check
(the question is "does a TCP connect from here to that process's host get
through", nothing a library answers), and it must be tiny and bounded: the
listener reads nothing and answers nothing, every connect has a timeout, and
the probes run in parallel on a bounded pool.
"""

from __future__ import annotations

import enum
import math
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

PROBE_TIMEOUT = 1.0
"""Seconds a probe's connect may take: a peer on a working network answers a SYN in milliseconds."""
_MAX_PARALLEL = 32
"""Most probes in flight at once (a quorum of more peers is probed in rounds)."""
_ACCEPT_CHECK = 0.5
"""Seconds between two looks at the stop flag while the listener waits for a connection."""
_BACKLOG = 64
_MAX_HOST = 255

Key = TypeVar("Key")


class Reach(enum.Enum):
    """What a probe of one peer found."""

    REACHABLE = "reachable"
    """The connect got through: the peer's host and process answer."""
    REFUSED = "refused"
    """The peer's host answered that nothing listens there: its process is gone."""
    CUT_OFF = "cut off"
    """The connect timed out or found no route: the network between the two is broken."""

    @property
    def unreachable(self) -> bool:
        """True when the peer cannot take part in a collective with this process."""
        return self is not Reach.REACHABLE


class ProbeListener:
    """A socket on ``host`` (port 0) that accepts connections and closes them, on a daemon thread, until closed."""

    def __init__(self, host: str) -> None:
        if not isinstance(host, str) or not host or len(host) > _MAX_HOST:
            raise ValueError(f"host must be a non-empty address of at most {_MAX_HOST} characters, got {host!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, 0))
            self._socket.listen(_BACKLOG)
        except OSError:
            self._socket.close()
            raise
        self._socket.settimeout(_ACCEPT_CHECK)
        self.address = format_address(host, self._socket.getsockname()[1])
        """``host:port`` (``[host]:port`` for IPv6), as peers connect to it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stalwart-probe-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        """Stop accepting and close the socket (peers' probes are refused from then on)."""
        self._stop.set()
        self._socket.close()
        self._thread.join(2 * _ACCEPT_CHECK)


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a published ``host:port``; None when it is not one (a peer's text is checked, not
    trusted)."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or len(host) > _MAX_HOST or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def probe(addresses: Mapping[Key, str], timeout: float = PROBE_TIMEOUT) -> dict[Key, Reach]:
    """Connect to each of ``addresses`` (``host:port``) within ``timeout`` seconds, in parallel; what each found.

    An address that is not ``host:port`` counts as cut off (nothing can reach it).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not addresses:
        return {}
    keys = list(addresses)
    with ThreadPoolExecutor(min(len(keys), _MAX_PARALLEL), thread_name_prefix="stalwart-probe") as pool:
        found = pool.map(lambda key: _reach(addresses[key], timeout), keys)
        return dict(zip(keys, found, strict=True))


def _reach(address: str, timeout: float) -> Reach:
    """One probe: a connect to ``address``, closed at once."""
    parsed = parse_address(address)
    if parsed is None:
        return Reach.CUT_OFF
    try:
        with socket.create_connection(parsed, timeout=timeout):
            return Reach.REACHABLE
    except ConnectionRefusedError:
        return Reach.REFUSED
    except OSError:  # timed out, no route, network unreachable, blackholed (EINVAL), a name not resolved
        return Reach.CUT_OFF
