"""A lighthouse outage is not a failure, and a path that comes back is used at once.

A real lighthouse process (``python -m stalwart lighthouse``) stopped with
SIGSTOP: a real outage, its sockets stay open and nothing answers (what a dead
path looks like from the members); real clients on loopback.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from stalwart.coord.client import LighthouseClient, LighthouseUnreachable
from stalwart.testing.loopback import HOST, free_port
from stalwart.testing.procfs import stat_fields
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

HEARTBEAT_TIMEOUT = 1.0
MEMBERS = ("a", "b", "c")
PLAN = ("--dataset-size", "64", "--global-batch", "8")
UNREACHABLE = "unreachable ("
REACHABLE = "reachable again after"


@contextmanager
def lighthouse_process(log: Path, *options: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A lighthouse in its own process, answering at the URL yielded; resumed and ended afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "stalwart", "lighthouse", "--host", HOST, "--port", str(port)]
    command += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), *options, *PLAN]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    try:
        wait_until(lambda: answers(url), timeout=60, what=f"the lighthouse at {url} (its log: {log})")
        yield process, url
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def answers(url: str) -> bool:
    try:
        status(url)
    except OSError:
        return False
    return True


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/status", timeout=10) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records)


@contextmanager
def stopped(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """SIGSTOP ``process`` and wait until it is stopped (the signal is delivered asynchronously: on a busy machine
    the lighthouse answered a request sent right after it), SIGCONT on exit."""
    process.send_signal(signal.SIGSTOP)
    wait_until(lambda: stat_fields(process.pid)[0] == "T", timeout=30, what="the lighthouse stopped")
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def test_a_lighthouse_stopped_longer_than_the_heartbeat_timeout_counts_no_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The quorum trains on while the lighthouse is stopped (its members go silent for it all together); when it
    resumes they report their steps: no failure, no member dead, the quorum not broken, nothing to re-form."""
    caplog.set_level(logging.WARNING, logger="stalwart.coord.client")
    steps = dict.fromkeys(MEMBERS, 0)
    with lighthouse_process(tmp_path / "lighthouse.log", "--min-replicas", "3") as (process, url):
        clients = {m: LighthouseClient(url, m, heartbeat_interval=0.05) for m in MEMBERS}
        try:
            for member, client in clients.items():
                client.start_heartbeat(lambda member=member: report(member, steps[member]))
            with ThreadPoolExecutor(len(MEMBERS)) as pool:
                answers = list(pool.map(lambda m: remember(clients[m].quorum(0, None, "join", 60)), MEMBERS))
            formed = {"quorum_id": answers[0].quorum_id, "members": list(answers[0].members)}
            steps.update(dict.fromkeys(MEMBERS, 2))
            wait_until(lambda: status(url)["ledger"]["step"] == 2, timeout=30, what="two steps committed")

            with stopped(process):
                steps.update(dict.fromkeys(MEMBERS, 5))  # the fast path needs no lighthouse
                # each client waited silence_timeout (>= 2 s, twice the heartbeat timeout) for an answer
                wait_until(
                    lambda: logged(caplog, UNREACHABLE) >= len(MEMBERS), timeout=60, what="every client to notice"
                )
                assert all(c.silence_timeout > HEARTBEAT_TIMEOUT for c in clients.values())

            def reconciled() -> bool:
                now = status(url)
                alive = all(m["state"] == "alive" and m["connected"] for m in now["members"])
                return now["ledger"]["step"] == 5 and alive and len(now["members"]) == len(MEMBERS)

            wait_until(reconciled, timeout=60, what="the members' steps reported and all of them alive")
            after = status(url)
            assert after["failures"] == [] and after["recoveries"] == [], after["failures"]
            assert after["counts"]["failures"] == 0 and after["counts"]["recoveries"] == 0
            assert after["quorum"] == formed and not after["reconfigure_pending"]
            assert not any(c.quorum_broken or c.reconfigure_requested for c in clients.values())
            wait_until(
                lambda: logged(caplog, REACHABLE) == logged(caplog, UNREACHABLE) == len(MEMBERS),
                timeout=30,
                what="one line per client and change: unreachable, then reachable again",
            )
        finally:
            for client in clients.values():
                client.close()


