"""The lighthouse over real HTTP and websockets: quorums, a SIGKILLed member, a join, tokens, bad input, restarts."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stalwart.coord.client import HealPlan, LighthouseClient, QuorumAnswer
from stalwart.coord.server import Lighthouse
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.loopback import free_port
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(200, 16, seed=7)
WORKER = """
import json, sys, time
from stalwart.coord.client import LighthouseClient
client = LighthouseClient(sys.argv[1], sys.argv[2], heartbeat_interval=0.05)
client.start_heartbeat(lambda: 0)
print("ready", flush=True)
sys.stdin.readline()
answer = client.quorum(0, None, "join", timeout=30)
print(json.dumps({"quorum_id": answer.quorum_id, "rank": answer.rank}), flush=True)
time.sleep(120)
"""


def http(
    url: str,
    method: str = "GET",
    body: Any = None,
    token: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
):
    """One HTTP request; returns (status, decoded JSON body)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        request.add_header("Content-Type", "application/json")  # a tokenless lighthouse takes JSON writes only
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def ask_all(clients: dict[str, LighthouseClient], requests: dict[str, tuple]) -> dict[str, QuorumAnswer]:
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {m: pool.submit(clients[m].quorum, *args) for m, args in requests.items()}
        return {m: remember(future.result(timeout=40)) for m, future in futures.items()}


def shares_of_step(step: int, members: list[str]) -> list[int]:
    """The positions of step ``step`` when ``members`` ran every step from the start."""
    ledger = DataLedger(PLAN)
    for _ in range(step):
        ledger.begin_step(members)
        ledger.commit()
    return sorted(int(p) for share in ledger.begin_step(members).values() for p in share)


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=2, heartbeat_timeout=1.0, join_timeout=5.0)
    server.start()
    yield server
    server.stop()


def test_start_up_sigkill_failure_and_join(lighthouse: Lighthouse) -> None:
    steps: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, lighthouse.url, "killed"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    clients: dict[str, LighthouseClient] = {}
    try:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().strip() == "ready"
        clients = {m: LighthouseClient(lighthouse.url, m, heartbeat_interval=0.05) for m in steps}
        for member, client in clients.items():
            client.start_heartbeat(lambda member=member: report(member, steps[member]))
        wait_until(lambda: len(lighthouse.status()["members"]) == 4, what="four heartbeats")
        worker.stdin.write("go\n")
        worker.stdin.flush()
        answers = ask_all(clients, {m: (0, None, "join", 30) for m in steps})
        first = json.loads(worker.stdout.readline())
        order = answers["a"].members
        assert sorted(order) == ["a", "b", "c", "killed"] and first == {"quorum_id": 1, "rank": order.index("killed")}
        for member, answer in answers.items():
            assert (answer.quorum_id, answer.members, answer.rank) == (1, order, order.index(member))
            start_up_heal = HealPlan(source_rank=0, targets=tuple(order[1:]))
            assert (answer.store.url, answer.store.quorum_id, answer.store.key, answer.heal) == (
                lighthouse.url,
                1,
                answers["a"].store.key,
                start_up_heal,
            )
            assert re.fullmatch(r"[A-Za-z0-9_-]{43}", answer.store.key), "256 random bits in the store's key"
            assert answer.store.key not in repr(answer), "the key stays out of log lines"
        first_key = answers["a"].store.key

        for member in steps:
            steps[member] = 2
        wait_until(lambda: lighthouse.status()["ledger"]["step"] == 2, what="the ledger to commit two steps")
        assert not any(client.reconfigure_requested for client in clients.values())

        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        wait_until(lambda: all(c.reconfigure_requested for c in clients.values()), what="reconfigure pushes")
        status = lighthouse.status()
        assert status["failures"][-1]["member"] == "killed" and status["failures"][-1]["reason"] == "socket closed"
        assert status["reconfigure_pending"]
        answers = ask_all(clients, {m: (2, 1, "failure", 30) for m in steps})
        survivors = tuple(m for m in order if m != "killed")
        for member, answer in answers.items():
            assert (answer.quorum_id, answer.members, answer.applied_step, answer.heal) == (2, survivors, 2, None)
            assert answer.member == member
        in_flight = answers["a"].ledger["in_flight"]
        assert sorted(p for share in in_flight.values() for p in share) == shares_of_step(2, list(order))
        assert not any(client.reconfigure_requested for client in clients.values()), "quorum() clears the flag"

        late = LighthouseClient(lighthouse.url, "late", heartbeat_interval=0.05)
        clients["late"] = late
        late.start_heartbeat(lambda: 0)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(late.quorum, 0, None, "join", 30)
            wait_until(lambda: all(clients[m].reconfigure_requested for m in steps), what="the joiner's reconfigure")
            for member in steps:
                steps[member] = 3
            answers = ask_all(clients, {m: (3, 2, "reconfigure", 30) for m in steps})
            answers["late"] = joined.result(timeout=40)
        for answer in answers.values():
            assert (answer.quorum_id, answer.members, answer.applied_step) == (3, (*survivors, "late"), 3)
            assert answer.heal is not None and (answer.heal.source_rank, answer.heal.targets) == (0, ("late",))
        assert answers["late"].rank == 3 and answers["late"].store.quorum_id == 3
        assert answers["late"].store.key != first_key, "each quorum's store has its own key"
        ledger = answers["late"].data_ledger()
        assert ledger.step == 3 and ledger.members == [*survivors, "late"]

        status = lighthouse.status()
        states = {m["member"]: m["state"] for m in status["members"]}
        assert states == {"a": "alive", "b": "alive", "c": "alive", "late": "alive", "killed": "dead"}
        assert status["quorum"] == {"quorum_id": 3, "members": [*survivors, "late"]}
        assert status["counts"]["failures"] == 1 and status["counts"]["recoveries"] == 1
        assert [q["reason"] for q in status["quorums"]] == ["start-up", "failure", "boundary"]
        assert status["ledger"]["step"] == 3 and 0 < status["ledger"]["epoch_progress"] < 1
        assert status["store"] == {"keys": 0}, "the store holds the current quorum's keys only"
    finally:
        worker.kill()
        worker.wait(10)
        for pipe in (worker.stdin, worker.stdout):
            if pipe is not None:
                pipe.close()
        for client in clients.values():
            client.close()


