"""The lighthouse's dashboard, event stream and /metrics: tokens, bad input, and a real cluster through a SIGKILL.

The cluster test runs three worker processes against a token-protected
lighthouse, SIGKILLs one, restarts it (it rejoins and is healed) and holds
the job at a step; meanwhile a headless Chromium keeps the dashboard open
(never reloaded), and the figures it shows, and those of ``/metrics``, are
checked against ``/v1/status`` and the workers' own records.

The browser is driven with selenium and Debian's ``chromium-driver``: the
page is live (server-sent events), so the test must wait on what the page
shows at a moment of its choosing, which chromium's one-shot ``--dump-dom``
cannot do without guessing a virtual-time budget.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stalwart.coord.client import LighthouseClient
from stalwart.coord.figures import summary
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster, latest_step, read_status, worker_events
from stalwart.launch.report import planned_total
from stalwart.testing.waiting import wait_until
from tests.integration.dashboard_client import CHROMIUM_FLAGS, TOKEN, bearer, first_event, http, metric_values

pytestmark = pytest.mark.timeout(900)

PLAN = EpochPlan(1797, 48, seed=0)
WORKERS = 3
KILLED = 1
KILL_FROM_STEP = 3
HOLD_STEP = 9
STEPS = 12
ARTIFACTS = Path(__file__).resolve().parents[2] / "out" / "test-artifacts"
PAGE_FIGURES = """
const value = (id) => Number(document.getElementById(id).dataset.value);
const rows = (selector) => [...document.querySelectorAll(selector)];
return {
  updates: Number(document.body.dataset.updates),
  connection: document.getElementById("connection").textContent,
  alive: value("tile-alive"), quorum_size: value("tile-quorum"), steps: value("tile-steps"),
  samples: value("tile-samples"), failures: value("tile-failures"), recoveries: value("tile-recoveries"),
  members: Object.fromEntries(rows("#members tbody tr").map(
    (row) => [row.dataset.key, [row.dataset.state, row.cells[4].textContent, row.cells[6].textContent]])),
  failure_rows: rows("#failures tbody tr").map((row) => [...row.cells].map((cell) => cell.textContent)),
  failure_marks: rows("#timeline .mark-failure").length,
};
"""


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, token=TOKEN, state_path=tmp_path / "state.sqlite")
    server.start()
    yield server
    server.stop()


def cookie(lighthouse: Lighthouse, token: str = TOKEN) -> dict[str, str]:
    """The dashboard's token cookie for this lighthouse (its name carries the port)."""
    return {"Cookie": f"stalwart_token_{lighthouse.port}={token}"}


def test_every_new_route_refuses_a_missing_or_wrong_token(lighthouse: Lighthouse) -> None:
    url = lighthouse.url
    another_port = {"Cookie": f"stalwart_token_{lighthouse.port + 1}={TOKEN}"}
    for path in ("/", "/v1/events", "/metrics"):
        for headers in ({}, bearer("wrong"), cookie(lighthouse, "wrong"), another_port):
            status, body, _ = http(url + path, headers)
            assert status == 401, (path, headers)
            assert "token" in json.loads(body)["error"]
        assert http(url + path + "?token=wrong")[0] == 401
    # /metrics takes the header only (a scraper sets it); the browser's query parameter and cookie are refused there
    assert http(url + "/metrics?token=" + TOKEN)[0] == 401
    assert http(url + "/metrics", cookie(lighthouse))[0] == 401
    status, body, headers = http(url + "/?token=" + TOKEN)
    assert status == 200 and b"<title>stalwart lighthouse</title>" in body
    set_cookie = headers["Set-Cookie"]
    assert f"stalwart_token_{lighthouse.port}={TOKEN}" in set_cookie and "HttpOnly" in set_cookie
    assert "Secure" not in set_cookie, "plain HTTP: a Secure cookie would never be sent back"
    outside = body.replace(b"http://www.w3.org/2000/svg", b"")  # a namespace name, never fetched
    assert b"http://" not in outside and b"https://" not in outside, "the page must load nothing from outside"
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert http(url + "/", cookie(lighthouse))[0] == 200
    assert http(url + "/", bearer())[0] == 200
    assert http(url + "/metrics", bearer())[0] == 200


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/?page=2", "page"),
        ("/?token=T&token=T", "token"),
        ("/v1/events?interval=abc", "interval"),
        ("/v1/events?interval=0", "interval"),
        ("/v1/events?interval=nan", "interval"),
        ("/v1/events?interval=1e9", "interval"),
        ("/v1/events?since=3", "since"),
        ("/metrics?name[]=stalwart_quorum_size", "name[]"),
    ],
)
def test_malformed_queries_get_400_naming_the_parameter_and_the_lighthouse_serves_on(
    lighthouse: Lighthouse, path: str, field: str
) -> None:
    status, body, _ = http(lighthouse.url + path.replace("=T", "=" + TOKEN), bearer())
    assert status == 400
    error = json.loads(body)
    assert error["field"] == field and field in error["error"]
    assert http(lighthouse.url + "/v1/status", bearer())[0] == 200


