"""Incarnations and secrets over real HTTP: replacing a live member needs its secret, caps, re-registration."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from stalwart.coord.client import LighthouseClient, LighthouseError
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=2)


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_new_incarnation_of_a_live_member_needs_its_secret_or_waits_until_it_is_dead() -> None:
    # join_timeout bounds the first quorum's wait for both live members to ask (on a busy machine one ask can come
    # seconds after the other; a short one left b out); the failure quorum at the end forms at once. Both are live
    # before either asks: a quorum asked for before b registered would form around a alone and leave b waiting.
    with Lighthouse(PLAN, heartbeat_timeout=5.0, join_timeout=60.0) as server:
        clients = {m: LighthouseClient(server.url, m, heartbeat_interval=0.05) for m in ("a", "b")}
        try:
            for client in clients.values():
                client.start_heartbeat(lambda: 0)
            for client in clients.values():
                wait_until(client.heartbeat_connected.is_set, what=f"{client.member}'s heartbeat")
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda c: c.quorum(0, None, "join", 60), clients.values()))
            assert answers[0].members == answers[1].members
            old = clients["b"]
            assert old.heartbeat_connected.is_set()
            status, body = post(server.url + "/v1/register", {"member": "b", "incarnation": uuid.uuid4().hex})
            assert status == 409 and body["code"] == "member_alive" and 0 <= body["retry_after"] <= 5, body
            assert server.status()["failures"] == [] and not clients["a"].quorum_broken, "the live member stays"
            forged = {"X-Stalwart-Incarnation": old.incarnation, "X-Stalwart-Secret": "x" * 43}
            status, body = post(server.url + "/v1/register", {"member": "b", "incarnation": uuid.uuid4().hex}, forged)
            assert status == 403 and server.status()["failures"] == []
            incarnation = uuid.uuid4().hex
            status, body = post(
                server.url + "/v1/register", {"member": "b", "incarnation": incarnation}, old.identity_headers()
            )
            assert status == 200, "the live incarnation's own headers replace it at once"
            wait_until(lambda: clients["a"].quorum_broken, what="the broken-quorum push to the survivor")
            assert clients["a"].quorum_down == ("b",), "the push names the member replaced"
            status_now = server.status()
            assert [(f["member"], f["reason"]) for f in status_now["failures"]] == [("b", "restarted")]
            with pytest.raises(LighthouseError) as refused:
                old.quorum(0, 1, "failure", 5)
            assert refused.value.status in (403, 409) and refused.value.body["code"] == "superseded"
            assert clients["a"].quorum(0, 1, "failure", 20).members == ("a",)
        finally:
            for client in clients.values():
                client.close()


def test_a_restarted_process_registers_once_its_old_one_is_dead_by_heartbeat() -> None:
    with Lighthouse(PLAN, heartbeat_timeout=1.0, join_timeout=1.0) as server:
        old = LighthouseClient(server.url, "b", heartbeat_interval=0.05)
        replacement = LighthouseClient(server.url, "b", heartbeat_interval=0.05, register_timeout=60)
        try:
            old.start_heartbeat(lambda: 0)
            wait_until(old.heartbeat_connected.is_set, what="the old process's heartbeat")
            with ThreadPoolExecutor(1) as pool:
                registering = pool.submit(replacement.identity_headers)
                wait_until(lambda: server.status()["members"][0]["connected"], what="the old member alive")
                assert not registering.done(), "the replacement waits while the old process heartbeats"
                old.close()  # the old process dies: its socket closes
                headers = registering.result(timeout=60)
            assert headers["X-Stalwart-Incarnation"] == replacement.incarnation
            assert [f["reason"] for f in server.status()["failures"]] == ["socket closed"]
        finally:
            old.close()
            replacement.close()


def test_the_client_registers_again_with_a_lighthouse_restarted_without_state() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Lighthouse(PLAN, port=port, heartbeat_timeout=2.0, join_timeout=0.5)
    server.start()
    with LighthouseClient(server.url, "a", heartbeat_interval=0.05) as client:
        try:
            client.start_heartbeat(lambda: 0)
            assert client.quorum(0, None, "join", 20).quorum_id == 1
        finally:
            server.stop()
        wait_until(lambda: not client.heartbeat_connected.is_set(), what="the socket to drop")
        with Lighthouse(PLAN, port=port, heartbeat_timeout=2.0, join_timeout=0.5) as fresh:
            wait_until(client.heartbeat_connected.is_set, what="the heartbeat to register again and reconnect")
            assert client.quorum(0, None, "join", 20).quorum_id == 1
            assert fresh.status()["members"][0]["connected"]


def test_max_waiters_refuses_more_pending_quorum_requests_naming_the_cap() -> None:
    options: dict[str, Any] = {"min_replicas": 3, "heartbeat_timeout": 5.0, "join_timeout": 5.0, "max_waiters": 1}
    with (
        Lighthouse(PLAN, **options) as server,
        LighthouseClient(server.url, "a", heartbeat_interval=0.05) as first,
        ThreadPoolExecutor(1) as pool,
    ):
        first.start_heartbeat(lambda: 0)
        waiting = pool.submit(first.quorum, 0, None, "join", 3)
        wait_until(lambda: any(m["asking"] for m in server.status()["members"]), what="a pending request")
        incarnation = uuid.uuid4().hex
        status, body = post(server.url + "/v1/register", {"member": "b", "incarnation": incarnation})
        headers = {"X-Stalwart-Incarnation": incarnation, "X-Stalwart-Secret": body["secret"]}
        request = {"member": "b", "applied_step": 0, "quorum_id": None, "reason": "join"}
        status, body = post(server.url + "/v1/quorum", request, headers)
        assert status == 503 and "max_waiters=1" in body["error"] and body["cap"] == "max_waiters"
        with pytest.raises(TimeoutError):
            waiting.result(timeout=30)
