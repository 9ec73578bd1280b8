"""A hostile client on the cluster network, against real lighthouses (and workers) on 127.0.0.1.

Each test performs one attack of issue 17 or 36 and asserts that it is refused and
that the job goes on with nothing lost: honest members (real
``LighthouseClient``s, heartbeating the digests of their ledgers) keep
committing steps, their quorum store keys are intact. The attacks speak the
wire (raw HTTP, websockets, TCPStore clients), so each of them also runs
against the code before the fix, where each test fails (the attack worked).
No test asserts a timing: where an attack would block the event loop, the
test checks an order of events (a ``/healthz`` probe answered before the
lighthouse finishes with the hostile message) or that the lighthouse answers
at all within a generous bound. ``benchmarks/hostile.py`` measures the
``/healthz`` latency under each hostile message.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stalwart.coord.client import LighthouseClient, LighthouseUnreachable, QuorumAnswer
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.server import Lighthouse
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.loopback import free_port
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

HOST = "127.0.0.1"
TOKEN = "hostile-test-token-0123456789"
PLAN = EpochPlan(200, 16, seed=7)
PLAN_FLAGS = ("--dataset-size", "200", "--global-batch", "16", "--seed", "7")
BOUND = 60.0
"""Seconds within which a lighthouse that is not stalled answers anything (a liveness bound, not a timing)."""
INCARNATION = "X-Stalwart-Incarnation"
SECRET = "X-Stalwart-Secret"


# --- a lighthouse process and honest members --------------------------------------------------------------------


class LighthouseProcess:
    """``python -m stalwart.cli.lighthouse`` with the token in its environment, its output in a log file."""

    def __init__(
        self, folder: Path, *extra: str, token: str | None = TOKEN, nofile: int | None = None, wait: bool = True
    ) -> None:
        self.port = free_port()
        self.log_path = folder / f"lighthouse-{self.port}.log"
        command = [sys.executable, "-m", "stalwart.cli.lighthouse", "--min-replicas", "2", "--port", str(self.port)]
        command += ["--heartbeat-timeout", "5", "--join-timeout", "2", *PLAN_FLAGS, *extra]
        env = {key: value for key, value in os.environ.items() if key != "STALWART_LIGHTHOUSE_TOKEN"}
        if token is not None:
            env["STALWART_LIGHTHOUSE_TOKEN"] = token

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=limit if nofile else None
            )
        self.url = f"http://{HOST}:{self.port}"
        if wait:
            wait_until(lambda: "listening on" in self.log() or self.process.poll() is not None, BOUND, "a banner")
            assert self.process.poll() is None, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[LighthouseProcess]:
    process = LighthouseProcess(tmp_path, "--state", str(tmp_path / "state.db"))
    yield process
    process.stop()


class Honest:
    """Two honest members that formed quorum 1 and commit steps as their reports advance."""

    def __init__(self, url: str, token: str | None = TOKEN, names: tuple[str, ...] = ("a", "b")) -> None:
        self.url = url
        self.steps = dict.fromkeys(names, 0)
        self.clients = {m: LighthouseClient(url, m, token=token, heartbeat_interval=0.05) for m in names}
        for member, client in self.clients.items():
            client.start_heartbeat(lambda member=member: report(member, self.steps[member]))
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {m: pool.submit(c.quorum, 0, None, "join", BOUND) for m, c in self.clients.items()}
            self.answers = {m: remember(f.result(timeout=BOUND + 10)) for m, f in futures.items()}

    def advance(self, step: int) -> None:
        """Every member reports ``step``; returns once the lighthouse committed it (nothing lost)."""
        for member in self.steps:
            self.steps[member] = step
        wait_until(lambda: status(self.url)["ledger"]["step"] == step, BOUND, f"step {step} to commit")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture
def honest(lighthouse: LighthouseProcess) -> Iterator[Honest]:
    members = Honest(lighthouse.url)
    members.advance(2)
    yield members
    members.close()


def http(
    url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None, timeout: float = BOUND
) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {TOKEN}"})
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"error": text.decode(errors="replace")}


def status(url: str) -> dict[str, Any]:
    code, body = http(url + "/v1/status")
    assert code == 200, body
    return body


def register(url: str, member: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    incarnation = uuid.uuid4().hex
    code, body = http(url + "/v1/register", "POST", {"member": member, "incarnation": incarnation}, headers)
    if code == 200:
        body["headers"] = {INCARNATION: incarnation, SECRET: body["secret"]}
    return code, body


def healthz(url: str, timeout: float = BOUND) -> float:
    """Seconds ``GET /healthz`` took (it must answer 200 within ``timeout``)."""
    started = time.monotonic()
    with urllib.request.urlopen(url + "/healthz", timeout=timeout) as response:
        assert response.status == 200
    return time.monotonic() - started


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from /proc: its socket inodes in the LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with_target = os.readlink(fd) if fd.is_symlink() else ""
        match = re.fullmatch(r"socket:\[(\d+)\]", with_target)
        if match:
            inodes.add(match[1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --- 1. the quorum store ----------------------------------------------------------------------------------------


def test_nobody_without_the_credentials_reads_writes_or_lists_the_quorums_keys(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    import datetime

    import torch.distributed as dist

    ports = listening_ports(lighthouse.process.pid)
    assert lighthouse.port in ports
    for port in ports:  # a TCPStore client on every port the lighthouse listens on
        try:
            store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=3))
            keys = store.list_keys()
        except (RuntimeError, dist.DistError):
            continue
        raise AssertionError(f"port {port} is an open TCPStore: anyone lists {keys[:3]} and writes there")

    from stalwart.runtime.comm import quorum_store

    answer = honest.answers["a"]
    store = quorum_store(answer.store, 10.0, token=TOKEN)
    store.set("group_size/a", "1")
    path = f"/v1/store/{answer.quorum_id}"
    attempts = {
        "no token": ({"Authorization": ""}, 401),
        "no store key": ({}, 403),
        "a wrong store key": ({"X-Stalwart-Store-Key": "x" * 43}, 403),
    }
    for what, (headers, expected) in attempts.items():
        for op in (
            {"op": "get", "key": "group_size/a", "wait": 0},
            {"op": "set", "key": "group_size/a", "value": "OQ=="},
        ):
            code, body = http(lighthouse.url + path, "POST", op, headers)
            assert code == expected, (what, op, code, body)
    code, _ = http(lighthouse.url + path, "POST", {"op": "list_keys"}, {"X-Stalwart-Store-Key": answer.store.key})
    assert code == 400, "no operation lists the keys"
    assert bytes(store.get("group_size/a")) == b"1", "nothing the attacker sent changed a key"

    honest.advance(3)
    joiner = LighthouseClient(lighthouse.url, "c", token=TOKEN, heartbeat_interval=0.05)
    try:
        joiner.start_heartbeat(lambda: 0)
        with ThreadPoolExecutor(3) as pool:
            joined = pool.submit(joiner.quorum, 0, None, "join", BOUND)
            wait_until(lambda: all(c.reconfigure_requested for c in honest.clients.values()), BOUND, "the push")
            for client in honest.clients.values():
                pool.submit(client.quorum, 3, 1, "reconfigure", BOUND)
            new = joined.result(timeout=BOUND + 10)
        assert new.quorum_id == 2 and new.store.key != answer.store.key
        code, body = http(lighthouse.url + path, "POST", {"op": "get", "key": "group_size/a", "wait": 0},
                          {"X-Stalwart-Store-Key": answer.store.key})  # fmt: skip
        assert code == 410 and status(lighthouse.url)["store"]["keys"] == 0, "a superseded quorum's keys are deleted"
    finally:
        joiner.close()


def test_a_quorum_members_store_writes_are_capped(tmp_path: Path) -> None:
    from stalwart.coord.store import StoreLimits
    from stalwart.runtime.comm import quorum_store

    limits = StoreLimits(value_bytes=1024, total_bytes=4096, keys=8, waits=4)
    with Lighthouse(PLAN, min_replicas=1, token=TOKEN, store_limits=limits) as server:
        client = LighthouseClient(server.url, "a", token=TOKEN, heartbeat_interval=0.05)
        try:
            client.start_heartbeat(lambda: 0)
            answer = client.quorum(0, None, "join", BOUND)
            store = quorum_store(answer.store, 5.0, token=TOKEN)
            path = f"{server.url}/v1/store/{answer.quorum_id}"
            key = {"X-Stalwart-Store-Key": answer.store.key}
            big = base64.b64encode(b"x" * 1025).decode()
            assert http(path, "POST", {"op": "set", "key": "k", "value": big}, key)[0] == 413
            for number in range(4):
                store.set(f"k{number}", b"y" * 1000)
            code, body = http(
                path, "POST", {"op": "set", "key": "k9", "value": base64.b64encode(b"z" * 1000).decode()}, key
            )
            assert code == 507 and body["cap"] == "total_bytes"
            for number in range(4, 8):
                store.set(f"k{number}", b"")
            code, body = http(path, "POST", {"op": "set", "key": "k8", "value": ""}, key)
            assert code == 507 and body["cap"] == "keys"
            assert bytes(store.get("k0")) == b"y" * 1000
        finally:
            client.close()


# --- 2. checkpoints only from the writer ------------------------------------------------------------------------


def test_a_checkpoint_reported_by_anyone_but_the_quorums_writer_is_refused(
    lighthouse: LighthouseProcess, honest: Honest, tmp_path: Path
) -> None:
    ledger = DataLedger(PLAN)
    members = list(honest.answers["a"].members)
    for _ in range(2):
        ledger.begin_step(members)
        ledger.commit()
    state = ledger.state_dict()
    planted = tmp_path / "planted"
    body = {"step": 2, "path": str(planted), "ledger": state, "digest": ledger_digest(state)}
    code, mallory = register(lighthouse.url, "mallory")
    assert code == 200
    code, answer = http(lighthouse.url + "/v1/checkpoint", "POST", {"member": "mallory", **body}, mallory["headers"])
    assert code == 403 and answer["code"] == "not_writer", answer
    second = members[1]
    headers = honest.clients[second].identity_headers()
    code, answer = http(lighthouse.url + "/v1/checkpoint", "POST", {"member": second, **body}, headers)
    assert code == 403, "a quorum member that is not its rank 0 writes no checkpoint"
    assert status(lighthouse.url)["checkpoint"] is None
    honest.advance(3)


# --- 3. bounded work per message --------------------------------------------------------------------------------


async def _heartbeat_then_probe(url: str, headers: dict[str, str], member: str, message: dict[str, Any]) -> list[str]:
    """Send ``message`` on ``member``'s heartbeat socket, then probe ``/healthz``: the order of what came back."""
    events: list[str] = []
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
        session.ws_connect(url + "/v1/heartbeat", params={"member": member}, headers=headers) as ws,
    ):
        await ws.send_str(json.dumps(message))

        async def probe() -> None:
            await asyncio.sleep(0.05)  # after the message is in the lighthouse's socket
            async with session.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=BOUND)) as response:
                assert response.status == 200
                events.append("healthz")

        async def replies() -> None:
            for _ in range(50):
                reply = await ws.receive(timeout=BOUND)
                if reply.type != aiohttp.WSMsgType.TEXT:
                    return
                if json.loads(reply.data).get("type") == "error":
                    events.append("refused")
                    return

        await asyncio.gather(probe(), replies())
    return events


