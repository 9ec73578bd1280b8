"""Fuzz every lighthouse route and heartbeat message: refused with a 4xx JSON error, never a 5xx, state unchanged.

One token-protected lighthouse per module, with two members (``m-alpha`` and
``m-beta``, real :class:`LighthouseClient` heartbeats) that formed quorum 1 and
committed step 1, a ``probe`` member for raw websockets and a member with a
replaced (retired) incarnation. Every generated request is built to be refused:
each answer must be a 4xx whose JSON body has an ``"error"`` string, and the
lighthouse's state (``state_dict``, revision and ``/status`` without clocks)
must be the same before and after.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import string
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.coord.client import LighthouseClient
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.protocol import ASK_PREFIX, ask_message
from stalwart.coord.server import MAX_BODY_BYTES, Lighthouse
from stalwart.coord.wire import MAX_WIRE_INT
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(200, 16, seed=7)
TOKEN = "fuzz-token-7"
MEMBERS = ("m-alpha", "m-beta")
INCARNATION = "X-Stalwart-Incarnation"
SECRET = "X-Stalwart-Secret"
MEMBER_PATTERN = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
HEX32 = re.compile(r"[0-9a-f]{32}")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every route the lighthouse serves: a route added to server.py fails
# test_the_fuzzed_routes_are_all_the_routes until it is listed (and fuzzed) here.
GET_ROUTES = ("/healthz", "/status", "/v1/status", "/v1/heartbeat")
POST_ROUTES = ("/v1/register", "/v1/quorum", "/v1/leave", "/v1/checkpoint", "/v1/reach")
DASHBOARD_ROUTES = ("/", "/v1/events", "/metrics")
"""The dashboard's routes (HTML, an endless event stream, Prometheus text): fuzzed on their own."""
STORE_ROUTE = "/v1/store/{quorum_id}"
"""The quorum store: fuzzed on its own (its credential is the store key)."""


@dataclass
class World:
    lighthouse: Lighthouse
    clients: dict[str, LighthouseClient]
    headers: dict[str, dict[str, str]]
    """Identity headers of m-alpha, m-beta and probe."""
    retired: dict[str, str]
    """Identity headers of the replaced incarnation of ``m-retired`` (its old secret)."""
    store_key: str
    """Quorum 1's store key (told to m-alpha and m-beta)."""

    @property
    def port(self) -> int:
        return self.lighthouse.port