def test_a_quorum_request_after_a_stalled_connection_goes_through_once_the_lighthouse_answers(
    tmp_path: Path,
) -> None:
    """A member asks for a quorum while the lighthouse is stopped: its request stalls on a connection nothing
    answers; once the lighthouse resumes, the request (asked again on a fresh connection) is answered within a
    bound of a few retry pauses, not after TCP's backoff or the long poll's timeout."""
    with lighthouse_process(tmp_path / "lighthouse.log", "--min-replicas", "1", "--join-timeout", "30") as (
        process,
        url,
    ):
        client = LighthouseClient(url, "a", heartbeat_interval=0.05)
        try:
            client.start_heartbeat(lambda: 0)
            wait_until(client.heartbeat_connected.is_set, timeout=30, what="the heartbeat")
            with ThreadPoolExecutor(1) as pool, stopped(process):
                asking = pool.submit(client.quorum, 0, None, "join", 120)
                wait_until(lambda: not client.heartbeat_connected.is_set(), timeout=60, what="the path found dead")
                assert not asking.done()
            resumed = time.monotonic()
            answer = asking.result(timeout=60)
            took = time.monotonic() - resumed
            assert answer.members == ("a",)
            bound = 2 * client.silence_timeout + client.connect_attempt_timeout + client.retry_cap + 10.0
            assert took < bound, f"answered {took:.1f} s after the lighthouse resumed (bound {bound:g} s)"
        finally:
            client.close()


MEMBERS_PROCESS = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from stalwart.coord.client import LighthouseClient
from stalwart.testing.reports import remember, report
url, members = sys.argv[1], sys.argv[2].split(",")
steps = dict.fromkeys(members, 0)
clients = {m: LighthouseClient(url, m, heartbeat_interval=0.05) for m in members}
for m, client in clients.items():
    client.start_heartbeat(lambda m=m: report(m, steps[m]))
with ThreadPoolExecutor(len(members)) as pool:
    answers = list(pool.map(lambda m: remember(clients[m].quorum(0, None, "join", 60)), members))
print(json.dumps(list(answers[0].members)), flush=True)
for line in sys.stdin:
    steps.update(dict.fromkeys(members, json.loads(line)))
    told = any(c.quorum_broken or c.reconfigure_requested for c in clients.values())
    print(json.dumps({"told_to_reconfigure": told}), flush=True)