def test_token_is_required_everywhere_but_healthz() -> None:
    with Lighthouse(PLAN, token="s3cret", heartbeat_timeout=1.0) as server:
        assert http(server.url + "/healthz") == (200, {"ok": True})
        for token in (None, "wrong", "s3cre", "s3cret2"):
            for path in ("/v1/status", "/status"):
                status, body = http(server.url + path, token=token)
                assert status == 401 and "token" in body["error"]
            status, _ = http(server.url + "/v1/quorum", "POST", {"member": "a", "applied_step": 0}, token=token)
            assert status == 401
        assert http(server.url + "/v1/status", token="s3cret")[0] == 200
        short, versioned = (http(server.url + path, token="s3cret") for path in ("/status", "/v1/status"))
        assert short[0] == 200 and short[1].keys() == versioned[1].keys()
        with LighthouseClient(server.url, "intruder", token="wrong") as intruder:
            intruder.start_heartbeat(lambda: 0)
            assert not intruder.heartbeat_connected.wait(1.0)
        assert server.status()["members"] == []
        with LighthouseClient(server.url, "a", token="s3cret") as client:
            client.start_heartbeat(lambda: 0)
            assert client.quorum(0, None, "join", 10).members == ("a",)
            assert client.status()["quorum"]["members"] == ["a"]


def _observable(status: dict[str, Any]) -> Any:
    members = [(m["member"], m["state"], m["asking"], m["applied_step"]) for m in status["members"]]
    return status["quorum"], status["ledger"], status["counts"], members