def raw_request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One HTTP request with exactly these bytes and headers; returns (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def register(port: int, member: str, replacing: dict[str, str] | None = None) -> dict[str, str]:
    """A new incarnation of ``member`` (``replacing``: the live one's identity headers); its identity headers."""
    incarnation = uuid.uuid4().hex
    body = json.dumps({"member": member, "incarnation": incarnation}).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", **(replacing or {})}
    status, answer = raw_request(port, "POST", "/v1/register", body, headers)
    assert status == 200, answer
    return {INCARNATION: incarnation, SECRET: json.loads(answer)["secret"]}


def read_state(lighthouse: Lighthouse) -> dict[str, Any]:
    """Everything a refused request must not change: the state dict, its revision and /status without clocks."""

    async def read() -> dict[str, Any]:
        return {"revision": lighthouse.state.revision, "state": lighthouse.state.state_dict()}

    loop = lighthouse._loop  # private on purpose: the state is read on the server's own loop, between requests
    assert loop is not None
    snapshot = asyncio.run_coroutine_threadsafe(read(), loop).result(10)
    status = lighthouse.status()
    for member in status["members"]:
        del member["last_seen"], member["seconds_since_seen"]
    snapshot["status"] = status
    return snapshot


def settle(lighthouse: Lighthouse) -> dict[str, Any]:
    """Wait until only m-alpha and m-beta are alive, m-beta's heal is over and the state stops changing; returns it.

    Two equal reads alone are not enough: on a busy machine m-beta's heal of quorum 1 can end (its heartbeat
    clears ``healing``) after them, in the middle of a request the test says changed nothing.
    """

    def quiet() -> dict[str, Any] | None:
        first = read_state(lighthouse)
        alive = sorted(m["member"] for m in first["status"]["members"] if m["state"] == "alive")
        if alive != sorted(MEMBERS) or first["state"]["healing"]:  # /status's per-member "healing" reads this dict
            return None
        return first if read_state(lighthouse) == first else None

    return wait_until(quiet, timeout=20, what="a quiet lighthouse")


def check_refused(status: int, body: bytes, what: object) -> None:
    """A refused request: a 4xx (never a 5xx, never accepted) with a JSON error body."""
    assert 400 <= status < 500, (status, body[:300], what)
    answer = json.loads(body)
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str) and answer["error"], answer


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    # heartbeat_timeout: far above any stall of a busy machine, so no member dies while a refusal is checked
    lighthouse = Lighthouse(PLAN, min_replicas=2, token=TOKEN, heartbeat_timeout=60.0, join_timeout=3.0)
    lighthouse.start()
    clients = {m: LighthouseClient(lighthouse.url, m, token=TOKEN, heartbeat_interval=0.05) for m in MEMBERS}
    try:
        for member, client in clients.items():
            client.start_heartbeat(lambda member=member: report(member, 1))
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = [pool.submit(c.quorum, 0, None, "join", 30) for c in clients.values()]
            answers = [remember(f.result(timeout=40)) for f in futures]
        assert {a.quorum_id for a in answers} == {1}
        wait_until(lambda: lighthouse.status()["ledger"]["step"] == 1, what="step 1 committed")
        headers = {m: {k: c.identity_headers()[k] for k in (INCARNATION, SECRET)} for m, c in clients.items()}
        headers["probe"] = register(lighthouse.port, "probe")
        retired = register(lighthouse.port, "m-retired")
        register(lighthouse.port, "m-retired", retired)
        settle(lighthouse)
        yield World(lighthouse, clients, headers, retired, answers[0].store.key)
    finally:
        for client in clients.values():
            client.close()
        lighthouse.stop()


# --- generated values ------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
huge_ints = st.integers(min_value=2**31) | st.integers(min_value=2**63, max_value=2**200)
negative_ints = st.integers(max_value=-1) | st.integers(min_value=-(2**200), max_value=-(2**63))
not_an_int = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
)
bad_member_text = st.text(max_size=140).filter(lambda s: not MEMBER_PATTERN.fullmatch(s))
bad_member = bad_member_text | st.sampled_from(["", " ", "m alpha", "é", "成员", "a" * 129, "m-alpha\n"]) | not_an_int
bad_hex = (st.text(max_size=40) | st.text("0123456789abcdefABCDEF", min_size=31, max_size=33)).filter(
    lambda s: not HEX32.fullmatch(s)
)
bad_digest = bad_hex.filter(bool) | st.integers() | st.booleans() | st.lists(st.integers(), max_size=2)
bad_incarnation = bad_hex | st.none() | st.integers() | st.booleans() | st.lists(st.text(max_size=3), max_size=2)
bad_reason = json_values.filter(lambda v: v not in ("join", "failure", "reconfigure"))
unknown_key = st.text(min_size=1, max_size=12).filter(
    lambda k: k not in {"member", "applied_step", "quorum_id", "reason", "digest", "incarnation", "plan"}
)
header_text = st.text(string.ascii_letters + string.digits + string.punctuation + " ", max_size=60)


def _committed_ledger() -> dict[str, Any]:
    """The ledger the lighthouse commits at step 1 for quorum 1 of m-alpha and m-beta (a valid checkpoint's)."""
    ledger = DataLedger(PLAN)
    ledger.begin_step(list(MEMBERS))
    ledger.commit()
    return ledger.state_dict()


LEDGER = _committed_ledger()
LEDGER_DIGEST = ledger_digest(LEDGER)


def bad_ledgers() -> st.SearchStrategy[Any]:
    """A checkpoint's ledger with one entry changed (wrong types, huge or negative numbers), dropped, or junk."""
    changed = st.tuples(st.sampled_from(sorted(LEDGER)), json_values | huge_ints | negative_ints).map(
        lambda kv: {**LEDGER, kv[0]: kv[1]}
    )
    dropped = st.sampled_from(sorted(LEDGER)).map(lambda k: {n: v for n, v in LEDGER.items() if n != k})
    plan = st.tuples(st.sampled_from(sorted(LEDGER["plan"])), json_values | huge_ints | negative_ints).map(
        lambda kv: {**LEDGER, "plan": {**LEDGER["plan"], kv[0]: kv[1]}}
    )
    return (changed | dropped | plan | json_values).filter(lambda v: v != LEDGER)