def test_event_stream_carries_the_status_and_its_figures(lighthouse: Lighthouse) -> None:
    event = first_event(lighthouse.url + "/v1/events?interval=0.5", cookie(lighthouse))
    status = lighthouse.status()
    assert event["summary"] == summary(status)
    assert event["status"]["plan"] == status["plan"] == PLAN.to_dict()
    assert event["summary"]["quorum_id"] is None and event["summary"]["samples_committed"] == 0


def test_heal_totals_in_heartbeats_reach_metrics_and_malformed_ones_are_refused_not_fatal(
    lighthouse: Lighthouse,
) -> None:
    with LighthouseClient(lighthouse.url, "healer", token=TOKEN, heartbeat_interval=0.05) as client:
        client.start_heartbeat(lambda: 0)
        client.report_heal(4096, 0.5)
        client.report_heal(1024, 0.25)
        wait_until(lambda: metric_values(lighthouse.url)["stalwart_heals_total"] == 2, 60, "two heals counted")
        values = metric_values(lighthouse.url)
        assert values["stalwart_heal_bytes_total"] == 5120
        assert values["stalwart_heal_seconds_count"] == 2 and values["stalwart_heal_seconds_sum"] == 0.75
        with pytest.raises(ValueError, match="nbytes"):
            client.report_heal(-1, 0.1)
        with pytest.raises(ValueError, match="seconds"):
            client.report_heal(1, float("inf"))
        headers = {**bearer(), **client.identity_headers()}

    async def send_malformed() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(lighthouse.url + "/v1/heartbeat?member=healer", headers=headers) as socket,
        ):
            await socket.send_json({"applied_step": 0, "heal": {"heals": "many", "bytes": 1, "seconds": 1}})
            reply = await socket.receive_json(timeout=30)
            await socket.send_json({"applied_step": 0})
            return reply

    reply = asyncio.run(send_malformed())
    assert reply["type"] == "error" and "heal['heals']" in reply["error"] and "'many'" in reply["error"]
    assert metric_values(lighthouse.url)["stalwart_heals_total"] == 2
    assert http(lighthouse.url + "/healthz")[0] == 200


# --- a real cluster, a SIGKILL, a browser ---------------------------------------------------------


@dataclass
class ClusterRun:
    """What the cluster test saw at the held step (after the kill, the restart and the heal)."""

    status: dict[str, Any]
    metrics: dict[str, float]
    healed_events: int
    page: dict[str, Any] | None
    page_after_kill: dict[str, Any] | None
    page_before_cluster: dict[str, Any] | None
    screenshot: Path | None
    browser_missing: str | None