"""


class MembersProcess:
    """``MEMBERS`` in one process (``MEMBERS_PROCESS``, started behind ``prefix``, e.g. ``ip netns exec NS``), joined
    in one quorum; :meth:`train_to` sets their reported step. Ended (resumed, then killed) on exit."""

    def __init__(self, url: str, prefix: Sequence[str] = ()) -> None:
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-c", MEMBERS_PROCESS, url, ",".join(MEMBERS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> MembersProcess:
        assert self.process.stdout is not None
        try:
            self.order = tuple(json.loads(self.process.stdout.readline()))
            """The quorum's members, in rank order."""
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(30)

    def train_to(self, step: int) -> dict[str, Any]:
        """Every member reports ``step``; whether any was told to reconfigure meanwhile."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(step) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        return answer


def test_members_silent_together_for_longer_than_the_heartbeat_timeout_are_alive_when_they_report_again(
    tmp_path: Path,
) -> None:
    """Every member goes silent at once (their process stopped: for the lighthouse, whose loop runs on, that is its
    own link down) for three heartbeat timeouts: none is dead meanwhile; when they report again, their steps
    commit, no failure is counted and nobody is told to reconfigure."""
    with (
        lighthouse_process(tmp_path / "lighthouse.log", "--min-replicas", "3") as (_, url),
        MembersProcess(url) as members,
    ):
        assert members.train_to(2) == {"told_to_reconfigure": False}
        wait_until(lambda: status(url)["ledger"]["step"] == 2, timeout=30, what="two steps committed")
        with stopped(members.process):
            wait_until(
                lambda: all(m["seconds_since_seen"] > 3 * HEARTBEAT_TIMEOUT for m in status(url)["members"]),
                timeout=60,
                what="three heartbeat timeouts of silence",
            )
            during = status(url)
            assert [m["state"] for m in during["members"]] == ["alive"] * len(MEMBERS), during["members"]
            assert during["failures"] == [] and not during["reconfigure_pending"]
        assert members.train_to(5) == {"told_to_reconfigure": False}
        wait_until(lambda: status(url)["ledger"]["step"] == 5, timeout=30, what="the steps trained meanwhile")
        after = status(url)
        assert after["counts"]["failures"] == 0 and after["failures"] == [] and after["recoveries"] == []
        assert after["quorum"] == {"quorum_id": 1, "members": list(members.order)}
        assert [m["state"] for m in after["members"]] == ["alive"] * len(MEMBERS)
        assert members.train_to(5) == {"told_to_reconfigure": False}


def test_a_quorum_request_to_a_stopped_lighthouse_raises_lighthouse_unreachable_naming_the_setting(
    tmp_path: Path,
) -> None:
    """The library's error when nothing answers for the whole quorum_timeout: LighthouseUnreachable naming the URL,
    the setting and its environment variable (not a TimeoutError about quorums)."""
    with lighthouse_process(tmp_path / "lighthouse.log", "--min-replicas", "1") as (process, url):
        client = LighthouseClient(url, "a", heartbeat_interval=0.05)
        try:
            client.start_heartbeat(lambda: 0)
            wait_until(client.heartbeat_connected.is_set, timeout=30, what="the heartbeat")
            with stopped(process), pytest.raises(LighthouseUnreachable) as unreachable:
                client.quorum(0, None, "join", 3.0)
        finally:
            client.close()
    message = str(unreachable.value)
    assert f"cannot reach the lighthouse at {url}" in message and "gave up after 3 s" in message
    assert "quorum_timeout" in message and "STALWART_QUORUM_TIMEOUT" in message


@pytest.mark.slow
def test_a_worker_whose_lighthouse_does_not_answer_exits_2_with_one_line_naming_url_and_setting(
    tmp_path: Path,
) -> None:
    """A lighthouse address where connections are accepted (by the kernel) and nothing answers: the worker gives up
    after STALWART_CONNECT_TIMEOUT with one line, exit status 2, no traceback."""
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)  # never accepted: every request waits for an answer that never comes
        url = f"http://{HOST}:{silent.getsockname()[1]}"
        command = [sys.executable, "-m", "stalwart.launch.worker", "--lighthouse", url, "--member", "w0"]
        command += ["--run-dir", str(tmp_path), "--max-steps", "1"]
        environment = {**os.environ, "STALWART_CONNECT_TIMEOUT": "2"}
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("stalwart worker w0: cannot reach the lighthouse at " + url), last
    assert "gave up after 2 s" in last and "connect_timeout" in last and "STALWART_CONNECT_TIMEOUT" in last


STATUS_SCRIPT = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@contextmanager
def linked_namespaces() -> Iterator[tuple[str, str, str]]:
    """Two network namespaces of this test joined by a veth pair: ``(lighthouse's, members', lighthouse's link)``;
    removed afterwards (with their links)."""
    tag = f"so{os.getpid() % 100000}"
    lighthouse_ns, members_ns, link = f"{tag}-lh", f"{tag}-w", f"{tag}l"
    try:
        for command in (
            ["ip", "netns", "add", lighthouse_ns],
            ["ip", "netns", "add", members_ns],
            ["ip", "link", "add", link, "type", "veth", "peer", "name", f"{tag}w"],
            ["ip", "link", "set", link, "netns", lighthouse_ns],
            ["ip", "link", "set", f"{tag}w", "netns", members_ns],
            ["ip", "-n", lighthouse_ns, "addr", "add", "10.213.7.1/24", "dev", link],
            ["ip", "-n", members_ns, "addr", "add", "10.213.7.2/24", "dev", f"{tag}w"],
            *(["ip", "-n", ns, "link", "set", "lo", "up"] for ns in (lighthouse_ns, members_ns)),
            ["ip", "-n", lighthouse_ns, "link", "set", link, "up"],
            ["ip", "-n", members_ns, "link", "set", f"{tag}w", "up"],
        ):
            subprocess.run(command, check=True, capture_output=True, timeout=30)
        yield lighthouse_ns, members_ns, link
    finally:
        for ns in (lighthouse_ns, members_ns):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_the_lighthouse_s_link_down_longer_than_the_heartbeat_timeout_counts_no_failure(tmp_path: Path) -> None:
    """The lighthouse's link goes down (its process runs on and hears nobody) while the quorum trains on, for three
    heartbeat timeouts; when the link comes back the members' reports commit the steps, nobody died, nothing
    failed, nobody was told to reconfigure."""
    with linked_namespaces() as (lighthouse_ns, members_ns, link):
        url = "http://10.213.7.1:29600"
        command = ["ip", "netns", "exec", lighthouse_ns, sys.executable, "-m", "stalwart", "lighthouse", "--insecure"]
        command += ["--host", "10.213.7.1", "--port", "29600", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        command += ["--min-replicas", "3", *PLAN]
        with (tmp_path / "lighthouse.log").open("wb") as log:
            lighthouse = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

        def seen() -> dict[str, Any]:
            """The lighthouse's status, read inside its namespace (whatever the link)."""
            done = subprocess.run(
                ["ip", "netns", "exec", lighthouse_ns, sys.executable, "-c", STATUS_SCRIPT, url + "/v1/status"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            return json.loads(done.stdout) if done.returncode == 0 else {}

        try:
            with MembersProcess(url, ["ip", "netns", "exec", members_ns]) as members:
                assert members.train_to(2) == {"told_to_reconfigure": False}
                wait_until(lambda: seen().get("ledger", {}).get("step") == 2, timeout=60, what="two steps committed")
                subprocess.run(["ip", "-n", lighthouse_ns, "link", "set", link, "down"], check=True, timeout=30)
                try:
                    assert members.train_to(5) == {"told_to_reconfigure": False}  # the fast path needs no lighthouse
                    wait_until(
                        lambda: all(m["seconds_since_seen"] > 3 * HEARTBEAT_TIMEOUT for m in seen()["members"]),
                        timeout=60,
                        what="three heartbeat timeouts without a heartbeat",
                    )
                    during = seen()
                    assert [m["state"] for m in during["members"]] == ["alive"] * len(MEMBERS), during["members"]
                    assert during["failures"] == [] and not during["reconfigure_pending"]
                finally:
                    subprocess.run(["ip", "-n", lighthouse_ns, "link", "set", link, "up"], check=True, timeout=30)
                wait_until(lambda: seen().get("ledger", {}).get("step") == 5, timeout=60, what="the steps trained")
                after = seen()
                assert after["counts"]["failures"] == 0 and after["failures"] == [] and after["recoveries"] == []
                assert after["quorum"] == {"quorum_id": 1, "members": list(members.order)}
                assert [m["state"] for m in after["members"]] == ["alive"] * len(MEMBERS)
                assert members.train_to(5) == {"told_to_reconfigure": False}
        finally:
            lighthouse.kill()
            lighthouse.wait(30)


def test_a_request_that_reaches_nothing_raises_lighthouse_unreachable_naming_the_url() -> None:
    """Not aiohttp's own error: the library's, with the address (the worker prints it as its one line)."""
    url = f"http://{HOST}:{free_port()}"
    with LighthouseClient(url, "a") as client, pytest.raises(LighthouseUnreachable) as unreachable:
        client.status()
    assert f"cannot reach the lighthouse at {url}" in str(unreachable.value)