def test_a_heartbeat_claiming_a_trillion_heals_costs_constant_time(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    code, mallory = register(lighthouse.url, "mallory")
    assert code == 200
    message = {"applied_step": 0, "heal": {"heals": 10**12, "bytes": 1, "seconds": 1.0}}
    events = asyncio.run(_heartbeat_then_probe(lighthouse.url, mallory["headers"], "mallory", message))
    assert "healthz" in events, "the lighthouse answers /healthz (it does not loop a trillion times)"
    with urllib.request.urlopen(
        urllib.request.Request(lighthouse.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=BOUND
    ) as response:
        metrics = response.read().decode()
    heals = float(re.search(r"^stalwart_heals_total (\S+)$", metrics, re.M)[1])  # type: ignore[index]
    assert heals < 100, "an unbelievable heal report is not counted"
    honest.advance(3)


@pytest.mark.slow
def test_a_digest_report_far_ahead_is_refused_without_holding_the_event_loop(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    """A quorum member claims 20,000 steps ahead with a wrong digest: ``/healthz`` is answered before the verdict."""
    member = honest.answers["a"].members[1]
    headers = honest.clients[member].identity_headers()
    honest.clients[member].close()  # the hostile member takes over the member's socket and identity
    message = {"applied_step": 2 + 20_000, "digest": "ab" * 16}  # replayed over many of the loop's ticks
    events = asyncio.run(_heartbeat_then_probe(lighthouse.url, headers, member, message))
    assert events == ["healthz", "refused"], events
    assert status(lighthouse.url)["ledger"]["step"] == 2, "the bogus report committed nothing"


# --- 4. connection hygiene --------------------------------------------------------------------------------------


def test_half_sent_requests_and_silent_clients_cannot_exhaust_the_lighthouse(tmp_path: Path) -> None:
    lighthouse = LighthouseProcess(tmp_path, "--header-timeout", "2", nofile=256)  # the default, 10 s, waits longer
    sockets: list[socket.socket] = []
    honest: Honest | None = None
    try:
        before = len(lighthouse.log())
        for number in range(320):
            peer = socket.create_connection((HOST, lighthouse.port), timeout=BOUND)
            if number % 16:  # most send half a request; every 16th says nothing at all
                peer.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sockets.append(peer)
        for _ in range(20):
            healthz(lighthouse.url)
        honest = Honest(lighthouse.url)
        honest.advance(2)

        def closed(peer: socket.socket) -> bool:
            peer.settimeout(0.01)
            try:
                return peer.recv(1) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        wait_until(lambda: all(closed(peer) for peer in sockets), BOUND, "the lighthouse to close the slow connections")
        honest.advance(3)
        written = len(lighthouse.log()) - before
        assert written < 64 * 1024, f"{written} bytes of log for one flood: one line per kind, not per connection"
        assert "Traceback" not in lighthouse.log()
    finally:
        for peer in sockets:
            peer.close()
        if honest is not None:
            honest.close()
        lighthouse.stop()


def test_a_storm_of_honest_requests_sent_while_the_lighthouse_is_busy_is_answered_whole(tmp_path: Path) -> None:
    """Requests already sent are never closed for room: SIGSTOP holds the lighthouse (as a busy event loop does)
    while 96 complete requests and 32 half-sent ones queue in its socket; on SIGCONT it accepts them all at once,
    past its cap of 8 stalled connections. Before, it closed the oldest unread ones, honest requests mid-body;
    now only connections with nothing complete are closed, and every honest request is answered."""
    lighthouse = LighthouseProcess(tmp_path, "--max-unauthenticated", "8", "--header-timeout", "2")
    sockets: list[socket.socket] = []
    request = (
        f"GET /v1/status HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        healthz(lighthouse.url)
        lighthouse.process.send_signal(signal.SIGSTOP)
        try:
            honest, slow = [], []
            for number in range(128):
                peer = socket.create_connection((HOST, lighthouse.port), timeout=BOUND)
                sockets.append(peer)
                if number % 4 == 3:
                    peer.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    slow.append(peer)
                else:
                    peer.sendall(request)
                    honest.append(peer)
        finally:
            lighthouse.process.send_signal(signal.SIGCONT)
        for peer in honest:
            peer.settimeout(BOUND)
            answer = b""
            while chunk := peer.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        for peer in slow:  # closed by the cap or the header timeout, never answered
            peer.settimeout(BOUND)
            with contextlib.suppress(ConnectionResetError):
                assert peer.recv(1) == b""
        healthz(lighthouse.url)
    finally:
        for peer in sockets:
            peer.close()
        lighthouse.stop()


def test_one_identity_cannot_take_every_waiting_slot() -> None:
    with Lighthouse(PLAN, min_replicas=3, token=TOKEN, join_timeout=3.0, max_waiters=4) as server:
        code, mallory = register(server.url, "mallory")
        assert code == 200
        ask = {"member": "mallory", "applied_step": 0, "quorum_id": None, "reason": "join"}
        with ThreadPoolExecutor(8) as pool:
            polls = [pool.submit(http, server.url + "/v1/quorum", "POST", ask, mallory["headers"]) for _ in range(4)]
            # each newer poll replaces the older ones (the fix), or all four wait and fill every slot (before it);
            # server.waiters.waiting counts the polls the lighthouse holds
            wait_until(
                lambda: sum(p.done() for p in polls) >= 3 or server.waiters.waiting == 4,
                BOUND,
                "mallory's polls to arrive",
            )
            honest = LighthouseClient(server.url, "a", token=TOKEN, heartbeat_interval=0.05)
            try:
                honest.start_heartbeat(lambda: 0)
                code, body = http(server.url + "/v1/quorum", "POST", {**ask, "member": "a"}, honest.identity_headers())
                assert code == 408, f"the honest member waits for its quorum (not 503 max_waiters): {code} {body}"
            finally:
                honest.close()
            answers = [p.result(timeout=BOUND) for p in polls]
            replaced = [body for code, body in answers if code == 409 and body["code"] == "replaced"]
            assert len(replaced) == 3 and sorted(code for code, _ in answers) == [408, 409, 409, 409], answers


def test_a_binary_authorization_header_is_a_400_and_a_closing_socket_no_traceback(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    for value in (b"Bearer \xff\xfe", "Bearer \u00e9t\u00e9".encode()):  # not UTF-8; UTF-8 but not ASCII
        raw = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n"
        with socket.create_connection((HOST, lighthouse.port), timeout=BOUND) as peer:
            peer.sendall(raw)
            answer = peer.recv(4096)
        assert answer.split(b" ")[1] == b"400", answer[:200]
    code, mallory = register(lighthouse.url, "mallory")
    assert code == 200

    async def hang_up(times: int) -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            for _ in range(times):
                ws = await session.ws_connect(
                    lighthouse.url + "/v1/heartbeat", params={"member": "mallory"}, headers=mallory["headers"]
                )
                await ws.send_str("not json")  # answered with an error message: written to a closing socket
                ws._response.connection.transport.abort()  # type: ignore[union-attr]  # private on purpose: a half-open peer

    asyncio.run(hang_up(40))
    healthz(lighthouse.url)
    honest.advance(3)
    assert "Traceback" not in lighthouse.log()


def test_registrations_faster_than_the_rate_limit_are_refused() -> None:
    with Lighthouse(PLAN, token=TOKEN, max_members=8) as server:
        code, first = register(server.url, "churn")
        assert code == 200
        headers, refused = first["headers"], 0
        for _ in range(400):  # each replaces the last with its secret: the lighthouse saves and records a failure
            code, body = register(server.url, "churn", headers)
            if code == 200:
                headers = body["headers"]
            else:
                assert code == 429 and body["code"] == "rate_limited" and body["retry_after"] > 0, body
                refused += 1
        assert refused > 0
        assert len(server.status()["failures"]) < 400


# --- 5. identity ------------------------------------------------------------------------------------------------


def test_a_token_holder_cannot_evict_a_live_member(lighthouse: LighthouseProcess, honest: Honest) -> None:
    code, body = register(lighthouse.url, "b")
    assert code == 409 and body["code"] == "member_alive", body
    after = status(lighthouse.url)
    assert after["failures"] == [] and not after["reconfigure_pending"]
    assert {m["member"]: m["state"] for m in after["members"]} == {"a": "alive", "b": "alive"}
    honest.advance(3)


# --- 6. safe defaults -------------------------------------------------------------------------------------------


def test_a_lighthouse_reachable_from_the_network_needs_a_token_or_insecure(tmp_path: Path) -> None:
    refused = LighthouseProcess(tmp_path, "--host", "0.0.0.0", token=None, wait=False)
    try:
        assert refused.process.wait(BOUND) == 1
        assert "no token is set" in refused.log() and "--insecure" in refused.log()
    finally:
        refused.stop()
    allowed = LighthouseProcess(tmp_path, "--host", "0.0.0.0", "--insecure", token=None)
    try:
        healthz(f"http://{HOST}:{allowed.port}")
    finally:
        allowed.stop()


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, written to ``folder`` (skips the test without ``openssl``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=BOUND,
    )  # fmt: skip
    return cert, key


def test_tls_serves_the_lighthouse_and_the_quorum_store_to_workers_that_verify_it(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    lighthouse = LighthouseProcess(tmp_path, "--min-replicas", "1", "--tls-cert", str(cert), "--tls-key", str(key))
    url = f"https://{HOST}:{lighthouse.port}"
    try:
        with pytest.raises(Exception):  # noqa: B017 - plain HTTP to a TLS port: no answer, whatever the error
            urllib.request.urlopen(f"http://{HOST}:{lighthouse.port}/healthz", timeout=10)
        # a client that does not trust the certificate: refused, and the error says why
        with pytest.raises(LighthouseUnreachable, match="certificate verify failed"):
            untrusting = LighthouseClient(url, "x", token=TOKEN, register_timeout=1.0)
            try:
                untrusting.identity_headers()
            finally:
                untrusting.close()
        from stalwart.runtime.comm import quorum_store

        client = LighthouseClient(url, "a", token=TOKEN, heartbeat_interval=0.05, ca_file=cert)
        try:
            client.start_heartbeat(lambda: 0)
            answer = client.quorum(0, None, "join", BOUND)
            assert answer.store.url == url
            store = quorum_store(answer.store, 10.0, token=TOKEN, ssl_context=client.ssl_context)
            store.set("over-tls", b"yes")
            assert bytes(store.get("over-tls")) == b"yes"
        finally:
            client.close()
    finally:
        lighthouse.stop()


def test_the_dashboard_cookie_is_scoped_to_its_port_and_secure_under_tls(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    import ssl

    with Lighthouse(PLAN, token=TOKEN, tls_cert=cert, tls_key=key) as server:
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{server.url}/?token={TOKEN}", timeout=BOUND, context=context) as response:
            cookie = response.headers["Set-Cookie"]
    assert cookie.startswith(f"stalwart_token_{server.port}=") and "Secure" in cookie and "HttpOnly" in cookie


def test_tokens_are_never_on_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import stalwart.cli.demo as demo

    seen: dict[str, Any] = {}

    class Recorded(Exception):
        pass

    class Recording:
        def __init__(self, url: str, run_dir: Path, worker_args: list[str], worker_env: Any = None) -> None:
            seen["args"] = worker_args
            seen["env"] = {} if worker_env is None else dict(worker_env(0))
            raise Recorded

    monkeypatch.setattr(demo, "LocalCluster", Recording)
    result = CliRunner().invoke(demo.demo_command, ["--token", "demo-secret-token", "--workers", "2", "--steps", "4"])
    assert isinstance(result.exception, Recorded), result.output
    assert "demo-secret-token" not in " ".join(seen["args"]), "the workers' command lines carry no token"
    assert seen["env"] == {"STALWART_LIGHTHOUSE_TOKEN": "demo-secret-token"}
    root = Path(__file__).resolve().parents[2]
    for text in (root / "README.md", *sorted((root / "deploy").rglob("*"))):
        if text.is_file():
            assert not re.search(r"--token[ =][\"']?\$", text.read_text()), f"{text} puts a token on a command line"


# --- 7. the state file ------------------------------------------------------------------------------------------


def test_a_second_lighthouse_on_the_same_state_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    first = LighthouseProcess(tmp_path, "--state", str(state))
    honest = Honest(first.url)
    try:
        honest.advance(1)
        second = LighthouseProcess(tmp_path, "--state", str(state), wait=False)
        try:
            assert second.process.wait(BOUND) == 1, second.log()
            assert f"pid {first.process.pid}" in second.log(), "the refusal names the holder"
        finally:
            second.stop()
        honest.advance(2)
        for suffix in ("", "-wal", "-shm", ".lock"):
            path = Path(f"{state}{suffix}")
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path} must be readable by its owner only"
    finally:
        honest.close()
        first.stop()


# --- 8. validated store data ------------------------------------------------------------------------------------


def test_a_garbage_group_size_in_the_store_is_a_failed_collective(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    from stalwart.runtime.comm import CollectiveError, quorum_store
    from stalwart.runtime.session import _group_sizes

    answer: QuorumAnswer = honest.answers["a"]
    store = quorum_store(answer.store, 5.0, token=TOKEN)
    store.set("group_size/c", b"2")
    for garbage in (b"1000000", b"-1", b"abc", b"\xff", b"1" * 5000):
        store.set("group_size/b", garbage)
        with pytest.raises(CollectiveError, match=r"'group_size/b'|member 'b' announced group size"):
            _group_sizes(store, ["c", "b"])  # one multi_get through the lighthouse
    store.set("group_size/b", b"1")
    assert _group_sizes(store, ["c", "b"]) == [2, 1]


# --- 9. the attacks of issue 36 ---------------------------------------------------------------------------------


def exits(process: LighthouseProcess) -> int:
    """The exit status of a lighthouse that must refuse to start (an AssertionError when it serves instead)."""
    wait_until(lambda: process.process.poll() is not None or "listening on" in process.log(), BOUND, "its verdict")
    assert process.process.poll() is not None, f"it serves: {process.log()}"
    return process.process.returncode


def one_line(process: LighthouseProcess) -> str:
    """The one line a refused start printed (no traceback)."""
    lines = [line for line in process.log().splitlines() if line.strip()]
    assert len(lines) == 1, process.log()
    return lines[0]


def test_a_store_answer_is_capped_and_a_key_named_twice_is_refused(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    from stalwart.coord.store import StoreLimits
    from stalwart.runtime.comm import quorum_store
    from stalwart.runtime.session import _group_sizes

    answer = honest.answers["a"]
    store = quorum_store(answer.store, 30.0, token=TOKEN)
    path, key = f"{lighthouse.url}/v1/store/{answer.quorum_id}", {"X-Stalwart-Store-Key": answer.store.key}
    store.set("big", b"x" * 32 * 1024)
    code, body = http(path, "POST", {"op": "multi_get", "keys": ["big"] * 4096, "wait": 0}, key)
    assert code == 400 and body["field"] == "keys" and "'big'" in body["error"], (code, str(body)[:300])
    cap, part = StoreLimits().answer_bytes, 6 << 20
    for number in range(3):
        store.set(f"part{number}", bytes([number]) * part)
    code, body = http(path, "POST", {"op": "multi_get", "keys": ["part0", "part1", "part2"], "wait": 0}, key)
    assert code == 413 and body["cap"] == "answer_bytes", (code, str(body)[:300])
    assert str(cap) in body["error"] and str(3 * part) in body["error"], "the refusal names the limit and the size"
    assert [len(value) for value in store.multi_get(["part0", "part1"])] == [part, part], "under the cap: served"
    store.set("group_size/a", b"1")
    store.set("group_size/b", b"2")
    assert _group_sizes(store, ["a", "b"]) == [1, 2], "the runtime's own multi_get still works"
    honest.advance(3)


def test_a_second_lighthouse_on_a_link_to_the_state_file_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    first = LighthouseProcess(tmp_path, "--state", str(state))
    honest = Honest(first.url)
    try:
        honest.advance(1)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        symlink, hardlink = elsewhere / "symlink.db", elsewhere / "hardlink.db"
        symlink.symlink_to(state)
        os.link(state, hardlink)
        for link in (symlink, hardlink):
            second = LighthouseProcess(tmp_path, "--state", str(link), wait=False)
            try:
                assert exits(second) == 1
                line = one_line(second)
                assert str(link) in line and "in use" in line and f"pid {first.process.pid}" in line, line
            finally:
                second.stop()
        honest.advance(2)
    finally:
        honest.close()
        first.stop()


def test_a_lighthouse_on_the_network_without_tls_refuses_to_start_unless_insecure(tmp_path: Path) -> None:
    refused = LighthouseProcess(tmp_path, "--host", "0.0.0.0", wait=False)  # a token, but no TLS
    try:
        assert exits(refused) == 1
        line = one_line(refused)
        for needle in ("0.0.0.0", "--tls-cert", "--tls-key", "--insecure"):
            assert needle in line, line
    finally:
        refused.stop()
    allowed = LighthouseProcess(tmp_path, "--host", "0.0.0.0", "--insecure")
    try:
        healthz(f"http://{HOST}:{allowed.port}")
    finally:
        allowed.stop()


def test_a_token_file_or_tls_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cert, key = self_signed_certificate(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    for path, mode, flags in ((token_file, 0o644, ("--token-file", str(token_file))), (key, 0o640, tls)):
        path.chmod(mode)
        refused = LighthouseProcess(tmp_path, *flags, token=None, wait=False)
        try:
            assert exits(refused) == 1
            line = one_line(refused)
            assert str(path) in line and oct(mode)[2:] in line and f"chmod 600 {path}" in line, line
        finally:
            refused.stop()
        path.chmod(0o600)
    allowed = LighthouseProcess(tmp_path, "--token-file", str(token_file), *tls, token=None)
    allowed.stop()


def raw(port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, Any]:
    """One request with exactly these headers (``Host`` included, as a browser under DNS rebinding sends it)."""
    import http.client

    connection = http.client.HTTPConnection(HOST, port, timeout=BOUND)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body or b"")))
        connection.endheaders(body)
        response = connection.getresponse()
        text = response.read()
        return response.status, json.loads(text) if text.startswith(b"{") else text
    finally:
        connection.close()


def test_without_a_token_a_browser_page_of_another_site_cannot_reach_the_lighthouse() -> None:
    with Lighthouse(PLAN, min_replicas=1) as server:  # loopback, no token: the default
        port = server.port
        register = json.dumps({"member": "mallory", "incarnation": uuid.uuid4().hex}).encode()
        rebound = {"Host": f"attacker.example:{port}"}  # DNS rebinding: the attacker's name, our address
        for path in ("/healthz", "/v1/status", "/", "/metrics"):
            code, body = raw(port, "GET", path, rebound)
            assert code == 403 and "attacker.example" in str(body), (path, code, body)
        code, body = raw(port, "POST", "/v1/register", {**rebound, "Content-Type": "application/json"}, register)
        assert code == 403, (code, body)
        here = {"Host": f"127.0.0.1:{port}"}
        origin = {**here, "Origin": "http://attacker.example", "Content-Type": "application/json"}
        code, body = raw(port, "POST", "/v1/register", origin, register)
        assert code == 403 and "http://attacker.example" in body["error"], (code, body)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            code, body = raw(port, "POST", "/v1/register", {**here, "Content-Type": content_type}, register)
            assert code == 415 and content_type.split(";")[0] in body["error"], (content_type, code, body)
        code, body = raw(port, "POST", "/v1/register", here, register)  # no Content-Type at all (a Blob body)
        assert code == 415, (code, body)
        assert server.status()["members"] == [], "no request registered mallory"
        for host in (f"localhost:{port}", f"127.0.0.2:{port}", "[::1]", "LOCALHOST"):
            assert raw(port, "GET", "/healthz", {"Host": host})[0] == 200, host
        local = {**here, "Origin": f"http://localhost:{port}", "Content-Type": "application/json; charset=utf-8"}
        code, body = raw(port, "POST", "/v1/register", local, register)
        assert code == 200 and body["member"] == "mallory", (code, body)


def test_a_heartbeat_with_a_number_of_400_digits_is_refused_and_the_socket_serves_on(
    lighthouse: LighthouseProcess, honest: Honest
) -> None:
    code, mallory = register(lighthouse.url, "mallory")
    assert code == 200
    message = {"applied_step": 0, "heal": {"heals": 1, "bytes": 10**400, "seconds": 1.0}}

    async def send() -> list[str]:
        errors = []
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
            session.ws_connect(
                lighthouse.url + "/v1/heartbeat", params={"member": "mallory"}, headers=mallory["headers"]
            ) as ws,
        ):
            for text in (json.dumps(message), json.dumps({"applied_step": 10**400}), "not json"):
                await ws.send_str(text)
                for _ in range(20):  # a reconfigure push may come first
                    reply = await ws.receive(timeout=BOUND)
                    assert reply.type == aiohttp.WSMsgType.TEXT, f"the socket closed: {reply}"
                    if json.loads(reply.data)["type"] == "error":
                        errors.append(json.loads(reply.data)["error"])
                        break
        return errors

    heal, step, text = asyncio.run(send())
    assert "heal['bytes']" in heal and "1000000000" in heal, heal
    assert "applied_step" in step and "1000000000" in step, step
    assert "JSON" in text, text
    healthz(lighthouse.url)
    honest.advance(3)
    assert "Traceback" not in lighthouse.log() and "OverflowError" not in lighthouse.log()