def bad_plans() -> st.SearchStrategy[Any]:
    """A registration's plan with a field changed (to garbage, or to another valid value: a mismatch), a field
    dropped or added, or not an object."""
    offered = PLAN.to_dict()
    changed = st.tuples(st.sampled_from(sorted(offered)), json_values | huge_ints | negative_ints).map(
        lambda kv: {**offered, kv[0]: kv[1]}
    )
    other = st.sampled_from(
        [{**offered, "dataset_size": 201}, {**offered, "global_batch_size": 8}, {**offered, "seed": 8}]
    )
    dropped = st.sampled_from(sorted(offered)).map(lambda k: {n: v for n, v in offered.items() if n != k})
    added = unknown_key.map(lambda k: {**offered, k: 1})
    plans = changed | other | dropped | added | json_values.filter(lambda v: v is not None)
    return plans.filter(lambda v: not (isinstance(v, dict) and v.items() == offered.items()))


# Per POST route: a valid body (never sent as is) and, per field, values its parser refuses.
TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/register": {"member": "m-new", "incarnation": "0" * 32, "plan": PLAN.to_dict()},
    "/v1/quorum": {"member": "m-alpha", "applied_step": 1, "quorum_id": 1, "reason": "failure", "digest": None},
    "/v1/leave": {"member": "m-alpha", "applied_step": 1, "digest": None},
    "/v1/checkpoint": {"member": "m-alpha", "step": 1, "path": "/ckpt/1", "ledger": LEDGER, "digest": LEDGER_DIGEST},
    "/v1/reach": {"member": "m-alpha", "reached": ["m-beta"]},
}
BAD_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/register": {"member": bad_member, "incarnation": bad_incarnation, "plan": bad_plans()},
    "/v1/quorum": {
        "member": bad_member,
        "applied_step": not_an_int | negative_ints,
        "quorum_id": not_an_int.filter(lambda v: v is not None) | negative_ints,
        "reason": bad_reason,
        "digest": bad_digest,
    },
    "/v1/leave": {"member": bad_member, "applied_step": not_an_int | negative_ints, "digest": bad_digest},
    "/v1/checkpoint": {
        "member": bad_member,
        "step": not_an_int | negative_ints | huge_ints,
        "path": not_an_int.filter(lambda v: not isinstance(v, str)) | st.sampled_from(["", "p" * 4097]),
        "ledger": bad_ledgers(),
        "digest": bad_digest.filter(lambda d: d != LEDGER_DIGEST),
    },
    "/v1/reach": {
        "reached": not_an_int.filter(lambda v: not isinstance(v, list))
        | st.lists(bad_member, min_size=1, max_size=3)
        | st.sampled_from([["m-alpha"], ["m-beta", "m-beta"], [f"m-{i}" for i in range(4097)]]),
        "member": bad_member,
    },
}
REQUIRED = {
    "/v1/register": ("member", "incarnation"),
    "/v1/quorum": ("member", "applied_step", "reason"),
    "/v1/checkpoint": ("member", "step", "path", "ledger", "digest"),
    "/v1/reach": ("member", "reached"),
}


@st.composite
def bad_bodies(draw: st.DrawFn, path: str) -> bytes:
    """A body the route's parser refuses: a bad field, a missing or unknown field, another shape, not JSON."""
    body = dict(TEMPLATES[path])
    kind = draw(st.sampled_from(["field", "field", "field", "missing", "unknown", "shape", "bytes", "huge"]))
    if kind == "field":
        field = draw(st.sampled_from(sorted(BAD_FIELDS[path])))
        body[field] = draw(BAD_FIELDS[path][field])
    elif kind == "missing":
        del body[draw(st.sampled_from(REQUIRED.get(path, ("member",))))]
    elif kind == "unknown":
        body[draw(unknown_key)] = draw(json_values)
    elif kind == "shape":
        return json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)) | st.just([body]))).encode()
    elif kind == "bytes":
        return draw(st.binary(max_size=200) | st.sampled_from([b"", b"{", b"[" * 5000, b"1" * 5000, b"\xff\xfe{}"]))
    else:
        return json.dumps({**body, "pad": "x" * (MAX_BODY_BYTES + draw(st.integers(0, 1000)))}).encode()
    return json.dumps(body).encode()


