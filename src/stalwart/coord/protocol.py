"""The wire protocol between the workers and the lighthouse, typed: one module for server, client and benchmarks.

Headers, the bodies members send (registration, quorum requests, heartbeats,
leaves, checkpoint reports), the quorum answer and its heal plan, the ledger
digest, and the quorum store's requests (``docs/protocol.md``). The server
parses with these types, the client and the scale benchmark's simulated
members build and read with them, so a change to the wire is one change here.
Pure: no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.coord.formation import MemberDelta, step_ledger
from stalwart.coord.wire import (
    MAX_WIRE_INT,
    REASONS,
    RequestError,
    parse_digest,
    parse_member,
    parse_step,
    parse_weights,
)
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.errors import StalwartError

TOKEN_ENVIRONMENT = "STALWART_LIGHTHOUSE_TOKEN"
"""Where the lighthouse, the workers and the demo's workers read the job's bearer token (never a command line)."""
AUTHORIZATION_HEADER = "Authorization"
INCARNATION_HEADER = "X-Stalwart-Incarnation"
SECRET_HEADER = "X-Stalwart-Secret"
STORE_KEY_HEADER = "X-Stalwart-Store-Key"
"""The quorum store's key (told only in quorum answers): every store request carries it."""
MAX_HEADER_CHARS = 512
"""Longest credential header accepted (a bearer token, an incarnation, a secret, a store key)."""
_HEADER_PATTERN = re.compile(r"[\x20-\x7e]*")

REGISTER_PATH = "/v1/register"
QUORUM_PATH = "/v1/quorum"
HEARTBEAT_PATH = "/v1/heartbeat"
HEARTBEAT_RECONNECT_CODE = 4001
"""The close code of a heartbeat socket its member closes to open another (the lighthouse stopped answering on it):
the member lives on, judged by the heartbeat timeout, not dead as a socket closed without it."""
DEFAULT_HEARTBEAT_TIMEOUT = 2.0
"""Seconds of silence after which the lighthouse counts a member dead, unless configured otherwise."""
BEATS_PER_TIMEOUT = 4
"""Heartbeats a member sends per ``heartbeat_timeout`` by default (every 0.5 s at the default 2 s), and at least:
the lighthouse never asks for an interval longer than a quarter of its timeout. Each beat wakes the worker's
heartbeat thread, which takes the GIL from the training loop (at 0.1 s the beats cost the GPT example's step
about 2 ms of CPU a process), and detection is the timeout's, not the interval's."""
LEAVE_PATH = "/v1/leave"
REACH_PATH = "/v1/reach"
"""``POST /v1/reach``: a member left out for its cuts names the peers its probe got through to again."""
CHECKPOINT_PATH = "/v1/checkpoint"
STORE_PATH = "/v1/store"
"""``POST /v1/store/{quorum_id}``: one store operation (:class:`StoreRequest`) on that quorum's keys."""


# --- headers ---------------------------------------------------------------------------------------------------


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header for ``token`` (none without a token)."""
    return {} if token is None else {AUTHORIZATION_HEADER: f"Bearer {token}"}


def identity_headers(incarnation: str, secret: str) -> dict[str, str]:
    """The headers by which an incarnation speaks for its member."""
    return {INCARNATION_HEADER: incarnation, SECRET_HEADER: secret}


def parse_header(value: str | None, name: str) -> str | None:
    """A credential header's value (None when absent or empty): printable ASCII of at most ``MAX_HEADER_CHARS``.

    Else ``RequestError`` 400 naming the header (a non-UTF-8 or binary header is refused before any check).
    """
    if not value:
        return None
    if len(value) > MAX_HEADER_CHARS or not _HEADER_PATTERN.fullmatch(value):
        raise RequestError(
            400, f"the {name} header must be printable ASCII of at most {MAX_HEADER_CHARS} characters", field=name
        )
    return value


# --- the ledger digest -----------------------------------------------------------------------------------------


def ledger_digest(state: Mapping[str, Any]) -> str:
    """The digest of a ledger ``state_dict()``: SHA-256 of its canonical JSON, first 16 bytes in hex.

    A member reports it with its ``applied_step`` (its ledger after the
    commit); the lighthouse commits the step only if its own replay agrees.
    """
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- what members send -----------------------------------------------------------------------------------------


def register_body(member: str, incarnation: str, plan: EpochPlan | None) -> dict[str, Any]:
    """``POST /v1/register``'s body."""
    body: dict[str, Any] = {"member": member, "incarnation": incarnation}
    if plan is not None:
        body["plan"] = plan.to_dict()
    return body


