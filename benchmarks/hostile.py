"""``/healthz`` latency while a hostile client sends each attack of ``test_hostile.py`` to a lighthouse.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.hostile             # every attack, about a minute
    python -m benchmarks.hostile --repeat 3  # each attack three times (the spread)

A lighthouse process (``stalwart lighthouse`` with a token and a state file)
serves three honest members (real ``LighthouseClient``s that formed a quorum
and commit steps). For each attack, a probe (a process of its own) asks
``GET /healthz`` over one kept-alive connection, one request after the other,
while the attacker sends
its messages as fast as it can; the table shows the probe's latency (median,
99th percentile and the longest) during the attack, next to the same with no
attack, and that the honest members still committed their next step.
Latency here is the time the event loop takes to get to the probe: what one
hostile message can hold it for.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks._measure import make_console, print_table
from stalwart.coord.client import LighthouseClient
from stalwart.coord.protocol import heartbeat_message, ledger_digest
from stalwart.testing.loopback import free_port

HOST = "127.0.0.1"
TOKEN = "hostile-benchmark-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PLAN_FLAGS = ["--dataset-size", "100000", "--global-batch", "16", "--seed", "7"]


class Target:
    """A lighthouse process, three honest members committing steps, and what an attacker can see of them."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        command = [sys.executable, "-m", "stalwart.cli.lighthouse", "--min-replicas", "3", "--port", str(self.port)]
        command += ["--state", str(folder / "state.db"), "--heartbeat-timeout", "5", "--join-timeout", "2", *PLAN_FLAGS]
        self.log = open(folder / "lighthouse.log", "wb")  # noqa: SIM115 - kept for the process's life
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "STALWART_LIGHTHOUSE_TOKEN": TOKEN}
        )
        for _ in range(600):
            if b"listening on" in (folder / "lighthouse.log").read_bytes():
                break
            time.sleep(0.05)
        self.steps = {m: 0 for m in ("a", "b", "c")}
        self.clients = {m: LighthouseClient(self.url, m, token=TOKEN, heartbeat_interval=0.05) for m in self.steps}
        self.answers: dict[str, Any] = {}
        for member, client in self.clients.items():
            client.start_heartbeat(lambda member=member: self._report(member))
        threads = [threading.Thread(target=self._join, args=(m,)) for m in self.clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)

    def _join(self, member: str) -> None:
        self.answers[member] = self.clients[member].quorum(0, None, "join", 120)

    def _report(self, member: str) -> tuple[int, str | None]:
        step = self.steps[member]
        answer = self.answers.get(member)
        if answer is None or step <= answer.applied_step:
            return step, None
        ledger = answer.data_ledger()
        while ledger.step < step:
            if not ledger.in_step:
                ledger.begin_step(list(answer.members))
            ledger.commit()
        return step, ledger_digest(ledger.state_dict())

    def committed(self) -> int:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=60)
        connection.request("GET", "/v1/status", headers=AUTH)
        return int(json.loads(connection.getresponse().read())["ledger"]["step"])

    def advance(self) -> bool:
        """The honest members report one more step: whether the lighthouse commits it within 30 s."""
        target = max(self.steps.values()) + 1
        for member in ("a", "b"):
            self.steps[member] = target
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.committed() >= target:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        self.log.close()


def register(target: Target, member: str) -> dict[str, str]:
    incarnation = uuid.uuid4().hex
    connection = http.client.HTTPConnection(HOST, target.port, timeout=60)
    body = json.dumps({"member": member, "incarnation": incarnation})
    connection.request("POST", "/v1/register", body, {**AUTH, "Content-Type": "application/json"})
    answer = json.loads(connection.getresponse().read())
    return {"X-Stalwart-Incarnation": incarnation, "X-Stalwart-Secret": answer.get("secret", "")}


def _raw(target: Target, payload: bytes) -> None:
    with socket.create_connection((HOST, target.port), timeout=30) as peer:
        peer.sendall(payload)
        peer.recv(256)