@st.composite
def identities(draw: st.DrawFn, world: World) -> dict[str, str]:
    """Identity headers: none, partial, wrong, another member's, retired, random, or m-alpha's own."""
    alpha, beta = world.headers["m-alpha"], world.headers["m-beta"]
    choice = draw(st.sampled_from(["none", "incarnation", "secret", "wrong", "other", "retired", "random", "own"]))
    if choice == "none":
        return {}
    if choice == "incarnation":
        return {INCARNATION: alpha[INCARNATION]}
    if choice == "secret":
        return {SECRET: alpha[SECRET]}
    if choice == "wrong":
        return {INCARNATION: alpha[INCARNATION], SECRET: draw(header_text.filter(lambda s: s != alpha[SECRET]))}
    if choice == "other":
        return beta
    if choice == "retired":
        return world.retired
    if choice == "random":
        return {INCARNATION: draw(header_text), SECRET: draw(header_text)}
    return alpha


def tokens() -> st.SearchStrategy[dict[str, str]]:
    """The Authorization header: right (most often), missing, wrong."""
    wrong = header_text.filter(lambda s: s.strip() != TOKEN).map(lambda s: {"Authorization": f"Bearer {s}"})
    right = st.just({"Authorization": f"Bearer {TOKEN}"})
    return right | right | st.just({}) | wrong | st.just({"Authorization": TOKEN})


content_types = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=utf-8",
        "text/plain; charset=latin-1",
        "application/json; charset=utf-16",
        "text/plain; charset=",
    ]
)


# --- tests -----------------------------------------------------------------------------------------


def test_the_fuzzed_routes_are_all_the_routes(world: World) -> None:
    runner = world.lighthouse._runner  # private on purpose: the routes the server really serves
    assert runner is not None
    served = {(r.method, r.resource.canonical) for r in runner.app.router.routes() if r.method != "HEAD"}
    fuzzed = {("GET", p) for p in (*GET_ROUTES, *DASHBOARD_ROUTES)} | {("POST", p) for p in (*POST_ROUTES, STORE_ROUTE)}
    assert served == fuzzed, "a route was added or removed: list it in GET_ROUTES/POST_ROUTES and fuzz it"
    assert set(TEMPLATES) == set(POST_ROUTES) == set(BAD_FIELDS)


def test_check_refused_fails_a_5xx_a_2xx_and_an_error_body_without_error() -> None:
    check_refused(400, b'{"error": "bad"}', "ok")
    for status, body in [(500, b'{"error": "x"}'), (200, b'{"error": "x"}'), (400, b'{"ok": 1}'), (404, b"<html>")]:
        with pytest.raises((AssertionError, ValueError)):
            check_refused(status, body, "must fail")


@FUZZ
@given(data=st.data(), path=st.sampled_from(POST_ROUTES), content_type=content_types)
def test_bad_post_bodies_are_refused_and_change_nothing(
    world: World, data: st.DataObject, path: str, content_type: str | None
) -> None:
    body = data.draw(bad_bodies(path), label="body")
    headers = {**data.draw(tokens(), label="token"), **data.draw(identities(world), label="identity")}
    if content_type is not None:
        headers["Content-Type"] = content_type
    before = read_state(world.lighthouse)
    status, answer = raw_request(world.port, "POST", path, body, headers)
    check_refused(status, answer, (path, body[:200], headers))
    assert read_state(world.lighthouse) == before, (path, body[:200], status, answer[:200])


