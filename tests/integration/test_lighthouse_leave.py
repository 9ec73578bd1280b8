"""A clean exit is never a failure: a member that left is not revived by a heartbeat still on its way, nor failed
when its socket closes, and its incarnation has no more say (410 ``left``); real lighthouse, real clients."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

from stalwart.coord.client import LighthouseClient, LighthouseError
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(400, 8, seed=1)
ROUNDS = 40
"""Members that leave one after the other: without the fix about half of them were recorded as failed."""
FAST = 0.002
"""A heartbeat every 2 ms, so that one is nearly always on its way when the leave goes out."""


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    # a quorum waits up to join_timeout for every live member to ask: long enough that, on a busy machine, the
    # second member of each job always asks in time (these members never come to a boundary for a late one)
    server = Lighthouse(PLAN, min_replicas=1, heartbeat_timeout=5.0, join_timeout=30.0)
    server.start()
    yield server
    server.stop()


def post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def all_gone(lighthouse: Lighthouse, count: int) -> dict[str, Any] | None:
    """The status once ``count`` members are known and none is connected or alive any more."""
    status = lighthouse.status()
    members = status["members"]
    gone = all(m["state"] in ("left", "dead") and not m["connected"] for m in members)
    return status if len(members) == count and gone else None


def check_clean(status: dict[str, Any], count: int) -> None:
    assert status["failures"] == [] and status["counts"]["failures"] == 0
    assert [m["state"] for m in status["members"]] == ["left"] * count
    assert len(status["departures"]) == count


def test_members_that_leave_and_close_are_never_failures(lighthouse: Lighthouse) -> None:
    for number in range(ROUNDS):
        client = LighthouseClient(lighthouse.url, f"m{number}", heartbeat_interval=FAST)
        client.start_heartbeat(lambda: 0)
        wait_until(client.heartbeat_connected.is_set, what="the heartbeat")
        wait_until(lambda number=number: lighthouse.status()["members"][number]["connected"], what="a heartbeat")
        client.leave(0)
        client.close()
    check_clean(wait_until(lambda: all_gone(lighthouse, ROUNDS), what="every member to be gone"), ROUNDS)


def test_quorum_members_that_leave_after_their_last_step_are_never_failures(lighthouse: Lighthouse) -> None:
    """The end of a job, repeated: two members form a quorum, train, report their last step in the leave."""
    for job in range(6):
        names = [f"j{job}a", f"j{job}b"]
        clients = [LighthouseClient(lighthouse.url, name, heartbeat_interval=FAST) for name in names]
        steps = dict.fromkeys(names, 0)
        for name, client in zip(names, clients, strict=True):
            client.start_heartbeat(lambda name=name, steps=steps: report(name, steps[name]))
        # both live before either asks: a quorum waits for live members only, and these never come to a boundary
        # for a late one (the first asking alone would train without the second)
        wait_until(
            lambda names=names: {m["member"] for m in lighthouse.status()["members"] if m["connected"]} >= set(names),
            what=f"{names} to heartbeat",
        )
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = [pool.submit(client.quorum, 0, None, "join", 60) for client in clients]
            answers = [remember(future.result(timeout=90)) for future in futures]
        last = answers[0].applied_step + 3
        for name in names:
            steps[name] = last
        for client in clients:
            client.leave(last)
            client.close()
    status = wait_until(lambda: all_gone(lighthouse, 12), what="every member to be gone")
    check_clean(status, 12)
    assert all(departure["in_quorum"] for departure in status["departures"])


def test_a_leave_sent_while_the_heartbeat_goes_on_is_still_no_failure(lighthouse: Lighthouse) -> None:
    """Another client, which leaves without stopping its heartbeat: the lighthouse alone keeps the exit clean."""
    for number in range(ROUNDS // 2):
        client = LighthouseClient(lighthouse.url, f"other{number}", heartbeat_interval=FAST)
        client.start_heartbeat(lambda: 0)
        wait_until(client.heartbeat_connected.is_set, what="the heartbeat")
        headers = client.identity_headers()
        status, answer = post(lighthouse.url + "/v1/leave", {"member": client.member, "applied_step": 0}, headers)
        assert status == 200, answer
        closed = client.heartbeat_connected
        wait_until(lambda closed=closed: not closed.is_set(), what="the lighthouse to close the socket")
        client.close()
    check_clean(wait_until(lambda: all_gone(lighthouse, ROUNDS // 2), what="every member to be gone"), ROUNDS // 2)


def test_an_incarnation_that_left_has_no_more_say_and_a_new_one_comes_back(lighthouse: Lighthouse) -> None:
    client = LighthouseClient(lighthouse.url, "gone", heartbeat_interval=0.05)
    client.start_heartbeat(lambda: 0)
    wait_until(client.heartbeat_connected.is_set, what="the heartbeat")
    headers = client.identity_headers()
    client.leave(0)
    body = {"member": "gone", "applied_step": 0, "quorum_id": None, "reason": "join"}
    status, answer = post(lighthouse.url + "/v1/quorum", body, headers)
    assert status == 410 and answer["code"] == "left", answer
    with pytest.raises(LighthouseError) as refused:
        client.quorum(0, None, "join", 10)
    assert refused.value.status == 410
    assert post(lighthouse.url + "/v1/leave", {"member": "gone"}, headers) == (200, {"ok": True}), "leave twice"

    async def open_socket() -> int:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(lighthouse.url + "/v1/heartbeat?member=gone", headers=headers):
                    return 101
            except aiohttp.WSServerHandshakeError as error:
                return error.status

    assert asyncio.run(open_socket()) == 410
    client.close()
    status = lighthouse.status()
    assert status["failures"] == [] and status["members"][0]["state"] == "left"
    with LighthouseClient(lighthouse.url, "gone", heartbeat_interval=0.05) as again:
        again.start_heartbeat(lambda: 0)
        wait_until(lambda: lighthouse.status()["members"][0]["state"] == "joining", what="the new incarnation")