def chromium_paths() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def open_browser(profile: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    os.environ["SE_OFFLINE"] = "true"  # never let selenium look for a browser or driver to download
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def page_figures(browser: Any) -> dict[str, Any]:
    return browser.execute_script(PAGE_FIGURES)


def step_text(step: int | None) -> str:
    """A member's step as the members table shows it."""
    return "-" if step is None else str(step)


def status_figures(status: dict[str, Any]) -> dict[str, Any]:
    """What the page must show, computed from ``/v1/status`` (and the plan, for samples)."""
    return {
        "alive": sum(member["state"] == "alive" for member in status["members"]),
        "quorum_size": len(status["quorum"]["members"]) if status["quorum"] else 0,
        "steps": status["ledger"]["step"],
        "samples": sum(planned_total(PLAN, step) for step in range(status["ledger"]["step"])),
        "failures": status["counts"]["failures"],
        "recoveries": status["counts"]["recoveries"],
        "members": {
            m["member"]: [m["state"], step_text(m["applied_step"]), "yes" * m["healing"]] for m in status["members"]
        },
    }


def page_matching(browser: Any, wanted: dict[str, Any], timeout: float = 30.0) -> tuple[dict[str, Any], bool]:
    """Wait (at most ``timeout`` s) until the page shows ``wanted``: its last figures, and whether they match."""
    deadline = time.monotonic() + timeout
    while True:
        page = page_figures(browser)
        if shown(page) == wanted or time.monotonic() >= deadline:
            return page, shown(page) == wanted
        time.sleep(0.05)


def shown(page: dict[str, Any]) -> dict[str, Any]:
    return {key: page[key] for key in ("alive", "quorum_size", "steps", "samples", "failures", "recoveries", "members")}


def settled(status: dict[str, Any]) -> bool:
    """Every worker alive in the quorum at the hold, none healing or asking, each having reported the
    ledger's step (heartbeats report it a moment after the commit): the held job stands still."""
    members, step = status["members"], status["ledger"]["step"]
    return (
        len(members) == WORKERS
        and step >= HOLD_STEP
        and all(m["state"] == "alive" and not m["healing"] and m["asking"] is None for m in members)
        and all(m["applied_step"] == step for m in members)
        and not status["reconfigure_pending"]
        and status["counts"]["failures"] >= 1
    )


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterRun]:
    tmp_path = tmp_path_factory.mktemp("dashboard")
    chromium, driver = chromium_paths()
    missing = None if chromium and driver else "Debian's chromium and chromium-driver are not installed"
    lighthouse = Lighthouse(
        PLAN, token=TOKEN, start_replicas=WORKERS, heartbeat_timeout=2.0, join_timeout=30.0,
        state_path=tmp_path / "state.sqlite",
    )  # fmt: skip
    lighthouse.start()
    browser = None if missing else open_browser(tmp_path / "profile")
    run_dir = tmp_path / "run"
    args = ["--max-steps", str(STEPS), "--max-microbatch", "8", "--collective-timeout", "5.0", "--step-seconds", "0.2"]
    cluster = LocalCluster(lighthouse.url, run_dir, [*args, "--token", TOKEN])
    url = lighthouse.url
    try:
        before = None
        if browser is not None:
            browser.get(url + "/?token=" + TOKEN)
            before = wait_until(
                lambda: (p := page_figures(browser))["updates"] >= 1 and p, 60, "the page's first event"
            )
        cluster.hold(HOLD_STEP)
        for worker in range(WORKERS):
            cluster.start(worker)
        wait_until(lambda: read_status(url, TOKEN)["ledger"]["step"] >= KILL_FROM_STEP, 240, "the job's first steps")
        cluster.kill(KILLED, "KILL", latest_step(run_dir)[0])
        wait_until(lambda: read_status(url, TOKEN)["counts"]["recoveries"] >= 1, 120, "a recovery after the kill")
        after_kill = None
        if browser is not None:
            after_kill = wait_until(
                lambda: (p := page_figures(browser))["failures"] >= 1 and p["failure_marks"] >= 1 and p,
                60,
                "the page to show the failure without a reload",
            )
        cluster.revive(KILLED)
        wait_until(
            lambda: settled(read_status(url, TOKEN)),
            240,
            "the restarted worker to rejoin, healed, and the job to stand at the hold",
        )

        def healed_events() -> int:
            return sum(e["event"] == "healed" for w in range(WORKERS) for e in worker_events(run_dir, w))

        wait_until(
            lambda: metric_values(url)["stalwart_heals_total"] == healed_events() >= WORKERS,
            120,
            "the heals the workers loaded to be counted in /metrics",
        )
        page = screenshot = None
        matched = browser is None
        for _ in range(8):  # the held job stands still; a read that straddles a change is taken again
            status = read_status(url, TOKEN)
            metrics = metric_values(url)
            if browser is not None:
                page, matched = page_matching(browser, status_figures(status))
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                screenshot = ARTIFACTS / "dashboard.png"
                browser.save_screenshot(str(screenshot))
            if matched and read_status(url, TOKEN)["ledger"] == status["ledger"] and settled(status):
                break
            time.sleep(0.5)
        else:
            shown_last = None if page is None else shown(page)
            raise AssertionError(
                f"the held job never stood still with the page showing it: /v1/status says "
                f"{status_figures(status)}, the page {shown_last}"
            )
        yield ClusterRun(status, metrics, healed_events(), page, after_kill, before, screenshot, missing)
        cluster.release()
        wait_until(lambda: not cluster.running(), 240, "the workers to finish")
    finally:
        cluster.release()
        cluster.terminate()
        if browser is not None:
            browser.quit()
        lighthouse.stop()