def test_a_body_in_an_unknown_charset_is_refused_with_a_4xx(world: World) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json; charset=no-such-codec"}
    for path in POST_ROUTES:
        before = read_state(world.lighthouse)
        status, answer = raw_request(world.port, "POST", path, b'{"member": "m-alpha"}', headers)
        check_refused(status, answer, path)
        assert read_state(world.lighthouse) == before


@FUZZ
@given(data=st.data(), path=st.sampled_from(["/v1/quorum", "/v1/leave"]))
def test_well_formed_bodies_with_a_wrong_token_or_identity_are_refused(
    world: World, data: st.DataObject, path: str
) -> None:
    """Valid bodies for m-alpha, without its token or identity; with a step past 2**62 the body is malformed
    instead (400 naming the field, once past the token check)."""
    body = dict(TEMPLATES[path])
    body["applied_step"] = data.draw(st.integers(0, 3) | huge_ints, label="applied_step")
    if path == "/v1/quorum":
        body["quorum_id"] = data.draw(st.integers(0, 3) | huge_ints, label="quorum_id")
    token = data.draw(tokens(), label="token")
    identity = data.draw(identities(world), label="identity")
    if token == {"Authorization": f"Bearer {TOKEN}"} and identity == world.headers["m-alpha"]:
        identity = world.headers["m-beta"]
    before = read_state(world.lighthouse)
    status, answer = raw_request(world.port, "POST", path, json.dumps(body).encode(), {**token, **identity})
    check_refused(status, answer, (path, body, token, identity))
    too_large = [name for name in ("applied_step", "quorum_id") if body.get(name, 0) > MAX_WIRE_INT]
    if too_large and token == {"Authorization": f"Bearer {TOKEN}"}:  # past the token check, the body is read
        assert status == 400 and json.loads(answer)["field"] in too_large, answer
    else:
        assert status in (401, 403), answer
    assert read_state(world.lighthouse) == before


def store_keys(lighthouse: Lighthouse) -> int:
    return int(lighthouse.status()["store"]["keys"])


@st.composite
def store_requests(draw: st.DrawFn, world: World) -> tuple[str, dict[str, str], bytes]:
    """A store request that must be refused: a bad quorum, a missing or wrong key or token, or a bad body."""
    key = {"X-Stalwart-Store-Key": world.store_key}
    valid = json.dumps({"op": "set", "key": "fuzz", "value": "AA=="}).encode()
    kind = draw(st.sampled_from(["quorum", "key", "token", "body", "body", "body"]))
    if kind == "quorum":
        quorum = draw(st.sampled_from(["0", "2", "99", "-1", "x", "1" * 30, "%EF%BC%91", "1%20"]))
        return f"/v1/store/{quorum}", {"Authorization": f"Bearer {TOKEN}", **key}, valid
    if kind == "key":
        wrong = draw(st.just({}) | header_text.filter(lambda s: s != world.store_key).map(
            lambda s: {"X-Stalwart-Store-Key": s}
        ))  # fmt: skip
        return "/v1/store/1", {"Authorization": f"Bearer {TOKEN}", **wrong}, valid
    if kind == "token":
        token = draw(tokens().filter(lambda t: t != {"Authorization": f"Bearer {TOKEN}"}))
        return "/v1/store/1", {**token, **key}, valid
    op = draw(st.sampled_from(["set", "get", "add", "compare_set", "check", "wait", "delete", "num_keys", "nope"]))
    body: Any = {"op": op, "key": "fuzz", "value": "AA==", "wait": 0}
    change = draw(st.sampled_from(["op", "key", "value", "wait", "extra", "shape", "bytes"]))
    if change == "op":
        body["op"] = draw(json_values.filter(lambda v: v not in ("set", "get")))
    elif change == "key":
        body["key"] = draw(not_an_int.filter(lambda v: not isinstance(v, str)) | st.just("") | st.just("k" * 1025))
    elif change == "value":
        body["value"] = draw(st.sampled_from(["***", "A", "Zm9v=", None, 7, ["AA=="]]))
    elif change == "wait":
        body["wait"] = draw(st.sampled_from([-1, 6, 1e9, "1", None, True]))
    elif change == "extra":
        body[draw(unknown_key)] = 1
    elif change == "shape":
        body = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    else:
        return "/v1/store/1", {"Authorization": f"Bearer {TOKEN}", **key}, draw(st.binary(max_size=100))
    return "/v1/store/1", {"Authorization": f"Bearer {TOKEN}", **key}, json.dumps(body).encode()


