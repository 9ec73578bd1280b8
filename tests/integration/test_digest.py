"""A report commits steps only when the member's ledger digest matches the lighthouse's replay."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from stalwart.coord.client import LighthouseClient
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.quorum import LighthouseState, QuorumRequest, RequestError
from stalwart.coord.server import Lighthouse
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=2)
FAR_AHEAD = 5_000
"""A bogus report's step: thousands of steps on, as after a lighthouse restart, so that the lighthouse replays it
over many events of its loop before the digest refuses it (50,000 cost 6 s of the suite for the same check)."""


def test_a_report_with_a_wrong_or_missing_digest_commits_nothing() -> None:
    state = LighthouseState(PLAN, require_digest=True)
    state.connected("a", 0.0)
    state.request(QuorumRequest("a", 0, None, "join"), 0.0)
    formation = state.tick(0.0)
    assert formation is not None
    before = state.state_dict()
    for digest, match in ((None, "digest of the member's ledger is required"), ("0" * 32, "does not match")):
        with pytest.raises(RequestError, match=match) as refused:
            state.heartbeat("a", 5, 1.0, digest)
        assert refused.value.status == 422 and refused.value.details["field"] == "digest"
        assert state.state_dict() == before, "a refused report changes nothing"
    with pytest.raises(RequestError, match="does not match"):
        state.request(QuorumRequest("a", 5, 1, "reconfigure", "0" * 32), 1.0)
    assert state.state_dict() == before
    state.heartbeat("a", 0, 1.0)  # a report that commits nothing needs no digest
    replica = DataLedger.from_state_dict(state.ledger_state())
    replica.commit()
    state.heartbeat("a", 1, 1.1, ledger_digest(replica.state_dict()))
    assert state.step == 1


async def _send(url: str, headers: dict[str, str], message: dict[str, object]) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url + "/v1/heartbeat", params={"member": "a"}, headers=headers) as ws,
    ):
        await ws.send_str(json.dumps(message))
        for _ in range(20):  # skip pushes (the quorum's reconfigure), bounded
            reply = await ws.receive(timeout=60)  # bounded; a busy machine can be slow
            if reply.type != aiohttp.WSMsgType.TEXT:
                return {"type": "closed", "error": str(reply.data)}
            data = json.loads(reply.data)
            if data.get("type") == "error":
                return data
        return {"type": "no error in 20 messages"}


def test_a_bogus_far_ahead_heartbeat_over_a_real_websocket_is_refused() -> None:
    with Lighthouse(PLAN, heartbeat_timeout=5.0, join_timeout=0.5) as server:
        steps = {"a": 0}
        with LighthouseClient(server.url, "a", heartbeat_interval=0.05) as client:
            client.start_heartbeat(lambda: report("a", steps["a"]))
            remember(client.quorum(0, None, "join", 20))
            steps["a"] = 2
            wait_until(lambda: server.status()["ledger"]["step"] == 2, what="honest reports to commit 2 steps")
            ledger_before = server.status()["ledger"]
            headers = client.identity_headers()
            client.close()  # its heartbeat would reconnect and take the socket over from the probes below
            bogus = {"applied_step": FAR_AHEAD, "digest": "ab" * 16}
            reply = asyncio.run(_send(server.url, headers, bogus))
            assert reply["type"] == "error" and "does not match" in str(reply["error"]), reply
            reply = asyncio.run(_send(server.url, headers, {"applied_step": FAR_AHEAD}))
            assert reply["type"] == "error" and "digest" in str(reply["error"]), reply
            assert server.status()["ledger"] == ledger_before, "the ledger is unchanged"
            assert server.state.step == 2
