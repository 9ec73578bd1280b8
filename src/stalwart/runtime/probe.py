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

A probe may also carry bytes (:class:`LinkNeed`): after a collective passed
its deadline, each peer is sent what one step's all-reduce sends over one link
(capped at ``MAX_PAYLOAD``), which its listener reads and acknowledges with one
byte. A peer whose acknowledgement comes later than the collective timeout
allows (scaled to the bytes sent) is on a link too slow for the job's steps
(:attr:`Reach.SLOW`): left in the quorum it would make every step pass its
deadline. In a ring all-reduce every member waits alike, so only a
per-pair measure tells which member's link is the slow one.

This is hand-written on purpose: it is the project's own reachability check
(the question is "does a TCP connect from here to that process's host get
through, and how fast", nothing a library answers), and it must be tiny and
bounded: the listener reads at most a length and that many bytes and answers
one byte, on at most ``_MAX_CONNECTIONS`` connections at once, each for at
most ``_CONNECTION_LIMIT`` seconds; every probe has a timeout, and the probes
run in parallel on a bounded pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import socket
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from stalwart.coord.wire import check_seconds

PROBE_TIMEOUT = 1.0
"""Seconds a probe's connect may take: a peer on a working network answers a SYN in milliseconds."""
_MAX_PARALLEL = 32
"""Most probes in flight at once (a quorum of more peers is probed in rounds)."""
_ACCEPT_CHECK = 0.5
"""Seconds between two looks at the stop flag while the listener waits for a connection."""
_BACKLOG = 64
_MAX_HOST = 255
MAX_PAYLOAD = 4 << 20
"""Most bytes one probe sends (a larger step's link is measured on this many, its allowance scaled down)."""
MAX_PROBE_BYTES = 64 << 20
"""Most bytes one diagnosis sends over all its probes: a quorum of thousands is probed with a few KiB each."""
MIN_WINDOW = 0.5
"""Shortest allowance for a probe's bytes, in seconds: a working link is never called slow on a scheduling hiccup."""
_LENGTH = struct.Struct("!I")
"""What a probe carrying bytes sends first: how many follow."""
_ACK = b"\x01"
_CHUNK = 1 << 16
_ZEROS = bytes(_CHUNK)
_MAX_CONNECTIONS = 16
"""Most probe connections a listener serves at once (one per peer probing it; more are closed unread)."""
_CONNECTION_LIMIT = 60.0
"""Longest a listener serves one probe connection, in seconds."""

Key = TypeVar("Key")


class Reach(enum.Enum):
    """What a probe of one peer found."""

    REACHABLE = "reachable"
    """The connect got through: the peer's host and process answer."""
    REFUSED = "refused"
    """The peer's host answered that nothing listens there: its process is gone."""
    CUT_OFF = "cut off"
    """The connect timed out or found no route: the network between the two is broken."""
    SLOW = "slow"
    """The connect got through, but the probe's bytes took longer than a step's all-reduce may (:class:`LinkNeed`)."""

    @property
    def unreachable(self) -> bool:
        """True when the peer cannot take part in a collective with this process."""
        return self is not Reach.REACHABLE


@dataclass(frozen=True)
class LinkNeed:
    """What a link must carry for the job's steps: ``step_bytes`` (one step's all-reduce) within ``seconds``.

    A ring all-reduce sends about twice the reduced bytes over each link, so
    a probe sends ``2 * step_bytes`` (at most :data:`MAX_PAYLOAD`, and at most
    :data:`MAX_PROBE_BYTES` over the ``peers`` probed at once) and allows them
    the same share of ``seconds`` (at least :data:`MIN_WINDOW`).
    """

    step_bytes: int
    seconds: float
    peers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.step_bytes, bool) or not isinstance(self.step_bytes, int) or self.step_bytes < 1:
            raise ValueError(f"step_bytes must be a positive int, got {self.step_bytes!r}")
        check_seconds("seconds", self.seconds)
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 1:
            raise ValueError(f"peers must be a positive int, got {self.peers!r}")

    @property
    def payload(self) -> int:
        """The bytes a probe sends (at least one)."""
        return max(1, min(2 * self.step_bytes, MAX_PAYLOAD, MAX_PROBE_BYTES // self.peers))

    @property
    def window(self) -> float:
        """Seconds the probe's bytes may take, from the connect to the acknowledgement."""
        return max(self.seconds * self.payload / (2 * self.step_bytes), MIN_WINDOW)


class ProbeListener:
    """A socket on ``host`` (port 0) that answers probes (see the module doc), on daemon threads, until closed."""

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
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
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
            if not self._slots.acquire(blocking=False):
                connection.close()  # the prober counts an unanswered probe as reachable, never as slow
                continue
            threading.Thread(target=self._answer, args=(connection,), name="stalwart-probe-answer", daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        """Read a probe's length and that many bytes, then acknowledge them; a bare connect ends at its EOF."""
        deadline = time.monotonic() + _CONNECTION_LIMIT
        try:
            with connection:
                header = _receive(connection, _LENGTH.size, deadline)
                if header is None:
                    return
                (length,) = _LENGTH.unpack(header)
                if length <= MAX_PAYLOAD and _drain(connection, length, deadline):
                    connection.sendall(_ACK)
        except OSError:
            pass  # the prober went away or was too slow: it reads its own verdict
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop accepting and close the socket (peers' probes are refused from then on).

        The shutdown wakes the thread waiting in ``accept`` (closing alone does
        not), so that ``close`` returns at once rather than after the accept's
        next check."""
        self._stop.set()
        with contextlib.suppress(OSError):  # not connected: a listening socket may refuse a shutdown elsewhere
            self._socket.shutdown(socket.SHUT_RDWR)
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


def probe(
    addresses: Mapping[Key, str], timeout: float = PROBE_TIMEOUT, *, need: LinkNeed | None = None
) -> dict[Key, Reach]:
    """Connect to each of ``addresses`` (``host:port``) within ``timeout`` seconds, in parallel; what each found.

    With ``need``, each connected peer is also sent ``need.payload`` bytes
    (shared by the peers probed), which must be acknowledged within
    ``need.window`` seconds, else it is :attr:`Reach.SLOW`. An address that is not ``host:port`` counts as cut off
    (nothing can reach it).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if need is not None and not isinstance(need, LinkNeed):
        raise TypeError(f"need must be a LinkNeed or None, got {need!r:.80}")
    if not addresses:
        return {}
    keys = list(addresses)
    if need is not None:
        need = dataclasses.replace(need, peers=len(keys))
    with ThreadPoolExecutor(min(len(keys), _MAX_PARALLEL), thread_name_prefix="stalwart-probe") as pool:
        found = pool.map(lambda key: _reach(addresses[key], timeout, need), keys)
        return dict(zip(keys, found, strict=True))


def _reach(address: str, timeout: float, need: LinkNeed | None) -> Reach:
    """One probe: a connect to ``address``, then (with ``need``) its bytes and their acknowledgement."""
    parsed = parse_address(address)
    if parsed is None:
        return Reach.CUT_OFF
    try:
        connection = socket.create_connection(parsed, timeout=timeout)
    except ConnectionRefusedError:
        return Reach.REFUSED
    except OSError:  # timed out, no route, network unreachable, blackholed (EINVAL), a name not resolved
        return Reach.CUT_OFF
    with connection:
        if need is None:
            return Reach.REACHABLE
        deadline = time.monotonic() + need.window
        try:
            _send(connection, _LENGTH.pack(need.payload), deadline)
            for start in range(0, need.payload, _CHUNK):
                _send(connection, _ZEROS[: min(_CHUNK, need.payload - start)], deadline)
            _receive(connection, len(_ACK), deadline)  # None: closed unacknowledged (a busy listener), not slow
        except TimeoutError:
            return Reach.SLOW
        except (ConnectionResetError, BrokenPipeError):
            return Reach.REACHABLE  # its listener is busy with other probes: the host answered, nothing measured
        except OSError:
            return Reach.CUT_OFF
        return Reach.REACHABLE


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the probe's deadline passed")
    return left


def _send(connection: socket.socket, data: bytes, deadline: float) -> None:
    connection.settimeout(_remaining(deadline))
    connection.sendall(data)


def _receive(connection: socket.socket, size: int, deadline: float) -> bytes | None:
    """Exactly ``size`` bytes by ``deadline`` (TimeoutError past it); None when the other end closed first."""
    received = bytearray()
    while len(received) < size:
        connection.settimeout(_remaining(deadline))
        chunk = connection.recv(size - len(received))
        if not chunk:
            return None
        received += chunk
    return bytes(received)


def _drain(connection: socket.socket, size: int, deadline: float) -> bool:
    """Read and drop ``size`` bytes by ``deadline`` (TimeoutError past it); False when the other end closed first."""
    buffer = bytearray(_CHUNK)
    left = size
    while left:
        connection.settimeout(_remaining(deadline))
        count = connection.recv_into(buffer, min(left, _CHUNK))
        if not count:
            return False
        left -= count
    return True
