"""Quorum requests on the heartbeat socket against a real lighthouse: used while the socket is open, POST without it,
the same answers, and a socket that closes mid-ask frees its long poll."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stalwart.coord.client import LighthouseClient
from stalwart.coord.protocol import QuorumRequest, ask_message, identity_headers, register_body
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=3)


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=2, heartbeat_timeout=2.0, join_timeout=0.5)
    server.start()
    yield server
    server.stop()


def quorum_requests(lighthouse: Lighthouse) -> dict[str, float]:
    """``stalwart_quorum_requests_total`` by ``via``, read from ``/metrics``."""
    with urllib.request.urlopen(lighthouse.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["via"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "stalwart_quorum_requests_total"
    }


def test_a_client_asks_on_its_heartbeat_socket_and_one_without_a_socket_posts(lighthouse: Lighthouse) -> None:
    with (
        LighthouseClient(lighthouse.url, "a", heartbeat_interval=0.05) as with_socket,
        LighthouseClient(lighthouse.url, "b", heartbeat_interval=0.05) as without_socket,
    ):
        with_socket.start_heartbeat(lambda: 0)
        wait_until(with_socket.heartbeat_connected.is_set, 30, "a's heartbeat socket")
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda client: client.quorum(0, None, "join", 60), (with_socket, without_socket)))
        # ranks follow the order the two joins arrived in, which either may win
        assert {a.quorum_id for a in answers} == {1} and sorted(answers[0].members) == ["a", "b"]
        assert [a.member for a in answers] == ["a", "b"] and answers[0].members == answers[1].members
        assert answers[0].ledger == answers[1].ledger and answers[0].store.key == answers[1].store.key
        assert quorum_requests(lighthouse) == {"socket": 1.0, "post": 1.0}


async def _ask_then_close(lighthouse: Lighthouse) -> dict[str, Any]:
    """Register ``probe``, ask to join on its heartbeat socket, wait until the lighthouse holds the ask, close."""
    incarnation = uuid.uuid4().hex
    async with aiohttp.ClientSession() as session:
        async with session.post(lighthouse.url + "/v1/register", json=register_body("probe", incarnation, None)) as r:
            headers = identity_headers(incarnation, (await r.json())["secret"])
        url = lighthouse.url + "/v1/heartbeat"
        async with session.ws_connect(url, params={"member": "probe"}, headers=headers) as ws:
            await ws.send_str(json.dumps({"applied_step": 0}))
            request = QuorumRequest("probe", 0, None, "join").to_body()
            for ask_id in range(6):
                await ws.send_str(ask_message(ask_id, request))
            answers: dict[int, int] = {}
            while len(answers) < 5:
                reply = json.loads((await ws.receive(timeout=30)).data)
                if reply.get("type") == "answer":
                    assert reply["ask"] not in answers, reply
                    answers[reply["ask"]] = reply["status"]
            probe = lambda: [m for m in lighthouse.status()["members"] if m["member"] == "probe"]  # noqa: E731
            await asyncio.to_thread(wait_until, lambda: probe()[0]["asking"] == "join", 30, "probe's ask")
        return answers


async def _post_join(lighthouse: Lighthouse, member: str) -> tuple[int, Any]:
    """Register ``member`` and ask to join once by POST: the status and the JSON answer."""
    incarnation = uuid.uuid4().hex
    async with aiohttp.ClientSession() as session:
        async with session.post(lighthouse.url + "/v1/register", json=register_body(member, incarnation, None)) as r:
            headers = identity_headers(incarnation, (await r.json())["secret"])
        body = QuorumRequest(member, 0, None, "join").to_body()
        async with session.post(lighthouse.url + "/v1/quorum", json=body, headers=headers) as response:
            return response.status, await response.json()


def test_a_socket_that_closes_mid_ask_frees_its_long_poll() -> None:
    # max_waiters=2 and a long join timeout: a long poll left behind by the closed socket would hold a slot for 60 s
    with Lighthouse(PLAN, min_replicas=2, heartbeat_timeout=2.0, join_timeout=60.0, max_waiters=2) as lighthouse:
        answers = asyncio.run(_ask_then_close(lighthouse))
        # a burst: 409 for a replaced ask, 503 past max_waiters, 429 past the socket's asks in flight; one waits
        assert set(answers.values()) <= {409, 429, 503} and 409 in answers.values(), answers
        probe = lambda: [m["state"] for m in lighthouse.status()["members"] if m["member"] == "probe"]  # noqa: E731
        wait_until(lambda: probe() == ["dead"], 30, "probe's closed socket to count as its death")
        with LighthouseClient(lighthouse.url, "c", heartbeat_interval=0.05) as client, ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.quorum, 0, None, "join", 60)
            asking = lambda: any(m["member"] == "c" and m["asking"] for m in lighthouse.status()["members"])  # noqa: E731
            wait_until(asking, 30, "c's ask")
            status, answer = asyncio.run(_post_join(lighthouse, "d"))
            assert status == 200, answer
            assert waiting.result(60).quorum_id == answer["quorum_id"]
        assert sorted(answer["members"]) == ["c", "d"]