async def _sockets(target: Target, member: str, headers: dict[str, str], messages: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession(headers=AUTH) as session,
        session.ws_connect(target.url + "/v1/heartbeat", params={"member": member}, headers=headers) as ws,
    ):
        for message in messages:
            await ws.send_str(json.dumps(message))
        await asyncio.sleep(0.5)


def attack_none(target: Target) -> int:
    time.sleep(1.0)
    return 0


def attack_heal_totals(target: Target) -> int:
    headers = register(target, "mallory-heals")
    messages = [heartbeat_message(0, heal={"heals": 10**12 * (n + 1), "bytes": 1, "seconds": 1.0}) for n in range(200)]
    asyncio.run(_sockets(target, "mallory-heals", headers, messages))
    return len(messages)


def attack_far_ahead_digest(target: Target) -> int:
    member = target.answers["c"].members[-1]
    headers = target.clients[member].identity_headers()
    target.clients[member].close()  # the hostile member takes the quorum member's identity and socket
    committed = target.committed()
    messages = [heartbeat_message(committed + 99_999 - n, f"{n:032x}") for n in range(50)]
    asyncio.run(_sockets(target, member, headers, messages))
    return len(messages)


def attack_half_sent(target: Target) -> int:
    peers = []
    for number in range(300):
        peer = socket.create_connection((HOST, target.port), timeout=30)
        if number % 16:
            peer.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        peers.append(peer)
    time.sleep(1.0)
    for peer in peers:
        peer.close()
    return len(peers)


def attack_store_without_credentials(target: Target) -> int:
    body = json.dumps({"op": "get", "key": "group_size/a", "wait": 0})
    quorum = target.answers["a"].quorum_id
    connection = http.client.HTTPConnection(HOST, target.port, timeout=30)
    for number in range(500):
        headers = {"Content-Type": "application/json", "X-Stalwart-Store-Key": "x" * 43}
        if number % 2:
            headers.update(AUTH)
        connection.request("POST", f"/v1/store/{quorum}", body, headers)
        connection.getresponse().read()
    return 500


def attack_store_large_values(target: Target) -> int:
    """A quorum member (it holds the key) writes and reads 8 MiB values: decoded and encoded off the loop."""
    answer = target.answers["a"]
    value = base64.b64encode(os.urandom(8 << 20)).decode()
    headers = {**AUTH, "Content-Type": "application/json", "X-Stalwart-Store-Key": answer.store.key}
    connection = http.client.HTTPConnection(HOST, target.port, timeout=60)
    for number in range(6):
        connection.request(
            "POST",
            f"/v1/store/{answer.quorum_id}",
            json.dumps({"op": "set", "key": f"big{number}", "value": value}),
            headers,
        )
        connection.getresponse().read()
        connection.request(
            "POST",
            f"/v1/store/{answer.quorum_id}",
            json.dumps({"op": "get", "key": f"big{number}", "wait": 0}),
            headers,
        )
        connection.getresponse().read()
    return 12


def attack_store_repeated_keys(target: Target) -> int:
    """A quorum member asks for a 32 KiB value 4,096 times in one multi_get (171 MiB of answer before the cap)."""
    answer = target.answers["a"]
    headers = {**AUTH, "Content-Type": "application/json", "X-Stalwart-Store-Key": answer.store.key}
    connection = http.client.HTTPConnection(HOST, target.port, timeout=60)
    path = f"/v1/store/{answer.quorum_id}"
    value = base64.b64encode(os.urandom(32 << 10)).decode()
    connection.request("POST", path, json.dumps({"op": "set", "key": "wide", "value": value}), headers)
    connection.getresponse().read()
    for _ in range(4):
        connection.request("POST", path, json.dumps({"op": "multi_get", "keys": ["wide"] * 4096, "wait": 0}), headers)
        connection.getresponse().read()
    return 5


def attack_binary_header(target: Target) -> int:
    payload = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
    for _ in range(200):
        _raw(target, payload)
    return 200