@FUZZ
@given(data=st.data())
def test_store_requests_without_the_credentials_or_well_formed_bodies_are_refused(
    world: World, data: st.DataObject
) -> None:
    path, headers, body = data.draw(store_requests(world), label="request")
    before, keys = read_state(world.lighthouse), store_keys(world.lighthouse)
    status, answer = raw_request(world.port, "POST", path, body, headers)
    check_refused(status, answer, (path, headers, body[:200]))
    assert read_state(world.lighthouse) == before and store_keys(world.lighthouse) == keys


@FUZZ
@given(
    applied_step=st.integers(0, 3) | huge_ints,
    quorum_id=st.integers(2, 5) | huge_ints,
    reason=st.sampled_from(["join", "failure", "reconfigure"]),
)
def test_impossible_steps_and_quorums_from_a_real_member_are_refused(
    world: World, applied_step: int, quorum_id: int, reason: str
) -> None:
    """Huge steps and unknown quorum ids with m-alpha's own identity: refused (4xx), nothing changes."""
    body = {"member": "m-alpha", "applied_step": applied_step, "quorum_id": quorum_id, "reason": reason}
    if reason == "join":
        body["applied_step"] = applied_step + 10**6
    headers = {"Authorization": f"Bearer {TOKEN}", **world.headers["m-alpha"]}
    before = read_state(world.lighthouse)
    status, answer = raw_request(world.port, "POST", "/v1/quorum", json.dumps(body).encode(), headers)
    check_refused(status, answer, body)
    assert read_state(world.lighthouse) == before


@FUZZ
@given(data=st.data())
def test_register_refuses_taken_retired_and_malformed_identities(world: World, data: st.DataObject) -> None:
    member = data.draw(st.sampled_from(["m-alpha", "m-beta", "probe", "m-retired"]), label="member")
    incarnations = {m: h[INCARNATION] for m, h in world.headers.items()}
    incarnation = data.draw(
        st.sampled_from([incarnations.get(member, world.retired[INCARNATION]), world.retired[INCARNATION]]),
        label="incarnation",
    )
    if member != "m-retired" and incarnation == world.retired[INCARNATION]:
        member = "m-retired"
    body = {"member": member, "incarnation": incarnation}
    before = read_state(world.lighthouse)
    token = {"Authorization": f"Bearer {TOKEN}"}
    status, answer = raw_request(world.port, "POST", "/v1/register", json.dumps(body).encode(), token)
    check_refused(status, answer, body)
    assert status == 409, answer
    assert read_state(world.lighthouse) == before


query_values = st.text(max_size=40) | st.sampled_from(["m-alpha", "probe", "", "a b", "成员"])


@FUZZ
@given(
    data=st.data(),
    path=st.sampled_from(GET_ROUTES),
    method=st.sampled_from(["GET", "GET", "PUT", "DELETE", "PATCH"]),
    query=st.dictionaries(st.sampled_from(["member", "x", "applied_step"]), query_values, max_size=2),
)
def test_get_routes_answer_2xx_or_4xx_and_refusals_change_nothing(
    world: World, data: st.DataObject, path: str, method: str, query: dict[str, str]
) -> None:
    headers = {**data.draw(tokens(), label="token"), **data.draw(identities(world), label="identity")}
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")
    before = read_state(world.lighthouse)
    body = b"{}" if method != "GET" else None
    status, answer = raw_request(world.port, method, target, body, headers)
    assert status < 500, (status, answer[:300], target, headers)
    if status >= 400:
        check_refused(status, answer, (method, target))
    else:
        assert method == "GET" and path != "/v1/heartbeat", (status, target)
        assert json.loads(answer)
    assert read_state(world.lighthouse) == before


dashboard_queries = st.dictionaries(
    st.sampled_from(["token", "interval", "x"]),
    query_values | st.sampled_from([TOKEN, "0.5", "1", "0", "nan", "-1", "1e9"]),
    max_size=2,
)
DASHBOARD_TYPES = {"/": "text/html", "/v1/events": "text/event-stream", "/metrics": "text/plain"}