def test_metrics_follow_a_cluster_through_a_sigkill(cluster_run: ClusterRun) -> None:
    status, metrics = cluster_run.status, cluster_run.metrics
    assert metrics["stalwart_steps_committed"] == status["ledger"]["step"] >= KILL_FROM_STEP
    assert metrics["stalwart_samples_committed"] == sum(planned_total(PLAN, s) for s in range(status["ledger"]["step"]))
    assert metrics["stalwart_members{state=alive}"] == WORKERS
    assert metrics["stalwart_quorum_size"] == WORKERS
    assert metrics["stalwart_quorum_id"] == status["quorum"]["quorum_id"]
    kinds: dict[str, int] = {}
    for failure in status["failures"]:
        kinds[failure["reason"].replace(" ", "_")] = kinds.get(failure["reason"].replace(" ", "_"), 0) + 1
    assert any(f["member"] == f"worker-{KILLED}" and f["reason"] == "socket closed" for f in status["failures"])
    for kind in ("socket_closed", "heartbeat_timeout", "hung", "excluded", "restarted"):
        assert metrics[f"stalwart_failures_total{{kind={kind}}}"] == kinds.get(kind, 0), kind
    assert metrics["stalwart_recovery_seconds_count"] == status["counts"]["recoveries"] >= 1
    assert metrics["stalwart_recovery_seconds_sum"] > 0
    for reason in ("start-up", "boundary", "failure"):
        expected = sum(q["reason"] == reason for q in status["quorums"])
        assert metrics[f"stalwart_quorums_total{{reason={reason}}}"] == expected, reason
    # start-up heals every worker but rank 0, and the restarted worker is healed when it rejoins
    assert metrics["stalwart_heals_total"] == cluster_run.healed_events >= WORKERS
    assert metrics["stalwart_heal_seconds_count"] == metrics["stalwart_heals_total"]
    assert metrics["stalwart_heal_bytes_total"] >= 1000 * metrics["stalwart_heals_total"]
    assert metrics["stalwart_persist_seconds_count"] >= status["counts"]["quorums"]
    failure_quorums = sum(q["reason"] == "failure" for q in status["quorums"])
    reassigned = metrics["stalwart_samples_reassigned_total"]
    if failure_quorums == 0:
        assert reassigned == 0
    assert reassigned <= failure_quorums * PLAN.global_batch_size


def test_dashboard_in_chromium_shows_what_status_says_live(cluster_run: ClusterRun) -> None:
    if cluster_run.browser_missing:
        pytest.skip(cluster_run.browser_missing)
    before, after_kill, page = cluster_run.page_before_cluster, cluster_run.page_after_kill, cluster_run.page
    assert before is not None and after_kill is not None and page is not None
    assert before["failures"] == 0 and before["members"] == {} and before["steps"] == 0
    assert after_kill["updates"] > before["updates"], "the page updated itself, without a reload"
    assert after_kill["connection"] == page["connection"] == "live"
    assert any(row[1] == f"worker-{KILLED}" and row[2] == "socket_closed" for row in after_kill["failure_rows"])
    assert shown(page) == status_figures(cluster_run.status)
    step = str(cluster_run.status["ledger"]["step"])
    assert page["members"] == {f"worker-{w}": ["alive", step, ""] for w in range(WORKERS)}
    assert page["failure_marks"] == min(cluster_run.status["counts"]["failures"], 200)
    assert cluster_run.screenshot is not None and cluster_run.screenshot.stat().st_size > 10_000