def attack_registration_burst(target: Target) -> int:
    for number in range(300):
        register(target, f"burst-{number}")
    return 300


def attack_one_identity_polls(target: Target) -> int:
    headers = register(target, "mallory-polls")
    body = json.dumps({"member": "mallory-polls", "applied_step": 0, "quorum_id": None, "reason": "join"})

    async def polls() -> None:
        async with aiohttp.ClientSession(headers={**AUTH, **headers}) as session:

            async def one() -> None:
                async with session.post(target.url + "/v1/quorum", data=body, timeout=aiohttp.ClientTimeout(5)):
                    pass

            await asyncio.gather(*(one() for _ in range(200)), return_exceptions=True)

    asyncio.run(polls())
    return 200


ATTACKS: list[tuple[str, Callable[[Target], int]]] = [
    ("none (baseline)", attack_none),
    ("heartbeat heal totals of 10^12 heals", attack_heal_totals),
    ("store requests without token or key", attack_store_without_credentials),
    ("a quorum member's 8 MiB store values", attack_store_large_values),
    ("a multi_get naming a 32 KiB key 4,096 times", attack_store_repeated_keys),
    ("non-UTF-8 Authorization headers", attack_binary_header),
    ("300 half-sent and silent connections", attack_half_sent),
    ("registration burst (fresh names)", attack_registration_burst),
    ("one identity's quorum long polls", attack_one_identity_polls),
    ("digest reports 100,000 steps ahead", attack_far_ahead_digest),
]


def _probe(port: int, ready: Any, stop: Any, latencies: Any) -> None:
    """``GET /healthz`` one after the other until ``stop`` is set (a process of its own: no GIL shared with the
    attacker); the seconds each took go to ``latencies``."""
    taken: list[float] = []
    connection = http.client.HTTPConnection(HOST, port, timeout=120)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()
        except (OSError, http.client.HTTPException):
            connection.close()
            connection = http.client.HTTPConnection(HOST, port, timeout=120)
            continue
        taken.append(time.perf_counter() - started)
        ready.set()
        time.sleep(0.002)
    latencies.put(taken)


def measure(target: Target, attack: Callable[[Target], int]) -> dict[str, Any]:
    """The probe's latencies while ``attack`` runs, the messages it sent, and whether a step commits after."""
    context = multiprocessing.get_context("spawn")
    ready, stop, latencies = context.Event(), context.Event(), context.Queue()
    probe = context.Process(target=_probe, args=(target.port, ready, stop, latencies))
    probe.start()
    ready.wait(120)  # the probe answers before the attack starts
    try:
        sent = attack(target)
    finally:
        stop.set()
        taken = latencies.get(timeout=180)
        probe.join(60)
    return {"sent": sent, "latencies": taken, "goes_on": target.advance()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole set, each on a fresh lighthouse")
    args = parser.parse_args()
    console = make_console()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in ATTACKS}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as folder:
            target = Target(Path(folder))
            try:
                target.advance()
                for name, attack in ATTACKS:
                    results[name].append(measure(target, attack))
            finally:
                target.close()
    rows = []
    for name, runs in results.items():
        latencies = sorted(value for run in runs for value in run["latencies"])
        if not latencies:
            rows.append([name, str(runs[0]["sent"]), "-", "-", "-", "-"])
            continue
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        rows.append([
            name, str(sum(run["sent"] for run in runs)), f"{statistics.median(latencies) * 1e3:.1f}",
            f"{p99 * 1e3:.1f}", f"{latencies[-1] * 1e3:.1f}", "yes" if all(run["goes_on"] for run in runs) else "NO",
        ])  # fmt: skip
    print_table(
        console,
        "/healthz latency while a hostile client sends each attack (ms)",
        ["attack", "messages", "p50", "p99", "max", "next step committed"],
        rows,
        caption=f"{args.repeat} run(s); the probe asks one request after the other on a kept-alive connection.",
    )


if __name__ == "__main__":
    main()