def test_bad_requests_get_4xx_naming_the_problem_and_change_nothing(lighthouse: Lighthouse) -> None:
    url = lighthouse.url
    clients = {m: LighthouseClient(url, m, heartbeat_interval=0.05) for m in ("a", "b")}
    try:
        for member, client in clients.items():
            client.start_heartbeat(lambda member=member: report(member, 1))
        ask_all(clients, {m: (0, None, "join", 30) for m in clients})
        wait_until(lambda: lighthouse.status()["ledger"]["step"] == 1, what="step 1")
        wait_until(  # both heartbeats, not only the first: a report arriving later would change the snapshot
            lambda: all(m["applied_step"] == 1 for m in lighthouse.status()["members"] if m["member"] in clients),
            what="both members to report step 1",
        )
        assert asyncio.run(_bad_heartbeats(url, register(url, "probe"))) == ["error", "error", "error"]
        probe = [m for m in _observable(lighthouse.status())[3] if m[0] == "probe"]
        assert probe == [("probe", "dead", None, None)], "bad heartbeats record no step"
        zed, a = register(url, "zed"), clients["a"].identity_headers()
        before = _observable(lighthouse.status())
        quorum = url + "/v1/quorum"
        join, leave = {"reason": "join"}, url + "/v1/leave"
        survivor = {"reason": "failure", "quorum_id": 1}
        wrong = {**a, "X-Stalwart-Secret": "not-the-secret"}
        register_path = url + "/v1/register"
        cases = [
            (quorum, "POST", None, b"not json", 400, "JSON"),
            (quorum, "POST", [1, 2], None, 400, "object"),
            (quorum, "POST", {"member": "a", "applied_step": "1", **survivor}, None, 400, "'1'"),
            (quorum, "POST", {"member": "a", "applied_step": 1, **survivor, "reason": "boom"}, None, 400, "boom"),
            (quorum, "POST", {"member": "a b", "applied_step": 1, **join}, None, 400, "'a b'"),
            (quorum, "POST", {"member": "zed", "applied_step": 1, **survivor}, zed, 409, "zed"),
            (quorum, "POST", {"member": "a", "applied_step": 1, **survivor, "quorum_id": 9}, a, 409, "9"),
            (quorum, "POST", {"member": "zed", "applied_step": 50, **join}, zed, 422, "50"),
            (quorum, "POST", {"member": "a", "applied_step": 1, **survivor}, None, 403, "X-Stalwart-Incarnation"),
            (quorum, "POST", {"member": "a", "applied_step": 1, **survivor}, wrong, 403, "wrong secret"),
            (quorum, "POST", {"member": "a", "applied_step": 1, **survivor}, zed, 403, "not registered"),
            (quorum, "POST", None, b"x" * 100_000, 413, "Too Large"),
            (leave, "POST", {"member": "ghost"}, zed, 403, "ghost"),
            (leave, "POST", {"member": "a"}, zed, 403, "'a'"),
            (leave, "POST", {"who": "a"}, None, 400, "member"),
            (leave, "POST", {"member": "a", "applied_step": "x"}, a, 400, "applied_step"),
            (register_path, "POST", {"member": "n", "incarnation": "xyz"}, None, 400, "'xyz'"),
            (register_path, "POST", {"member": "n"}, None, 400, "incarnation"),
            (register_path, "POST", {"member": "a", "incarnation": a["X-Stalwart-Incarnation"]}, None, 409, "already"),
            (url + "/v1/heartbeat?member=bad%20id", "GET", None, None, 400, "bad id"),
            (url + "/v1/heartbeat?member=a", "GET", None, None, 403, "X-Stalwart-Incarnation"),
            (url + "/v1/heartbeat?member=a", "GET", None, a, 400, ""),
            (url + "/v1/nowhere", "GET", None, None, 404, "Not Found"),
        ]
        for target, method, body, extra, expected, mention in cases:
            raw = extra if isinstance(extra, bytes) else None
            headers = extra if isinstance(extra, dict) else None
            status, answer = http(target, method, body, raw=raw, headers=headers)
            assert status == expected, (body, raw, answer)
            assert mention in answer["error"], answer
        assert http(url + "/healthz") == (200, {"ok": True})
        assert _observable(lighthouse.status()) == before
        answers = ask_all(clients, {m: (1, 1, "reconfigure", 30) for m in clients})
        assert answers["a"].quorum_id == 2, "the lighthouse still serves valid requests"
    finally:
        for client in clients.values():
            client.close()


def register(url: str, member: str) -> dict[str, str]:
    """Register a fresh incarnation of ``member`` over raw HTTP; returns its identity headers."""
    incarnation = uuid.uuid4().hex
    status, body = http(url + "/v1/register", "POST", {"member": member, "incarnation": incarnation})
    assert status == 200, body
    return {"X-Stalwart-Incarnation": incarnation, "X-Stalwart-Secret": body["secret"]}