def report_fields(digest: str | None, weights: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``digest`` and ``weights`` fields that go with a reported step (only those set)."""
    fields: dict[str, Any] = {}
    if digest is not None:
        fields["digest"] = digest
    if weights is not None:
        fields["weights"] = dict(weights)
    return fields


def heartbeat_message(
    applied_step: int,
    digest: str | None = None,
    weights: Mapping[str, Any] | None = None,
    heal: Mapping[str, Any] | None = None,
    rounds: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A heartbeat: ``{"applied_step", "digest"?, "weights"?, "heal"?, "rounds"?}`` (heal: :class:`HealTotals`'
    JSON; rounds: a DiLoCo member's figures, :mod:`stalwart.coord.rounds`)."""
    message: dict[str, Any] = {"applied_step": int(applied_step), **report_fields(digest, weights)}
    if heal is not None:
        message["heal"] = dict(heal)
    if rounds is not None:
        message["rounds"] = dict(rounds)
    return message


def leave_body(
    member: str, applied_step: int | None, digest: str | None = None, weights: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``POST /v1/leave``'s body."""
    body: dict[str, Any] = {"member": member}
    if applied_step is not None:
        body["applied_step"] = applied_step
        body.update(report_fields(digest, weights))
    return body


def checkpoint_body(member: str, step: int, path: str, ledger: Mapping[str, Any], digest: str) -> dict[str, Any]:
    """``POST /v1/checkpoint``'s body."""
    return {"member": member, "step": step, "path": path, "ledger": dict(ledger), "digest": digest}


@dataclass(frozen=True)
class QuorumRequest:
    """A member's ``POST /v1/quorum`` body."""

    member: str
    applied_step: int
    quorum_id: int | None
    reason: str
    digest: str | None = None
    """The member's ledger digest at ``applied_step`` (see ``ledger_digest``); needed to commit steps."""
    weights: dict[str, Any] | None = None
    """A balanced ledger's weights record at ``applied_step`` (see :func:`~stalwart.coord.wire.parse_weights`)."""
    wire: int = field(default=1, compare=False)
    """The answer's wire: 2 when the request carried ``known`` (see ``Formation.render``); not part of the request's
    identity, so a retried long poll matches whatever it asks the answer in."""
    known: int | None = field(default=None, compare=False)
    """The quorum whose answer the member holds (wire 2): the members then come as a delta from it."""
    unreachable: tuple[str, ...] = field(default=(), compare=False)
    """The members of this member's last quorum that it could not reach (a failed rendezvous or collective, then a
    probe): an observation that rides along (``docs/protocol.md``, "Reachability"), not part of the request's
    identity, so a retried long poll matches whatever it reports."""

    def to_json(self) -> dict[str, Any]:
        """Every field but ``unreachable``, as ``QuorumRequest(**...)`` takes them back (for persistence: the cuts a
        report makes are not persisted either)."""
        return {
            "member": self.member,
            "applied_step": self.applied_step,
            "quorum_id": self.quorum_id,
            "reason": self.reason,
            "digest": self.digest,
            "weights": self.weights,
            "wire": self.wire,
            "known": self.known,
        }

    def to_body(self) -> dict[str, Any]:
        """The request as a member sends it (``known`` only on wire 2)."""
        body: dict[str, Any] = {
            "member": self.member,
            "applied_step": self.applied_step,
            "quorum_id": self.quorum_id,
            "reason": self.reason,
            **report_fields(self.digest, self.weights),
        }
        if self.wire == 2:
            body["known"] = self.known
        if self.unreachable:
            body["unreachable"] = list(self.unreachable)
        return body

    @classmethod
    def from_json(cls, body: Any) -> QuorumRequest:
        """Validate a decoded JSON body; ``RequestError`` 400 names the bad field and value."""
        if not isinstance(body, Mapping):
            raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - _QUORUM_FIELDS)
        if unknown:
            raise RequestError(400, f"unknown fields {unknown}", field=unknown[0])
        for name in ("member", "applied_step", "reason"):
            if name not in body:
                raise RequestError(400, f"{name} is required", field=name)
        member = parse_member(body["member"])
        applied_step = parse_step(body["applied_step"])
        reason = body["reason"]
        if reason not in REASONS:
            raise RequestError(400, f"reason must be one of {list(REASONS)}, got {reason!r}", field="reason")
        quorum_id = body.get("quorum_id")
        if quorum_id is not None:
            quorum_id = parse_step(quorum_id, "quorum_id")
        elif reason != "join":
            raise RequestError(400, f"quorum_id must be an int for reason {reason!r}, got None", field="quorum_id")
        known = body.get("known")
        known = None if known is None else parse_step(known, "known")
        return cls(
            member,
            applied_step,
            quorum_id,
            reason,
            parse_digest(body.get("digest")),
            parse_weights(body.get("weights")),
            wire=2 if "known" in body else 1,
            known=known,
            unreachable=parse_unreachable(body.get("unreachable", []), member),
        )


ASK_PREFIX = '{"ask":'
"""How a quorum request sent on the heartbeat socket begins: the lighthouse tells it from a heartbeat by this prefix,
without parsing the heartbeats that repeat (``docs/protocol.md``, "Asking on the heartbeat socket")."""
MAX_SOCKET_MESSAGE_BYTES = 4096
"""The largest message a member sends on its heartbeat socket (a balanced lighthouse takes up to 64 KiB); a quorum
request that does not fit goes as ``POST /v1/quorum``."""
MAX_SOCKET_ASKS = 4
"""Quorum requests one heartbeat socket may have in flight; more are answered 429 (one long poll per incarnation
waits at a time anyway: a newer one answers the older with 409)."""


def ask_message(ask_id: int, body: Mapping[str, Any]) -> str:
    """A quorum request (``QuorumRequest.to_body()``) sent on the heartbeat socket: ``{"ask": id, "request": body}``."""
    return f'{ASK_PREFIX}{int(ask_id)},"request":{json.dumps(body, separators=(",", ":"))}}}'


def parse_ask(text: str) -> tuple[int, QuorumRequest]:
    """The id and request of a socket ask; ``RequestError`` 400 names what is wrong (the id is -1 when unreadable)."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RequestError(400, f"the ask is not JSON: {error}", ask=-1) from None
    if not isinstance(message, dict) or set(message) != {"ask", "request"}:
        raise RequestError(400, 'an ask must be {"ask": int, "request": {...}}', ask=-1)
    ask_id = message["ask"]
    if isinstance(ask_id, bool) or not isinstance(ask_id, int) or not 0 <= ask_id <= MAX_WIRE_INT:
        raise RequestError(400, f"ask must be an int in [0, 2**62], got {ask_id!r}"[:200], ask=-1)
    try:
        return ask_id, QuorumRequest.from_json(message["request"])
    except RequestError as error:
        raise RequestError(error.status, error.message, ask=ask_id, **error.details) from None


def answer_message(ask_id: int, status: int, body: bytes) -> str:
    """The lighthouse's answer to socket ask ``ask_id``: ``{"type": "answer", "ask", "status", "body"}``, ``body``
    being the JSON ``POST /v1/quorum`` would answer (spliced in, not parsed again)."""
    return f'{{"type":"answer","ask":{int(ask_id)},"status":{int(status)},"body":{body.decode()}}}'


_QUORUM_FIELDS = {"member", "applied_step", "quorum_id", "reason", "digest", "weights", "known", "unreachable"}
MAX_UNREACHABLE = 4096
"""Most members one quorum request may report unreachable (the lighthouse's default ``max_members``)."""


def parse_unreachable(value: Any, member: str, name: str = "unreachable") -> tuple[str, ...]:
    """A list of peers (a quorum request's ``unreachable``, a reach report's ``reached``, named ``name``): at most
    ``MAX_UNREACHABLE`` distinct member ids, not ``member``.

    Else ``RequestError`` 400 naming the field and the value.
    """
    if not isinstance(value, list) or len(value) > MAX_UNREACHABLE:
        raise RequestError(
            400, f"{name} must be a list of at most {MAX_UNREACHABLE} member ids, got {value!r:.200}", field=name
        )
    peers = tuple(parse_member(peer, name) for peer in value)
    if len(set(peers)) != len(peers) or member in peers:
        raise RequestError(
            400, f"{name} must name distinct members other than the sender {member!r}, got {value!r:.200}", field=name
        )
    return peers


# --- what the lighthouse answers -------------------------------------------------------------------------------


class StaleAnswer(StalwartError, ValueError):
    """A wire-2 answer's delta does not apply to the answer the member holds: ask again for the whole answer."""


@dataclass(frozen=True)
class StoreAddress:
    """Where and how the quorum's processes reach its store: the lighthouse's URL, the quorum, the store's key.

    The key is told only in quorum answers (and relayed to a replica group's
    other processes); every store request carries it with the bearer token.
    """

    url: str
    quorum_id: int
    key: str

    def __repr__(self) -> str:  # the key is a credential: never in a log line
        return f"StoreAddress(url={self.url!r}, quorum_id={self.quorum_id}, key=...)"


@dataclass(frozen=True)
class CheckpointAnnouncement:
    """A durable checkpoint the quorum resumes from: its step, where it lies and its ledger's digest."""

    step: int
    path: str
    digest: str

    def to_json(self) -> dict[str, Any]:
        """The answer's ``heal.checkpoint``."""
        return {"step": self.step, "path": self.path, "digest": self.digest}

    @classmethod
    def from_json(cls, data: Any) -> CheckpointAnnouncement:
        """Inverse of ``to_json``."""
        return cls(int(data["step"]), str(data["path"]), str(data["digest"]))


@dataclass(frozen=True)
class HealPlan:
    """Who is behind and where their state comes from.

    ``source_rank``: the member that broadcasts it; ``checkpoint``: load it
    from that checkpoint instead (no live member held the job's state); both
    None: the state is lost.
    """

    source_rank: int | None
    targets: tuple[str, ...]
    checkpoint: CheckpointAnnouncement | None = None

    def to_json(self) -> dict[str, Any]:
        """The answer's ``heal``."""
        return {
            "source_rank": self.source_rank,
            "targets": list(self.targets),
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any) -> HealPlan:
        """Inverse of ``to_json``."""
        checkpoint = data.get("checkpoint")
        return cls(
            None if data["source_rank"] is None else int(data["source_rank"]),
            tuple(str(member) for member in data["targets"]),
            None if checkpoint is None else CheckpointAnnouncement.from_json(checkpoint),
        )


@dataclass(frozen=True)
class QuorumAnswer:
    """The lighthouse's answer to ``POST /v1/quorum`` (see ``docs/protocol.md``)."""

    quorum_id: int
    members: tuple[str, ...]
    rank: int
    world_size: int
    store: StoreAddress
    applied_step: int
    heal: HealPlan | None
    ledger: dict[str, Any]

    @classmethod
    def from_json(cls, data: Any, previous: QuorumAnswer | None = None, *, url: str | None = None) -> QuorumAnswer:
        """Build from the decoded JSON answer, of either wire (``docs/protocol.md``); ``ValueError`` when it is not
        well formed.

        ``url``: the lighthouse's, where the quorum's store is (a relayed
        answer names it itself). A wire-2 answer carries the ledger as the
        committed ledger plus the step's events, rebuilt here and checked
        against its digest; its members may come as a delta from ``previous``
        (the answer the member holds): :class:`StaleAnswer` when that delta or
        digest does not fit it.
        """
        try:
            store = data["store"]
            heal = data["heal"]
            members = cls._members(data, previous)
            quorum_id = int(data["quorum_id"])
            answer = cls(
                quorum_id=quorum_id,
                members=members,
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                store=StoreAddress(str(store.get("url") or url), quorum_id, str(store["key"])),
                applied_step=int(data["applied_step"]),
                heal=None if heal is None else HealPlan.from_json(heal),
                ledger=cls._ledger(data, members, previous),
            )
        except StaleAnswer:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"malformed quorum answer {_without_key(data)!r:.2000}: {error}") from error
        if answer.store.url in ("", "None") or int(store.get("quorum_id", quorum_id)) != quorum_id:
            raise ValueError("malformed quorum answer: its store names no lighthouse URL or another quorum")
        if answer.world_size != len(answer.members) or not 0 <= answer.rank < answer.world_size:
            raise ValueError(f"malformed quorum answer: rank {answer.rank} of members {list(answer.members)}")
        return answer

    @staticmethod
    def _members(data: Any, previous: QuorumAnswer | None) -> tuple[str, ...]:
        if "delta" not in data:
            return tuple(str(member) for member in data["members"])
        delta = data["delta"]
        if previous is None or previous.quorum_id != int(delta["from"]):
            held = None if previous is None else previous.quorum_id
            raise StaleAnswer(f"the answer is a delta from quorum {delta['from']}, but this member holds {held}")
        change = MemberDelta(int(delta["from"]), tuple(delta["removed"]), tuple(delta["added"]), False)
        return change.apply(previous.members)

    @staticmethod
    def _ledger(data: Any, members: tuple[str, ...], previous: QuorumAnswer | None) -> dict[str, Any]:
        """The ledger in the answer's step: as sent (wire 1), or rebuilt and checked against its digest (wire 2)."""
        ledger = data["ledger"]
        if "base" not in ledger:
            return dict(ledger)
        begun_by = ledger["begun_by"]
        if begun_by == "members":
            begun_by = members
        elif begun_by == "from":
            if previous is None:
                raise StaleAnswer("the answer's step began with the members of a quorum this member does not hold")
            begun_by = previous.members
        rebuilt = step_ledger(ledger["base"], begun_by, ledger["failed"])
        if rebuilt.binary_digest() != ledger["digest"]:
            error = StaleAnswer if "delta" in data else ValueError
            raise error(f"the ledger rebuilt from the answer does not match its digest {ledger['digest']}")
        return rebuilt.state_dict()

    @property
    def member(self) -> str:
        """The member this answer was for."""
        return self.members[self.rank]

    def data_ledger(self) -> DataLedger:
        """The ledger in step ``applied_step``, as the lighthouse holds it."""
        return DataLedger.from_state_dict(self.ledger)


def _without_key(data: Any) -> Any:
    """``data`` with a store key blanked, for error messages."""
    if isinstance(data, Mapping) and isinstance(data.get("store"), Mapping) and "key" in data["store"]:
        return {**data, "store": {**data["store"], "key": "..."}}
    return data


# --- the quorum store ------------------------------------------------------------------------------------------

STORE_OPS = ("set", "get", "add", "compare_set", "check", "wait", "delete", "num_keys", "append", "multi_get")
MAX_STORE_KEY_CHARS = 1024
MAX_STORE_KEYS_PER_REQUEST = 4096
MAX_STORE_WAIT_S = 5.0
"""Longest a store request waits for keys on the lighthouse; the client asks again until its own timeout."""
_STORE_FIELDS = {
    "set": {"key", "value"},
    "get": {"key", "wait"},
    "add": {"key", "amount"},
    "compare_set": {"key", "expected", "desired"},
    "check": {"keys"},
    "wait": {"keys", "wait"},
    "delete": {"key"},
    "num_keys": set(),
    "append": {"key", "value"},
    "multi_get": {"keys", "wait"},
}


@dataclass(frozen=True)
class StoreRequest:
    """One store operation: ``op`` on ``keys`` (one for the single-key ops), with its values, amount and wait.

    On the wire: ``{"op", "key" | "keys", "value" | "expected" + "desired" (base64), "amount", "wait"}``.
    """

    op: str
    keys: tuple[str, ...] = ()
    values: tuple[bytes, ...] = ()
    amount: int = 0
    wait: float = 0.0

    def to_body(self) -> dict[str, Any]:
        """The JSON body a client sends."""
        body: dict[str, Any] = {"op": self.op}
        names = _STORE_FIELDS[self.op]
        if "key" in names:
            body["key"] = self.keys[0]
        if "keys" in names:
            body["keys"] = list(self.keys)
        if "value" in names:
            body["value"] = _b64(self.values[0])
        if "expected" in names:
            body["expected"], body["desired"] = _b64(self.values[0]), _b64(self.values[1])
        if "amount" in names:
            body["amount"] = self.amount
        if "wait" in names:
            body["wait"] = self.wait
        return body

    @classmethod
    def from_json(cls, body: Any, max_value_bytes: int) -> StoreRequest:
        """Validate a decoded body; ``RequestError`` 400 names the bad field, 413 a value over ``max_value_bytes``."""
        if not isinstance(body, Mapping) or body.get("op") not in STORE_OPS:
            raise RequestError(400, f"a store request must be an object with op one of {list(STORE_OPS)}", field="op")
        op = body["op"]
        expected = _STORE_FIELDS[op] | {"op"}
        if set(body) != expected:
            raise RequestError(400, f"store op {op!r} takes exactly the fields {sorted(expected)}", field="op")
        if "key" in body:
            keys: tuple[str, ...] = (_store_key(body["key"]),)
        elif "keys" in body:
            raw = body["keys"]
            if not isinstance(raw, list) or not 0 < len(raw) <= MAX_STORE_KEYS_PER_REQUEST:
                raise RequestError(400, f"keys must be a list of 1-{MAX_STORE_KEYS_PER_REQUEST} keys", field="keys")
            keys = tuple(_store_key(key) for key in raw)
        else:
            keys = ()
        names = [name for name in ("value", "expected", "desired") if name in body]
        values = tuple(_unb64(body[name], name, max_value_bytes) for name in names)
        amount = body.get("amount", 0)
        if isinstance(amount, bool) or not isinstance(amount, int) or abs(amount) > 1 << 62:
            raise RequestError(
                400, f"amount must be an int of magnitude at most 2^62, got {amount!r:.40}", field="amount"
            )
        wait = body.get("wait", 0.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_STORE_WAIT_S:
            raise RequestError(400, f"wait must be a number of seconds in [0, {MAX_STORE_WAIT_S}]", field="wait")
        return cls(op, keys, values, amount, float(wait))


def _store_key(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_STORE_KEY_CHARS:
        raise RequestError(400, f"a store key must be a string of 1-{MAX_STORE_KEY_CHARS} characters", field="key")
    return value


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _unb64(value: Any, name: str, limit: int) -> bytes:
    if not isinstance(value, str):
        raise RequestError(400, f"{name} must be base64 text", field=name)
    if len(value) > 4 * math.ceil(limit / 3):
        raise RequestError(413, f"{name} is over the store's limit of {limit} bytes per value", field=name)
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise RequestError(400, f"{name} must be base64 text", field=name) from None


def store_value(data: Any, name: str = "value") -> bytes | None:
    """A store answer's base64 value (None when absent): the client's side of :class:`StoreRequest`."""
    raw = data.get(name) if isinstance(data, Mapping) else None
    return None if raw is None else base64.b64decode(raw)


def store_answer_values(values: Sequence[bytes | None]) -> list[str | None]:
    """Values as a store answer carries them (base64, or None for a key that is not there)."""
    return [None if value is None else _b64(value) for value in values]