@FUZZ
@given(
    data=st.data(),
    path=st.sampled_from(DASHBOARD_ROUTES),
    method=st.sampled_from(["GET", "GET", "PUT", "DELETE", "PATCH"]),
    query=dashboard_queries,
)
def test_dashboard_routes_answer_2xx_or_4xx_and_change_nothing(
    world: World, data: st.DataObject, path: str, method: str, query: dict[str, str]
) -> None:
    headers = data.draw(tokens(), label="token")
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")
    before = read_state(world.lighthouse)
    connection = http.client.HTTPConnection("127.0.0.1", world.port, timeout=20)
    try:
        connection.request(method, target, body=b"{}" if method != "GET" else None, headers=headers)
        response = connection.getresponse()
        status, content_type = response.status, response.getheader("Content-Type", "")
        answer = response.read1(4096) if status == 200 and path == "/v1/events" else response.read()
    finally:
        connection.close()  # an event stream never ends: the server notices the closed connection
    assert status < 500, (status, answer[:300], target, headers)
    if status >= 400:
        check_refused(status, answer, (method, target))
    else:
        assert method == "GET" and content_type.startswith(DASHBOARD_TYPES[path]), (status, target, content_type)
    assert read_state(world.lighthouse) == before


def bad_heartbeats() -> st.SearchStrategy[str | bytes]:
    """Heartbeat messages the parser refuses: not JSON, JSON of wrong shapes, bad digests, binary frames."""
    not_json = st.text(max_size=60).filter(lambda s: not _is_json(s))
    wrong_shape = json_values.filter(lambda v: not (isinstance(v, dict) and "applied_step" in v)).map(json.dumps)
    bad_step = (not_an_int | negative_ints).map(lambda v: json.dumps({"applied_step": v}))
    bad_digest_message = bad_digest.map(lambda d: json.dumps({"applied_step": 0, "digest": d}))
    extra = unknown_key.map(lambda k: json.dumps({"applied_step": 0, k: 1}))
    binary = st.binary(max_size=100)
    return not_json | wrong_shape | bad_step | bad_digest_message | extra | binary


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def _fuzz_socket(world: World, messages: list[str | bytes]) -> list[Any]:
    """Send ``messages`` on probe's heartbeat socket; returns the state before and after and the replies."""
    url = world.lighthouse.url + "/v1/heartbeat"
    headers = {"Authorization": f"Bearer {TOKEN}", **world.headers["probe"]}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, params={"member": "probe"}, headers=headers) as ws,
    ):
        probe = lambda: [m for m in world.lighthouse.status()["members"] if m["member"] == "probe"]  # noqa: E731
        await asyncio.to_thread(wait_until, lambda: probe()[0]["connected"], 10, "probe's socket")
        before = await asyncio.to_thread(read_state, world.lighthouse)
        replies = []
        for message in messages:
            await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_str(message))
            replies.append(await ws.receive(timeout=10))
        after = await asyncio.to_thread(read_state, world.lighthouse)
    return [before, after, replies]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(bad_heartbeats(), min_size=1, max_size=6))
def test_bad_heartbeat_messages_get_error_replies_and_change_nothing(world: World, messages: list) -> None:
    before, after, replies = asyncio.run(_fuzz_socket(world, messages))
    for message, reply in zip(messages, replies, strict=True):
        assert reply.type == aiohttp.WSMsgType.TEXT, (message, reply)
        answer = json.loads(reply.data)
        assert answer["type"] == "error" and isinstance(answer["error"], str), (message, answer)
    assert after == before, messages
    settle(world.lighthouse)


