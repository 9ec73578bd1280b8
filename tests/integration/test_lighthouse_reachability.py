"""Reachability over real HTTP: a member cut off from its peers is left out, the majority kept, and it comes back."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stalwart.coord.client import LighthouseClient, QuorumAnswer
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(200, 16, seed=7)
JOIN_TIMEOUT = 2.0


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """One ``POST``; returns (status, decoded JSON body)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def ask_all(clients: dict[str, LighthouseClient], asks: dict[str, tuple[Any, ...]]) -> dict[str, QuorumAnswer]:
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {m: pool.submit(clients[m].quorum, *args[:4], unreachable=args[4]) for m, args in asks.items()}
        return {m: future.result(timeout=60) for m, future in futures.items()}


def test_a_member_cut_off_from_its_peers_is_left_out_not_the_majority_and_readmitted_once_its_cuts_expire() -> None:
    lighthouse = Lighthouse(PLAN, min_replicas=1, heartbeat_timeout=1.0, join_timeout=JOIN_TIMEOUT)
    lighthouse.start()
    clients = {m: LighthouseClient(lighthouse.url, m, heartbeat_interval=0.05) for m in ("a", "b", "c")}
    try:
        for client in clients.values():
            client.start_heartbeat(lambda: 0)
        wait_until(  # else the first quorum may form before the last member is seen, and without it
            lambda: sum(m["connected"] for m in lighthouse.status()["members"]) == 3, what="three heartbeats"
        )
        first = ask_all(clients, {m: (0, None, "join", 30, ()) for m in clients})
        members = first["a"].members
        a, b, c = members
        quorum = lighthouse.url + "/v1/quorum"
        headers = {"Content-Type": "application/json", **clients[c].identity_headers()}

        bad = {"member": c, "applied_step": 0, "quorum_id": 1, "reason": "failure", "unreachable": [c]}
        status, answer = post(quorum, bad, headers)
        assert status == 400 and answer["field"] == "unreachable" and c in answer["error"]

        # c cannot reach a and b: its rendezvous fails at once and it asks first, alone. Today's rule formed a
        # quorum of c alone at the join timeout; a and b may still sit in the rendezvous c gave up on: it waits.
        cut_off = {"member": c, "applied_step": 0, "quorum_id": 1, "reason": "failure", "unreachable": [a, b]}
        status, answer = post(quorum, cut_off, headers)
        assert status == 408, answer
        status_now = lighthouse.status()
        assert status_now["quorum"]["quorum_id"] == 1 and status_now["counts"]["failures"] == 0
        assert sorted(cut["members"] for cut in status_now["cuts"]) == sorted([sorted([a, c]), sorted([b, c])])

        second = ask_all(clients, {m: (0, 1, "failure", 30, (c,)) for m in (a, b)})
        assert {answer.members for answer in second.values()} == {(a, b)}
        status_now = lighthouse.status()
        assert status_now["quorums"][-1]["unreachable"] == [c] and status_now["counts"]["failures"] == 0

        # c asks to join again with what its probe found; once its cuts expire a and b are called to a boundary
        with ThreadPoolExecutor(1) as pool:
            rejoined = pool.submit(clients[c].quorum, 0, 1, "join", 60, unreachable=[a, b])
            wait_until(
                lambda: clients[a].reconfigure_requested and clients[b].reconfigure_requested,
                timeout=60,
                what="the boundary that admits c again once its cuts expired",
            )
            third = ask_all(clients, {m: (0, 2, "reconfigure", 30, ()) for m in (a, b)})
            third[c] = rejoined.result(timeout=60)
        assert {answer.members for answer in third.values()} == {(a, b, c)}
        assert lighthouse.status()["cuts"] == []
    finally:
        for client in clients.values():
            client.close()
        lighthouse.stop()


def test_a_left_out_member_whose_probe_gets_through_again_ends_its_cuts_and_is_called_back_at_once() -> None:
    """The cuts would hold for a join timeout (a minute here): the member's ``POST /v1/reach`` ends them now."""
    lighthouse = Lighthouse(PLAN, min_replicas=1, heartbeat_timeout=1.0, join_timeout=60.0)
    lighthouse.start()
    clients = {m: LighthouseClient(lighthouse.url, m, heartbeat_interval=0.05) for m in ("a", "b", "c")}
    try:
        for client in clients.values():
            client.start_heartbeat(lambda: 0)
        wait_until(lambda: sum(m["connected"] for m in lighthouse.status()["members"]) == 3, what="three heartbeats")
        a, b, c = ask_all(clients, {m: (0, None, "join", 30, ()) for m in clients})["a"].members
        reach = lighthouse.url + "/v1/reach"
        headers = {"Content-Type": "application/json", **clients[c].identity_headers()}
        for body, field in [
            ({"member": c, "reached": [c]}, "reached"),
            ({"member": c, "reached": "a"}, "reached"),
            ({"member": c}, None),
            ({"member": c, "reached": [], "extra": 1}, None),
        ]:
            status, answer = post(reach, body, headers)
            assert status == 400 and answer.get("field") == field, (body, answer)
        status, _ = post(reach, {"member": c, "reached": [a]}, {"Content-Type": "application/json"})
        assert status == 403, "without the incarnation's credentials"

        with ThreadPoolExecutor(1) as pool:  # c cut from both: left out, a and b go on; c's request waits
            rejoined = pool.submit(clients[c].quorum, 0, 1, "failure", 60, unreachable=[a, b])
            wait_until(  # else a and b may form first, and c's request come late is refused (409: join again)
                lambda: any(m["member"] == c and m["asking"] for m in lighthouse.status()["members"]),
                what="c's request waiting",
            )
            second = ask_all(clients, {m: (0, 1, "failure", 30, (c,)) for m in (a, b)})
            assert {answer.members for answer in second.values()} == {(a, b)}
            assert clients[c].report_reached([a]) == 1
            assert not lighthouse.status()["reconfigure_pending"], "still cut from b: no boundary for it yet"
            assert clients[c].report_reached([a, b]) == 1 and lighthouse.status()["cuts"] == []
            assert lighthouse.status()["reconfigure_pending"]
            wait_until(
                lambda: clients[a].reconfigure_requested and clients[b].reconfigure_requested,
                what="the boundary that admits c",
            )
            third = ask_all(clients, {m: (0, 2, "reconfigure", 30, ()) for m in (a, b)})
            third[c] = rejoined.result(timeout=60)
        assert {answer.members for answer in third.values()} == {(a, b, c)}
        assert clients[c].report_reached([a]) == 0, "nothing left to end"
    finally:
        for client in clients.values():
            client.close()
        lighthouse.stop()