async def _bad_heartbeats(url: str, headers: dict[str, str]) -> list[str]:
    """Send malformed heartbeats over a websocket; collect the message types the lighthouse answers with."""
    replies = []
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url + "/v1/heartbeat", params={"member": "probe"}, headers=headers) as ws,
    ):
        for message in ("nope", json.dumps({"applied_step": -1}), json.dumps({"step": 1})):
            await ws.send_str(message)
            reply = await ws.receive_json(timeout=5)
            replies.append(reply["type"])
    return replies


class CliLighthouse:
    """``python -m stalwart.cli.lighthouse`` in a subprocess, its output read by a thread."""

    def __init__(self, state: Path, port: int, *extra: str) -> None:
        command = [sys.executable, "-m", "stalwart.cli.lighthouse", "--min-replicas", "2", "--state", str(state)]
        command += ["--port", str(port), "--heartbeat-timeout", "3"]
        command += ["--join-timeout", "2", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.banner = self._wait_for_banner()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_for_banner(self) -> str:
        seen = []
        for _ in range(200):
            try:
                line = self.lines.get(timeout=30)
            except queue.Empty:
                break
            if line.startswith("lighthouse listening on "):
                return line.strip()
            seen.append(line)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"the lighthouse did not start: {''.join(seen)}")

    def stop(self, sig: int) -> int:
        """Send ``sig``, wait for the exit and close the pipe; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(15)
        self._reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return code


def test_cli_lighthouse_killed_and_restarted_resumes_the_ledger(tmp_path: Path) -> None:
    state = tmp_path / "lighthouse.db"
    port = free_port()
    plan_flags = ("--dataset-size", "200", "--global-batch", "16", "--seed", "7")
    lighthouse = CliLighthouse(state, port, *plan_flags)
    url = f"http://127.0.0.1:{port}"
    assert lighthouse.banner == f"lighthouse listening on {url}"
    steps = {"a": 0, "b": 0}
    clients = {m: LighthouseClient(url, m, heartbeat_interval=0.05) for m in steps}
    try:
        for member, client in clients.items():
            client.start_heartbeat(lambda member=member: report(member, steps[member]))
        answers = ask_all(clients, {m: (0, None, "join", 30) for m in steps})
        assert answers["a"].quorum_id == 1 and answers["a"].store.url == url
        steps.update(a=3, b=3)
        wait_until(lambda: http(url + "/v1/status")[1]["ledger"]["step"] == 3, what="step 3")

        lighthouse.stop(signal.SIGKILL)
        wait_until(lambda: not any(c.heartbeat_connected.is_set() for c in clients.values()), what="lost sockets")
        lighthouse = CliLighthouse(state, port)
        wait_until(lambda: all(c.heartbeat_connected.is_set() for c in clients.values()), what="reconnects")
        status = http(url + "/v1/status")[1]
        assert status["quorum"] == {"quorum_id": 1, "members": list(answers["a"].members)}
        assert status["ledger"]["step"] == 3 and status["plan"] == PLAN.to_dict()
        assert {m["member"]: m["state"] for m in status["members"]} == {"a": "alive", "b": "alive"}

        steps.update(a=5, b=5)
        wait_until(lambda: http(url + "/v1/status")[1]["ledger"]["step"] == 5, what="step 5 after the restart")
        answers = ask_all(clients, {m: (5, 1, "reconfigure", 30) for m in steps})
        assert answers["b"].quorum_id == 2 and answers["b"].data_ledger().step == 5
        expected = DataLedger(PLAN)
        for _ in range(5):
            expected.begin_step(list(answers["a"].members))
            expected.commit()
        assert answers["b"].ledger["base_index"] == expected.base_index + PLAN.global_batch_size

        assert lighthouse.stop(signal.SIGTERM) == 0
        command = [sys.executable, "-m", "stalwart.cli.lighthouse", "--min-replicas", "2", "--state", str(state)]
        conflict = subprocess.run(
            [*command, "--global-batch", "12"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert conflict.returncode == 2 and "--global-batch" in conflict.stderr and "16" in conflict.stderr
    finally:
        lighthouse.stop(signal.SIGKILL)
        for client in clients.values():
            client.close()