@st.composite
def bad_asks(draw: st.DrawFn) -> str:
    """Quorum requests on a heartbeat socket the lighthouse refuses: not JSON, another shape, a bad id, a request its
    parser refuses, or m-alpha's valid request on probe's socket."""
    kind = draw(st.sampled_from(["not_json", "shape", "id", "request", "request", "other_member"]))
    if kind == "not_json":
        return ASK_PREFIX + draw(st.text(max_size=60).filter(lambda s: not _is_json(ASK_PREFIX + s)))
    if kind == "shape":
        rest = draw(st.sampled_from([{}, {"request": TEMPLATES["/v1/quorum"], "pad": 1}, {"req": {}}]))
        return json.dumps({"ask": draw(st.integers(0, 9)), **rest}, separators=(",", ":"))
    if kind == "id":
        return ask_message(0, TEMPLATES["/v1/quorum"]).replace('"ask":0', f'"ask":{json.dumps(draw(not_an_int))}', 1)
    if kind == "other_member":
        return ask_message(draw(st.integers(0, 9)), TEMPLATES["/v1/quorum"])
    raw = draw(bad_bodies("/v1/quorum").filter(lambda b: len(b) < 3500))
    try:
        request = json.loads(raw)
    except ValueError:
        request = raw.decode(errors="replace")
    return ASK_PREFIX + f'{draw(st.integers(0, 9))},"request":{json.dumps(request)}}}'


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(bad_asks().filter(lambda m: len(m.encode()) <= 4096), min_size=1, max_size=4))
def test_bad_socket_asks_get_4xx_answers_and_change_nothing(world: World, messages: list[str]) -> None:
    before, after, replies = asyncio.run(_fuzz_socket(world, list(messages)))
    for message, reply in zip(messages, replies, strict=True):
        assert reply.type == aiohttp.WSMsgType.TEXT, (message, reply)
        answer = json.loads(reply.data)
        assert answer["type"] == "answer" and 400 <= answer["status"] < 500, (message, answer)
        assert isinstance(answer["body"]["error"], str), (message, answer)
    assert after == before, messages
    settle(world.lighthouse)


async def _oversized(world: World, message: str | bytes) -> tuple[aiohttp.WSMessage, int | None]:
    url = world.lighthouse.url + "/v1/heartbeat"
    headers = {"Authorization": f"Bearer {TOKEN}", **world.headers["probe"]}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, params={"member": "probe"}, headers=headers) as ws,
    ):
        await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_str(message))
        reply = await ws.receive(timeout=10)
        return reply, ws.close_code


@pytest.mark.parametrize(
    "message",
    [json.dumps({"applied_step": 0, "pad": "x" * 5000}), b"\x00" * 5000, "[" * 2040 + "]" * 2040],
    ids=["big-json", "big-binary", "deep-json"],
)
def test_oversized_heartbeats_close_the_socket_and_the_lighthouse_keeps_serving(world: World, message: Any) -> None:
    reply, code = asyncio.run(_oversized(world, message))
    if len(message) > 4096:
        assert reply.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), reply
        assert code in (1008, 1009), code
    else:
        assert reply.type == aiohttp.WSMsgType.TEXT and json.loads(reply.data)["type"] == "error", reply
    settle(world.lighthouse)
    assert raw_request(world.port, "GET", "/healthz") == (200, b'{"ok": true}')


def test_a_valid_member_still_works_after_the_fuzzing(world: World) -> None:
    status = world.lighthouse.status()
    assert status["quorum"]["quorum_id"] == 1 and sorted(status["quorum"]["members"]) == list(MEMBERS)
    assert all(c.heartbeat_connected.is_set() for c in world.clients.values())
    assert world.clients["m-alpha"].status()["ledger"]["step"] == 1

    async def heartbeat() -> list[Any]:
        url = world.lighthouse.url + "/v1/heartbeat"
        headers = {"Authorization": f"Bearer {TOKEN}", **world.headers["probe"]}
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(url, params={"member": "probe"}, headers=headers) as ws,
        ):
            await ws.send_str(json.dumps({"applied_step": 0}))
            try:  # no answer, or the push telling a member outside the quorum to join: never an error
                reply = json.loads((await ws.receive(timeout=0.3)).data)
                assert reply == {"type": "reconfigure", "quorum_id": 1, "left_out": True}, reply
            except asyncio.TimeoutError:
                pass
            return [m for m in world.lighthouse.status()["members"] if m["member"] == "probe"]

    [probe] = asyncio.run(heartbeat())
    assert probe["applied_step"] == 0 and probe["connected"]
