"""Load benchmark of one lighthouse: thousands of simulated members over real websockets on 127.0.0.1.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.lighthouse_scale                       # 256 ... 4096 members, a few minutes
    python -m benchmarks.lighthouse_scale --members 256 1024    # some sizes only
    python -m benchmarks.lighthouse_scale --report out/scale.json --compare out/scale-before.json

The lighthouse runs in a process of its own (SQLite state file, the server's
defaults but ``start_replicas`` = the member count). The members are asyncio
clients (aiohttp) spread over ``--processes`` processes: each registers, keeps
its heartbeat websocket, reports its applied step with its ledger digest (the
driver advances the step every ``--step-seconds``, so the lighthouse commits
and persists), and asks for quorums the way a worker does (on its heartbeat
socket; ``--asks post``: ``POST /v1/quorum``, as workers did before): ``join`` at
start-up, ``failure`` as soon as the broken-quorum push arrives. They build
and read every message with the client's own protocol code
(:mod:`stalwart.coord.protocol`: headers, registration, heartbeats, quorum
requests and answers), without its thread per client. Each process replays
the ledger once per quorum for the digests, as every worker does.

Per member count it reports: members joined and how long the start-up took;
heartbeat messages per second sent and how stale the lighthouse's view got;
the lighthouse's CPU and memory; ``/healthz`` latency while heartbeats flow;
then one member's socket closed (a SIGKILLed process): quorum formation
latency (the failure seen to the quorum formed, the lighthouse's clock) and
the broken-quorum push latency to every survivor; then a quarter of the
members closed at once: the longest ``/healthz`` stall, formation and push
latency, and how many quorums formed. ``--heartbeat-interval recommended``
(the default) uses the interval the lighthouse recommends for the fleet
(``heartbeat_interval`` in the register answer); ``--wire 1`` asks for the
legacy full quorum answer. Every wait is bounded; a phase that does not finish
in time is reported as missing, never waited on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks._measure import Goal, make_console, print_goals, print_table
from stalwart.coord.asks import MAX_ANSWER_BYTES, SocketAsks
from stalwart.coord.protocol import (
    HEARTBEAT_PATH,
    QUORUM_PATH,
    REGISTER_PATH,
    QuorumAnswer,
    QuorumRequest,
    StoreAddress,
    heartbeat_message,
    identity_headers,
    ledger_digest,
    register_body,
)
from stalwart.coord.settings import AHEAD_SETTLE_S
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.loopback import free_port

SIZES = (256, 512, 1024, 2048, 4096)
LOCAL_BATCH = 32
"""Positions per member per step: the global batch grows with the fleet (as the answer's ledger does)."""
PHASE_LIMIT = 60.0
"""Seconds any single phase may take (a bound, not an expectation)."""
PROBE_INTERVAL = 0.005
QUIET_COLLECTION = re.compile(r"^([0-9.]+) \S+: INFO full garbage collection while quiet: \d+ objects freed in (\d+)")
OBSERVERS = 32
"""Members in a process of their own that does little else: their push and answer times are the lighthouse's,
not the time a process running a thousand simulated members takes to get to them."""
DEFAULT_INTERVAL = 0.1
"""The simulated members' own heartbeat interval, slower when the lighthouse recommends it: 0.1 s, as a member
given ``heartbeat_interval=0.1`` beats (the client's default is a quarter of the heartbeat timeout, 0.5 s), so the
fleet is measured at the heavier load, as in the figures before that default changed."""
FORM_GOAL_MS = 200.0
PUSH_GOAL_MS = 100.0
STALL_GOAL_MS = 100.0


def plan_for(members: int) -> EpochPlan:
    """The job's plan: ``LOCAL_BATCH`` positions per member per step, an epoch far longer than the run."""
    return EpochPlan(1 << 40, LOCAL_BATCH * members, seed=0, shuffle=False)


def _prepare_process() -> None:
    """Raise the open-files limit; switch the cyclic garbage collector off, so its pauses are not measured.

    For the member processes and the driver only: they are the instruments
    (a pause there would count as the lighthouse's latency) and live for one
    bounded run. The lighthouse keeps its own collector (``serve_forever``).
    """
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gc.collect()
    gc.freeze()
    gc.disable()


# --- the lighthouse process --------------------------------------------------------------------------------------


def _serve(
    port: int,
    members: int,
    state_path: str,
    log_path: str,
    heartbeat_timeout: float,
    join_timeout: float,
    ahead_settle: float | None,
    lighthouse_core: int | None,
    lighthouse_nice: int,
) -> None:
    """The lighthouse process: serve until SIGTERM, logging to ``log_path`` (its full collections among it); on
    ``lighthouse_core`` alone when given (the driver and the members keep the other cores), at ``lighthouse_nice``
    (below 0: before the members whenever it is runnable, as on a host of its own; needs root)."""
    if lighthouse_core is not None:
        os.sched_setaffinity(0, {lighthouse_core})
    if lighthouse_nice:
        os.setpriority(os.PRIO_PROCESS, 0, lighthouse_nice)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    logging.basicConfig(
        filename=log_path, level=logging.INFO, format="%(created).3f %(name)s: %(levelname)s %(message)s"
    )
    from stalwart.coord.server import Lighthouse

    lighthouse = Lighthouse(
        plan_for(members),
        min_replicas=1,
        start_replicas=members,
        port=port,
        state_path=state_path,
        heartbeat_timeout=heartbeat_timeout,
        join_timeout=join_timeout,
        max_members=members + 64,
        max_waiters=members + 64,
        ahead_settle=ahead_settle,
    )
    lighthouse.serve_forever()


@dataclass
class ProcessUsage:
    """CPU seconds and memory of a process, read from ``/proc``."""

    pid: int

    def cpu_seconds(self) -> float:
        """User plus system CPU seconds so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mib(self) -> tuple[float, float]:
        """``(resident now, peak resident)`` in MiB."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
        return values["VmRSS"], values["VmHWM"]


# --- the member processes ----------------------------------------------------------------------------------------


@dataclass
class Sim:
    """One simulated member: its identity, heartbeat socket and what it saw."""

    name: str
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    secret: str = ""
    socket: aiohttp.ClientWebSocketResponse | None = None
    quorum_id: int | None = None
    dead: bool = False
    asking: bool = False
    pushed_at: float | None = None
    asked_at: float | None = None
    """When its quorum request first went out (after a push: its process's queueing included)."""
    answered_at: float | None = None
    refused: int = 0
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    asks: SocketAsks = field(default_factory=SocketAsks)
    """Its quorum requests on the heartbeat socket, as the client's."""

    def headers(self) -> dict[str, str]:
        """The identity headers."""
        return identity_headers(self.incarnation, self.secret)


class Fleet:
    """The simulated members of one process, driven by commands from the driver over a pipe."""

    def __init__(
        self, connection: Connection, names: Sequence[str], url: str, wire: int, interval: float | None, asks: str
    ):
        self.connection = connection
        self.asks = asks
        self.url = url
        self.wire = wire
        self.fixed_interval = interval
        self.interval = interval or DEFAULT_INTERVAL
        self.sims = {name: Sim(name) for name in names}
        self.session: aiohttp.ClientSession | None = None
        self.quorums: dict[int, Any] = {}
        """What this process knows of each quorum: ``(members, ledger state in its applied step)``."""
        self.step = 0
        self.report = json.dumps(heartbeat_message(0))
        self.digest: str | None = None
        self.sent = 0
        self.answer_bytes: list[int] = []
        self.errors: list[str] = []
        self.retried: dict[int | str, int] = {}
        """Quorum requests asked again, by the status that made them (408: nothing formed yet, 503: busy)."""
        self.first_retried: dict[int, str] = {}
        """The first answer of each status asked again."""

    async def serve(self) -> None:
        """Answer the driver's commands until ``stop``."""
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # as LighthouseClient's: a connection per request
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=PHASE_LIMIT))
        try:
            while True:
                command, *args = await loop.run_in_executor(None, self.connection.recv)
                if command == "stop":
                    break
                try:
                    result = await getattr(self, command)(*args)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as error:
                    # the driver records it and goes on to the next member count (a loaded machine times out)
                    result = {"failed": f"{command}: {type(error).__name__}: {error}"[:300]}
                self.connection.send(result)
        finally:
            for sim in self.sims.values():
                for task in sim.tasks:
                    task.cancel()
            await self.session.close()

    def live(self) -> list[Sim]:
        """The members not killed."""
        return [sim for sim in self.sims.values() if not sim.dead]

    async def register(self) -> dict[str, Any]:
        """Register every member and open its heartbeat socket, as a worker starting does.

        The register answer's recommended heartbeat interval is adopted (unless
        the driver fixed one) before any heartbeat goes out.
        """
        assert self.session is not None
        session = self.session
        adopted = asyncio.Event()
        if self.fixed_interval is not None:
            adopted.set()

        async def one(sim: Sim) -> None:
            body = register_body(sim.name, sim.incarnation, None)
            deadline = time.monotonic() + PHASE_LIMIT
            while True:  # a connection closed before its answer is asked again, as LighthouseClient does
                try:
                    async with session.post(self.url + REGISTER_PATH, json=body) as response:
                        data = await response.json()
                        if response.status != 200:
                            raise RuntimeError(f"register {sim.name}: {response.status} {data}")
                        sim.secret = data["secret"]
                        break
                except aiohttp.ClientConnectionError:
                    self.retried["closed"] = self.retried.get("closed", 0) + 1
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.05)
            if not adopted.is_set():
                if "heartbeat_interval" not in data:
                    raise RuntimeError("this lighthouse recommends no heartbeat interval: pass --heartbeat-interval")
                self.interval = max(DEFAULT_INTERVAL, float(data["heartbeat_interval"]))
                adopted.set()
            sim.socket = await session.ws_connect(
                self.url + HEARTBEAT_PATH,
                params={"member": sim.name},
                headers=sim.headers(),
                heartbeat=None,
                max_msg_size=MAX_ANSWER_BYTES,
            )
            sim.asks.attach(sim.socket)
            sim.tasks += [asyncio.create_task(self._beat(sim)), asyncio.create_task(self._receive(sim))]

        await _bounded_gather(one(sim) for sim in self.sims.values())
        return {"interval": self.interval}

    async def _beat(self, sim: Sim) -> None:
        assert sim.socket is not None
        await asyncio.sleep(random.uniform(0, self.interval))
        due = time.monotonic()
        while not sim.dead and not sim.socket.closed:
            await sim.socket.send_str(self.report)
            self.sent += 1
            due += self.interval
            now = time.monotonic()
            if due < now:
                due = now  # behind: skip, do not burst
            await asyncio.sleep(due - now)

    async def _receive(self, sim: Sim) -> None:
        assert sim.socket is not None
        async for message in sim.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if data.get("type") == "answer":
                sim.asks.answered(data, len(message.data))
                continue
            if data.get("type") != "reconfigure" or not data.get("broken") or data.get("quorum_id") != sim.quorum_id:
                continue
            if sim.pushed_at is None:
                sim.pushed_at = time.time()
            if not sim.asking and not sim.dead:  # a heartbeat's reply says "broken" too: ask once
                sim.asking = True
                sim.tasks.append(asyncio.create_task(self._ask(sim, "failure")))

    async def _ask(self, sim: Sim, reason: str) -> None:
        """Ask for the next quorum until answered (408 and 503 are asked again), as ``LighthouseClient`` does."""
        assert self.session is not None
        sim.asking = True
        digest = self.digest if reason != "join" else None  # the request may commit the step, as the heartbeat would
        request = QuorumRequest(sim.name, self.step, sim.quorum_id, reason, digest, wire=self.wire, known=sim.quorum_id)
        body = request.to_body()
        deadline = time.monotonic() + PHASE_LIMIT
        sim.asked_at = time.time()
        try:
            while not sim.dead and time.monotonic() < deadline:
                try:
                    status, data, size = await self._request(sim, body)
                except aiohttp.ClientConnectionError:  # closed before its answer: asked again, as the client does
                    self.retried["closed"] = self.retried.get("closed", 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                if status in (408, 503):
                    if status not in self.retried:
                        self.first_retried[status] = repr(data)[:200]
                    self.retried[status] = self.retried.get(status, 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                if status != 200:
                    sim.refused += 1
                    self.errors.append(f"{sim.name}: {status} {repr(data)[:200]}")
                    return
                self.answer_bytes.append(size)
                self._learn(data, sim.quorum_id)
                sim.quorum_id = data["quorum_id"]
                sim.answered_at = time.time()
                return
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            sim.refused += 1
            self.errors.append(f"{sim.name}: {type(error).__name__}: {error}"[:300])
        finally:
            sim.asking = False

    async def _request(self, sim: Sim, body: dict[str, Any]) -> tuple[int, Any, int]:
        """One quorum request: on ``sim``'s heartbeat socket (``--asks socket``, as the client asks while its socket
        is open) or by POST; the status, the answer's JSON and its size in bytes."""
        assert self.session is not None and sim.socket is not None
        if self.asks == "post":
            async with self.session.post(self.url + QUORUM_PATH, json=body, headers=sim.headers()) as response:
                raw = await response.read()
                try:
                    return response.status, json.loads(raw), len(raw)
                except ValueError:
                    return response.status, raw[:200], len(raw)
        ask = sim.asks.message(body)
        if ask is None:
            raise RuntimeError(f"{sim.name}: a quorum request that does not fit a socket message")
        answer = await sim.asks.ask(*ask)
        if answer is None:  # the socket closed first
            raise aiohttp.ClientConnectionError("the heartbeat socket closed before the answer")
        return answer

    def _learn(self, data: dict[str, Any], known: int | None) -> None:
        """Keep what this process needs of a quorum it first hears of: its members and ledger."""
        if data["quorum_id"] in self.quorums:
            return
        previous = None
        if known in self.quorums:
            members, ledger = self.quorums[known]
            previous = QuorumAnswer(known, members, 0, len(members), StoreAddress(self.url, known, ""), 0, None, ledger)
        answer = QuorumAnswer.from_json(data, previous, url=self.url)
        self.quorums[answer.quorum_id] = (answer.members, answer.ledger)

    async def join(self) -> dict[str, Any]:
        """Every member asks to join; returns when all are answered (or the phase limit passes)."""
        started = time.time()
        await asyncio.gather(*(self._ask(sim, "join") for sim in self.sims.values()))
        answered = [sim.answered_at for sim in self.sims.values() if sim.answered_at is not None]
        return {
            "started": started,
            "answered": len(answered),
            "last": max(answered, default=None),
            "quorum_ids": sorted({sim.quorum_id for sim in self.sims.values() if sim.quorum_id is not None}),
            "bytes": self.answer_bytes,
            "errors": sorted({error.split(": ", 1)[1][:160] for error in self.errors})[:5],
            "retried": self.retried,
            "first_retried": self.first_retried,
        }

    async def advance(self, step: int) -> dict[str, Any]:
        """Report ``step`` from now on, with the digest of the ledger after it (replayed in the current quorum)."""
        quorum_id = max(sim.quorum_id or 0 for sim in self.live())
        members, state = self.quorums[quorum_id]
        ledger = DataLedger.from_state_dict(state)
        while ledger.step < step:
            if not ledger.in_step:
                ledger.begin_step(list(members))
            ledger.commit()
        self.step = step
        self.digest = ledger_digest(ledger.state_dict())
        self.report = json.dumps(heartbeat_message(step, self.digest))
        return {}

    async def counters(self) -> dict[str, Any]:
        """Heartbeats sent so far."""
        return {"sent": self.sent, "time": time.time()}

    async def mark(self) -> dict[str, Any]:
        """Forget the pushes and answers seen so far (a new event is about to be measured)."""
        for sim in self.sims.values():
            sim.pushed_at = sim.asked_at = sim.answered_at = None
        self.answer_bytes = []
        self.retried, self.first_retried = {}, {}
        return {}

    async def kill(self, names: Sequence[str]) -> dict[str, Any]:
        """Close the connections of those of ``names`` that are ours abruptly, as a SIGKILLed process's are."""
        ours = [self.sims[name] for name in names if name in self.sims]
        for sim in ours:
            sim.dead = True
            connection = sim.socket._response.connection if sim.socket is not None else None
            if connection is not None and connection.transport is not None:
                connection.transport.abort()
        return {"time": time.time() if ours else None}

    async def collect(self, quorum_id: int, limit: float) -> dict[str, Any]:
        """Wait (up to ``limit`` s) until every live member is in quorum ``quorum_id`` or later; what each saw."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if all((sim.quorum_id or 0) >= quorum_id and not sim.asking for sim in self.live()):
                break
            await asyncio.sleep(0.01)
        live = self.live()
        return {
            "pushed": [sim.pushed_at for sim in live],
            "asked": [sim.asked_at for sim in live],
            "answered": [sim.answered_at for sim in live],
            "quorum_ids": sorted({sim.quorum_id for sim in live if sim.quorum_id is not None}),
            "refused": sum(sim.refused for sim in live),
            "bytes": self.answer_bytes,
            "errors": sorted({error.split(": ", 1)[1][:160] for error in self.errors})[:5],
            "retried": self.retried,
            "first_retried": self.first_retried,
        }


async def _bounded_gather(coroutines: Any, limit: int = 128) -> None:
    """Run the coroutines, at most ``limit`` at a time."""
    semaphore = asyncio.Semaphore(limit)

    async def run(coroutine: Any) -> None:
        async with semaphore:
            await coroutine

    await asyncio.gather(*(run(coroutine) for coroutine in coroutines))


def _fleet_main(
    connection: Connection, names: list[str], url: str, wire: int, interval: float | None, asks: str
) -> None:
    """A member process."""
    _prepare_process()
    asyncio.run(Fleet(connection, names, url, wire, interval, asks).serve())


# --- the driver --------------------------------------------------------------------------------------------------


class Driver:
    """Starts the lighthouse and the member processes for one member count, runs the phases, measures."""

    def __init__(self, members: int, args: argparse.Namespace, folder: Path) -> None:
        self.members = members
        self.args = args
        context = multiprocessing.get_context("spawn")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"lighthouse-{members}.log"
        state = str(folder / f"state-{members}.db")
        self.server = context.Process(
            target=_serve,
            args=(
                self.port,
                members,
                state,
                str(self.log),
                args.heartbeat_timeout,
                args.join_timeout,
                args.ahead,
                args.lighthouse_core,
                args.lighthouse_nice,
            ),
            daemon=True,
        )
        names = [f"member-{n:05d}" for n in range(members)]
        self.observers = names[:: max(1, members // OBSERVERS)][:OBSERVERS]
        observed = set(self.observers)
        load = [name for name in names if name not in observed]
        self.pipes: list[Connection] = []
        self.fleets = []
        interval = None if args.heartbeat_interval == "recommended" else float(args.heartbeat_interval)
        for mine in [load[index :: args.processes] for index in range(args.processes)] + [self.observers]:
            ours, theirs = context.Pipe()
            self.pipes.append(ours)
            self.fleets.append(
                context.Process(
                    target=_fleet_main, args=(theirs, mine, self.url, args.wire, interval, args.asks), daemon=True
                )
            )
        self.live = load
        self.probes: list[tuple[float, float]] = []
        self.result: dict[str, Any] = {"members": members}

    def command(self, *message: Any, only: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Send a command to the member processes (all, or ``only``) at once; their answers, bounded in time."""
        targets = range(len(self.pipes)) if only is None else only
        for index in targets:
            self.pipes[index].send(message)
        answers = []
        for index in targets:
            if not self.pipes[index].poll(PHASE_LIMIT + 10):
                raise TimeoutError(f"member process {index} did not answer {message[0]!r}")
            answers.append(self.pipes[index].recv())
        failed = [answer["failed"] for answer in answers if "failed" in answer]
        if failed:
            raise RuntimeError(f"{len(failed)} member process(es) failed: {failed[0]}")
        return answers

    async def run(self) -> dict[str, Any]:
        """All phases; a phase that fails is recorded and ends the run for this member count."""
        self.server.start()
        for fleet in self.fleets:
            fleet.start()
        self.usage = ProcessUsage(self.server.pid or 0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PHASE_LIMIT)) as session:
            self.session = session
            await self._wait_healthy()
            prober = asyncio.create_task(self._probe())
            try:
                for phase in (self._start_up, self._steady, self._one_failure, self._steady, self._mass_failure):
                    await phase()
                await self._steady()  # the first steps after a quarter failed replay its failures
                self.result["lighthouse"] = await self._summary()
            except (TimeoutError, RuntimeError, aiohttp.ClientError) as error:
                self.result["error"] = f"{type(error).__name__}: {error}"
                self.result["lighthouse"] = await self._summary()
            finally:
                prober.cancel()
                self.result["rss_mib"], self.result["peak_rss_mib"] = self.usage.memory_mib()
        self._stalls()
        return self.result

    def _quiet_collections(self) -> list[tuple[float, float]]:
        """``(start, end)`` of each full collection the lighthouse ran while quiet (from its log)."""
        pauses = []
        text = self.log.read_text() if self.log.exists() else ""
        for line in text.splitlines():
            match = QUIET_COLLECTION.match(line)
            if match:
                end, took = float(match[1]), float(match[2]) / 1000
                pauses.append((end - took, end))
        return pauses

    def _stalls(self) -> None:
        """The longest ``/healthz`` answer in each measured window, and, apart, the lighthouse's quiet collections.

        A probe that overlapped a full collection run while quiet (nothing
        waited on the lighthouse then) is counted on that row, not in a window.
        """
        pauses = self._quiet_collections()
        self.result["quiet_collections"] = len(pauses)
        self.result["quiet_collection_ms"] = 1000 * max((end - start for start, end in pauses), default=0.0)

        def longest(since: float, until: float) -> float | None:
            kept = [
                latency
                for sent, latency in self.probes
                if since <= sent <= until and not any(sent < end and sent + latency > start for start, end in pauses)
            ]
            return 1000 * max(kept) if kept else None

        for phase in ("failure", "mass_failure"):
            if phase in self.result:
                self.result[phase]["stall_ms"] = longest(*self.result[phase].pop("window"))
        for steady in self.result.get("steady", []):
            steady["healthz_max_ms"] = longest(*steady.pop("window"))

    def stop(self) -> None:
        """Stop the member processes and the lighthouse."""
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(("stop",))
        for fleet in self.fleets:
            fleet.join(10)
            if fleet.is_alive():
                fleet.kill()
        self.server.terminate()
        self.server.join(20)
        if self.server.is_alive():
            self.server.kill()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + PHASE_LIMIT
        while time.monotonic() < deadline:
            try:
                async with self.session.get(self.url + "/healthz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError("the lighthouse did not start")

    async def _probe(self) -> None:
        """``GET /healthz`` back to back (every ``PROBE_INTERVAL``): ``(sent at, seconds to answer)``."""
        while True:
            started = time.time()
            try:
                async with self.session.get(self.url + "/healthz") as response:
                    await response.read()
            except aiohttp.ClientError:
                pass
            self.probes.append((started, time.time() - started))
            await asyncio.sleep(PROBE_INTERVAL)

    async def _summary(self) -> dict[str, Any]:
        """What the lighthouse says: its quorum, counts, members by state, and its log's warnings and errors."""
        try:
            status = await self._status()
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            return {"unreachable": str(error)}
        states: dict[str, int] = {}
        for member in status["members"]:
            key = f"{member['state']}{'/asking' if member['asking'] else ''}"
            states[key] = states.get(key, 0) + 1
        quorum = status["quorum"]
        size = None if quorum is None else len(quorum["members"])
        reasons: dict[str, int] = {}
        for failure in status["failures"]:
            reasons[failure["reason"]] = reasons.get(failure["reason"], 0) + 1
        logged = self.log.read_text().splitlines() if self.log.exists() else []
        return {
            "log": [line for line in logged if "WARNING" in line or "ERROR" in line or "Traceback" in line][-5:],
            "quorum_size": size,
            "reconfigure_pending": status["reconfigure_pending"],
            "counts": status["counts"],
            "members": states,
            "latest_failures": reasons,
        }

    async def _status(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/v1/status") as response:
            return dict(await response.json())

    async def _in_thread(self, *message: Any, only: Sequence[int] | None = None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.command, *message, only=only)

    async def _start_up(self) -> None:
        started = time.time()
        registered = await self._in_thread("register")
        self.result["interval_s"] = max(answer["interval"] for answer in registered)
        joined = await self._in_thread("join")
        self.result["joined"] = sum(answer["answered"] for answer in joined)
        lasts = [answer["last"] for answer in joined if answer["last"] is not None]
        self.result["start_up_s"] = max(lasts) - started if lasts else None
        sizes = [size for answer in joined for size in answer["bytes"]]
        self.result["join_answer_kib"] = statistics.mean(sizes) / 1024 if sizes else None
        self.result["rss_after_join_mib"] = self.usage.memory_mib()[0]
        self.step = 0
        if self.result["joined"] < self.members:
            errors = [error for answer in joined for error in answer["errors"]][:3]
            raise RuntimeError(f"only {self.result['joined']} of {self.members} members joined {errors}")

    async def _steady(self) -> None:
        """Heartbeats for ``--seconds`` while the step advances; CPU, rate sent, staleness, /healthz latency."""
        before = await self._in_thread("counters")
        cpu_before, started = self.usage.cpu_seconds(), time.time()
        deadline = time.monotonic() + self.args.seconds
        while time.monotonic() < deadline:
            self.step += 1
            await self._in_thread("advance", self.step)
            await asyncio.sleep(self.args.step_seconds)
        after = await self._in_thread("counters")
        cpu, elapsed = self.usage.cpu_seconds() - cpu_before, time.time() - started
        sent = sum(a["sent"] for a in after) - sum(b["sent"] for b in before)
        ended = time.time()
        latencies = sorted(latency for sent_at, latency in self.probes if started <= sent_at <= ended)
        status = await self._status()
        seen = [m["seconds_since_seen"] for m in status["members"] if m["state"] == "alive"]
        self.result.setdefault("steady", []).append(
            {
                "heartbeats_per_s": sent / elapsed,
                "offered_per_s": (len(self.live) + len(self.observers)) / self.result["interval_s"],
                "cpu_percent": 100 * cpu / elapsed,
                "healthz_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
                "healthz_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
                "window": (started, ended),
                "stalest_s": max(seen, default=None),
                "ledger_step": status["ledger"]["step"],
                "step": self.step,
            }
        )

    async def _fail(self, victims: list[str], key: str) -> None:
        """Close ``victims`` at once; measure until every survivor is in the next quorum.

        Latencies count from the instant the victims' sockets were closed (the
        lighthouse sees it a few milliseconds later: ``seen_after_ms``).
        """
        status = await self._status()
        quorum_id = status["quorum"]["quorum_id"]
        await self._in_thread("mark")
        cpu = self.usage.cpu_seconds()
        killed = [answer["time"] for answer in await self._in_thread("kill", victims) if answer["time"] is not None]
        gone = set(victims)  # once: a set per name held this loop (and its /healthz probes) 70-250 ms at 4,096
        self.live = [name for name in self.live if name not in gone]
        collected = await self._in_thread("collect", quorum_id + 1, PHASE_LIMIT)
        settled, cpu = time.time(), self.usage.cpu_seconds() - cpu
        status = await self._status()  # O(M) on the lighthouse's loop: after the window the stall is measured in
        killed_at = min(killed)
        failures = [f for f in status["failures"] if f["time"] >= killed_at - 0.001 and f["member"] in gone]
        quorums = [q for q in status["quorums"] if q["time"] >= killed_at - 0.001]
        formed = max((q["time"] for q in quorums), default=None)
        everyone, observers = collected, collected[-1:]
        pushed = [t for answer in everyone for t in answer["pushed"]]
        answered = [t for answer in everyone for t in answer["answered"]]
        sizes = [size for answer in everyone for size in answer["bytes"]]
        self.result[key] = {
            "victims": len(victims),
            "survivors": len(pushed),
            "seen_after_ms": 1000 * (min(f["time"] for f in failures) - killed_at) if failures else None,
            "last_seen_ms": 1000 * (max(f["time"] for f in failures) - killed_at) if failures else None,
            "formed_ms": None if formed is None else 1000 * (formed - killed_at),
            "quorums": len(quorums),
            "quorums_ahead": sum(bool(q.get("ahead")) for q in quorums),
            "push_observers_ms": _ms_after([t for a in observers for t in a["pushed"]], killed_at, 1.0),
            "push_p50_ms": _ms_after(pushed, killed_at, 0.5),
            "push_max_ms": _ms_after(pushed, killed_at, 1.0),
            "asked_max_ms": _ms_after([t for answer in everyone for t in answer["asked"]], killed_at, 1.0),
            "answered_observers_ms": _ms_after([t for a in observers for t in a["answered"]], killed_at, 1.0),
            "answered_max_ms": _ms_after(answered, killed_at, 1.0),
            "answered": sum(t is not None for t in answered),
            "refused": sum(answer["refused"] for answer in everyone),
            "retried": _merge(answer["retried"] for answer in everyone),
            "first_retried": {s: b for answer in everyone for s, b in answer["first_retried"].items()},
            "errors": sorted({error for answer in everyone for error in answer["errors"]})[:8],
            "window": (killed_at, settled),
            "cpu_ms": 1000 * cpu,
            "answer_kib": statistics.mean(sizes) / 1024 if sizes else None,
        }
        if self.result[key]["answered"] < len(pushed):
            errors = [error for answer in everyone for error in answer["errors"]][:3]
            raise RuntimeError(
                f"{key}: only {self.result[key]['answered']} of {len(pushed)} survivors re-formed {errors}"
            )

    async def _one_failure(self) -> None:
        await self._fail([self.live[len(self.live) // 2]], "failure")

    async def _mass_failure(self) -> None:
        await asyncio.sleep(0.5)
        await self._fail(random.Random(0).sample(self.live, len(self.live) // 4), "mass_failure")


def _worst(*values: float | None) -> float | None:
    """The largest of ``values``; None when any is missing."""
    return None if any(value is None for value in values) else max(v for v in values if v is not None)


def _merge(counts: Any) -> dict[str, int]:
    """Sum of count dicts."""
    total: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            total[str(key)] = total.get(str(key), 0) + value
    return total


def _ms_after(times: Sequence[float | None], origin: float, quantile: float) -> float | None:
    """The ``quantile`` of ``times - origin`` in ms; None when any is missing (not every survivor got there)."""
    if not times or any(t is None for t in times):
        return None
    ordered = sorted(1000 * (t - origin) for t in times if t is not None)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


# --- reporting ---------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


ROWS: tuple[tuple[str, str, int], ...] = (
    ("members joined", "joined", 0),
    ("start-up (s)", "start_up_s", 1),
    ("join answer (KiB)", "join_answer_kib", 1),
    ("heartbeat interval (s)", "interval_s", 2),
    ("heartbeats/s sent", "steady.heartbeats_per_s", 0),
    ("heartbeats/s offered", "steady.offered_per_s", 0),
    ("stalest member seen (s)", "steady.stalest_s", 2),
    ("ledger steps committed / driven", "steady.committed", 0),
    ("lighthouse CPU (%)", "steady.cpu_percent", 0),
    ("/healthz p50 / p99 / max (ms)", "steady.healthz", 0),
    ("1 failure: quorums formed / ahead", "failure.formed_count", 0),
    ("1 failure: quorum formed (ms)", "failure.formed_ms", 0),
    ("1 failure: push, observers / all (ms)", "failure.push", 0),
    ("1 failure: last survivor's request sent (ms)", "failure.asked_max_ms", 0),
    ("1 failure: answered, observers / all (ms)", "failure.answered", 0),
    ("1 failure: answer (KiB)", "failure.answer_kib", 2),
    ("1 failure: /healthz stall until answered (ms)", "failure.stall_ms", 0),
    ("1 failure: lighthouse CPU until all answered (ms)", "failure.cpu_ms", 0),
    ("1/4 fail: quorums formed / ahead", "mass_failure.formed_count", 0),
    ("1/4 fail: deaths seen, first / last (ms)", "mass_failure.seen", 0),
    ("1/4 fail: quorum formed (ms)", "mass_failure.formed_ms", 0),
    ("1/4 fail: push, observers / all (ms)", "mass_failure.push", 0),
    ("1/4 fail: last survivor's request sent (ms)", "mass_failure.asked_max_ms", 0),
    ("1/4 fail: answered, observers / all (ms)", "mass_failure.answered", 0),
    ("1/4 fail: answer (KiB)", "mass_failure.answer_kib", 2),
    ("1/4 fail: /healthz stall until answered (ms)", "mass_failure.stall_ms", 0),
    ("1/4 fail: /healthz max, next steps (ms)", "after.healthz_max_ms", 0),
    ("1/4 fail: lighthouse CPU until all answered (ms)", "mass_failure.cpu_ms", 0),
    ("full GCs while quiet / longest (ms)", "quiet", 0),
    ("lighthouse RSS after join (MiB)", "rss_after_join_mib", 0),
    ("lighthouse peak RSS (MiB)", "peak_rss_mib", 0),
    ("error", "error", 0),
)


def cell(result: dict[str, Any], key: str, digits: int) -> str:
    """One table cell: ``key`` is a path into the result (``steady`` is the first steady phase)."""
    if key == "error":
        return str(result.get("error", ""))[:60]
    if key == "quiet":
        return f"{_fmt(result.get('quiet_collections'))} / {_fmt(result.get('quiet_collection_ms'))}"
    head, _, tail = key.partition(".")
    value: Any = result.get(head)
    if head in ("steady", "after"):  # the first steady phase; the one after the quarter failed
        phases = result.get("steady") or [{}]
        value = phases[0] if head == "steady" else (phases[2] if len(phases) > 2 else {})
    if not tail:
        return _fmt(value, digits)
    value = value or {}
    if tail == "healthz":
        p50, p99, most = (_fmt(value.get(f"healthz_{q}_ms"), 1) for q in ("p50", "p99", "max"))
        return f"{p50} / {p99} / {most}"
    if tail in ("push", "answered"):
        return f"{_fmt(value.get(f'{tail}_observers_ms'))} / {_fmt(value.get(f'{tail}_max_ms'))}"
    if tail == "seen":
        return f"{_fmt(value.get('seen_after_ms'))} / {_fmt(value.get('last_seen_ms'))}"
    if tail == "formed_count":
        return f"{_fmt(value.get('quorums'))} / {_fmt(value.get('quorums_ahead'))}"
    if tail == "committed":
        return f"{_fmt(value.get('ledger_step'))} / {_fmt(value.get('step'))}"
    return _fmt(value.get(tail), digits)


def goals(results: Sequence[dict[str, Any]]) -> list[Goal]:
    """The issue's goals at the largest member count measured."""
    if not results:
        return []
    largest = max(results, key=lambda r: r["members"])
    size = largest["members"]
    failure, mass = largest.get("failure") or {}, largest.get("mass_failure") or {}
    steady = largest.get("steady") or []
    after = steady[2] if len(steady) > 2 else {}

    def met(value: float | None, goal: float) -> bool | None:
        return None if value is None else value <= goal

    return [
        Goal("4096 members joined", largest.get("joined", 0) >= 4096, f"{largest.get('joined', 0)} of {size}"),
        Goal(
            f"quorum formed within {FORM_GOAL_MS:.0f} ms of the failure being seen ({size} members)",
            met(failure.get("formed_ms"), FORM_GOAL_MS),
            f"{_fmt(failure.get('formed_ms'))} ms after the socket closed",
        ),
        Goal(
            f"broken-quorum push at every survivor within {PUSH_GOAL_MS:.0f} ms ({size} members)",
            met(failure.get("push_observers_ms"), PUSH_GOAL_MS),
            f"{_fmt(failure.get('push_observers_ms'))} ms at the observers; {_fmt(failure.get('push_max_ms'))} ms at "
            "the last simulated member, its process's own queueing included",
        ),
        Goal(
            f"one failure: no stall over {STALL_GOAL_MS:.0f} ms ({size} members)",
            met(failure.get("stall_ms"), STALL_GOAL_MS),
            f"longest /healthz answer {_fmt(failure.get('stall_ms'))} ms until every survivor was answered",
        ),
        Goal(
            f"a quarter failing at once: no stall over {STALL_GOAL_MS:.0f} ms ({size} members)",
            met(_worst(mass.get("stall_ms"), after.get("healthz_max_ms")), STALL_GOAL_MS),
            f"longest /healthz answer {_fmt(mass.get('stall_ms'))} ms until every survivor was answered, "
            f"{_fmt(after.get('healthz_max_ms'))} ms in the steps after, {_fmt(mass.get('quorums'))} quorum(s) "
            f"formed; apart: {_fmt(largest.get('quiet_collections'))} full collection(s) while quiet, the longest "
            f"{_fmt(largest.get('quiet_collection_ms'))} ms",
        ),
    ]


def report(results: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]] | None) -> None:
    """Print the table (member counts side by side) and, with ``before``, the before/after comparison."""
    console = make_console()
    columns = ["", *(f"{r['members']:,}" for r in results)]
    rows = [[label, *(cell(r, key, digits) for r in results)] for label, key, digits in ROWS]
    print_table(console, "One lighthouse, simulated members on 127.0.0.1", columns, rows)
    if before:
        old = {r["members"]: r for r in before}
        pairs = [(old.get(r["members"]), r) for r in results]
        columns = ["", *(f"{r['members']:,}: before → after" for _, r in pairs)]
        rows = [
            [label, *(f"{cell(o, key, digits) if o else '—'} → {cell(n, key, digits)}" for o, n in pairs)]
            for label, key, digits in ROWS
            if key != "error"
        ]
        print_table(console, "Before and after", columns, rows)
    print_goals(console, goals(results))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--processes", type=int, default=3, help="member processes")
    parser.add_argument("--seconds", type=float, default=5.0, help="each steady phase")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="how often the members' step advances")
    parser.add_argument("--heartbeat-interval", default="recommended", help="seconds, or 'recommended'")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--wire", type=int, choices=(1, 2), default=2, help="1: ask for the legacy full answer")
    parser.add_argument(
        "--asks",
        choices=("socket", "post"),
        default="socket",
        help="how members ask for quorums: on their heartbeat socket (as LighthouseClient does), or POST (before)",
    )
    parser.add_argument(
        "--ahead-settle",
        default=str(AHEAD_SETTLE_S),
        help="seconds after the last death before the survivors' quorum forms ahead of their requests, or 'off' "
        "(the requests decide, as before)",
    )
    parser.add_argument(
        "--lighthouse-core",
        type=int,
        help="run the lighthouse on this CPU core alone and the members and the driver on the others, as a "
        "lighthouse on a host of its own would (default: all processes share every core)",
    )
    parser.add_argument(
        "--lighthouse-nice",
        type=int,
        default=0,
        choices=range(-20, 20),
        metavar="[-20..19]",
        help="the lighthouse process's nice value (negative, as root: it runs before the members whenever it can, "
        "as a lighthouse on a host of its own would, while the members keep every core)",
    )
    parser.add_argument("--stop-after-failure", action="store_true", help="skip larger counts once one fails")
    parser.add_argument("--report", type=Path, help="write the results as JSON")
    parser.add_argument("--compare", type=Path, help="a --report of an earlier run: print before/after")
    args = parser.parse_args(argv)
    args.ahead = None if args.ahead_settle == "off" else float(args.ahead_settle)
    if args.lighthouse_core is not None:
        cores = os.sched_getaffinity(0)
        if args.lighthouse_core not in cores or len(cores) < 2:
            parser.error(f"--lighthouse-core {args.lighthouse_core}: needs one of {sorted(cores)} and another core")
        os.sched_setaffinity(0, cores - {args.lighthouse_core})  # the members, spawned from here, inherit it
    _prepare_process()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for members in args.members:
            driver = Driver(members, args, Path(folder))
            try:
                result = asyncio.run(driver.run())
            finally:
                driver.stop()
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
            if args.report is not None:
                args.report.parent.mkdir(parents=True, exist_ok=True)
                args.report.write_text(json.dumps(results, indent=1))
            if args.stop_after_failure and "error" in result:
                break
    before = json.loads(args.compare.read_text()) if args.compare is not None else None
    report(results, before)


if __name__ == "__main__":
    main()
