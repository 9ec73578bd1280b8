"""The lighthouse knows DiLoCo rounds: members' round figures in heartbeats reach /v1/status, events and /metrics.

The board is checked alone (per-incarnation counting, malformed reports),
then over a real token-protected lighthouse with a real client heartbeating
its figures, a malformed one sent on a raw socket, and (where Chromium is
installed, as CI installs it) the dashboard page showing the rounds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from stalwart.coord.client import LighthouseClient
from stalwart.coord.rounds import RoundsBoard, parse_rounds_report
from stalwart.coord.server import Lighthouse
from stalwart.coord.wire import RequestError
from stalwart.testing.digits_job import PLAN
from stalwart.testing.waiting import wait_until
from tests.integration.dashboard_client import CHROMIUM_FLAGS, TOKEN, bearer, first_event, http, metric_values

REPORT = {"inner_steps": 16, "fragments": 4, "inner_step": 3, "in_flight": 1, "bytes": 1000, "exchanges": 2}


def status_with(members: list[str], step: int = 5) -> dict[str, Any]:
    return {"quorum": {"members": members}, "ledger": {"step": step}}


def test_rounds_are_kept_per_incarnation_and_their_bytes_counted_once() -> None:
    registry = CollectorRegistry()
    board = RoundsBoard(registry)
    assert board.to_status(status_with(["w0"])) is None  # no member trains in rounds
    heartbeat = {"applied_step": 5, "rounds": dict(REPORT)}
    assert board.take("w0", "a" * 32, heartbeat) is None
    assert heartbeat == {"applied_step": 5}, "the rounds field is removed before the heartbeat is parsed"
    board.take("w0", "a" * 32, {"rounds": dict(REPORT)})  # repeated: nothing more
    board.take("w0", "a" * 32, {"rounds": {**REPORT, "bytes": 1500, "exchanges": 3, "in_flight": 0}})
    board.take("w1", "c" * 32, {"rounds": {**REPORT, "bytes": 700}})
    board.take("w0", "b" * 32, {"rounds": {**REPORT, "bytes": 10, "exchanges": 1}})  # restarted: from 0 again
    rounds = board.to_status(status_with(["w0"]))
    assert rounds is not None
    assert rounds["bytes_exchanged"] == 1500 + 700 + 10  # every incarnation's bytes, each once
    assert rounds["exchanges"] == 3  # the members' current incarnations: w0's 1, w1's 2
    assert list(rounds["members"]) == ["w0"] and rounds["members"]["w0"]["bytes"] == 10
    assert (rounds["inner_steps"], rounds["fragments"], rounds["rounds_committed"]) == (16, 4, 5)
    assert rounds["fragments_in_flight"] == 1
    assert registry.get_sample_value("stalwart_bytes_exchanged_total") == 1500 + 700 + 10
    assert registry.get_sample_value("stalwart_rounds_committed") == 5
    assert registry.get_sample_value("stalwart_fragments_in_flight") == 1


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ([], "rounds must be an object"),
        ({**REPORT, "extra": 1}, "rounds must be an object"),
        ({**REPORT, "bytes": -1}, "rounds['bytes']"),
        ({**REPORT, "inner_steps": 0}, "rounds['inner_steps']"),
        ({**REPORT, "in_flight": True}, "rounds['in_flight']"),
        ({**REPORT, "exchanges": 1.5}, "rounds['exchanges']"),
    ],
)
def test_a_malformed_rounds_report_names_the_field_and_value(value: Any, needle: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_rounds_report(value)
    assert refused.value.status == 400 and needle in refused.value.message
    board = RoundsBoard(CollectorRegistry())
    heartbeat = {"applied_step": 0, "rounds": value}
    error = board.take("w0", None, heartbeat)
    assert error is not None and needle in error and heartbeat == {"applied_step": 0}


@pytest.fixture
def lighthouse(tmp_path: Path) -> Any:
    server = Lighthouse(PLAN, token=TOKEN, state_path=tmp_path / "state.sqlite", min_replicas=1)
    server.start()
    yield server
    server.stop()


def test_round_figures_reach_the_status_events_and_metrics_and_a_malformed_one_is_refused(
    lighthouse: Lighthouse,
) -> None:
    figures = dict(REPORT)
    with LighthouseClient(lighthouse.url, "group-a", token=TOKEN, heartbeat_interval=0.05) as client:
        client.start_heartbeat(lambda: 0)
        client.report_rounds(lambda: dict(figures))
        client.quorum(applied_step=0, quorum_id=None, reason="join", timeout=60)
        wait_until(lambda: (lighthouse.status()["rounds"] or {}).get("members"), 60, "the rounds figures")
        figures.update(bytes=4000, exchanges=5)
        wait_until(lambda: lighthouse.status()["rounds"]["bytes_exchanged"] == 4000, 60, "the new totals")
        rounds = lighthouse.status()["rounds"]
        assert rounds["members"]["group-a"]["inner_step"] == 3 and rounds["inner_steps"] == 16
        event = first_event(lighthouse.url + "/v1/events", bearer())
        assert event["status"]["rounds"]["bytes_exchanged"] == 4000
        values = metric_values(lighthouse.url)
        assert values["stalwart_bytes_exchanged_total"] == 4000 and values["stalwart_exchanges_total"] == 5
        assert values["stalwart_inner_steps"] == 16 and values["stalwart_fragments_in_flight"] == 1
        with pytest.raises(TypeError, match="rounds must be callable"):
            client.report_rounds(3)  # type: ignore[arg-type]
        headers = {**bearer(), **client.identity_headers()}

        async def send_malformed() -> dict[str, Any]:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(lighthouse.url + "/v1/heartbeat?member=group-a", headers=headers) as socket,
            ):
                await socket.send_json({"applied_step": 0, "rounds": {**REPORT, "bytes": "lots"}})
                return await socket.receive_json(timeout=30)

        reply = asyncio.run(send_malformed())
    assert reply["type"] == "error" and "rounds['bytes']" in reply["error"] and "'lots'" in reply["error"]
    assert http(lighthouse.url + "/healthz")[0] == 200
    assert metric_values(lighthouse.url)["stalwart_bytes_exchanged_total"] == 4000


def test_the_dashboard_shows_the_rounds(lighthouse: Lighthouse, tmp_path: Path) -> None:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver (CI installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    page = None
    with LighthouseClient(lighthouse.url, "group-a", token=TOKEN, heartbeat_interval=0.05) as client:
        client.start_heartbeat(lambda: 0)
        client.report_rounds(lambda: dict(REPORT))
        client.quorum(applied_step=0, quorum_id=None, reason="join", timeout=60)
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
        os.environ["SE_OFFLINE"] = "true"
        browser = webdriver.Chrome(options=options, service=Service(executable_path=driver))
        try:
            browser.get(lighthouse.url + "/?token=" + TOKEN)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                page = browser.execute_script(
                    "const s = document.getElementById('rounds'); return {hidden: s.hidden, "
                    "summary: document.getElementById('rounds-summary').textContent, "
                    "rows: [...document.querySelectorAll('#round-members tbody tr')].map(r => r.dataset.key)};"
                )
                if page and not page["hidden"] and page["rows"]:
                    break
                time.sleep(0.2)
        finally:
            browser.quit()
    assert page is not None and not page["hidden"] and page["rows"] == ["group-a"]
    assert "16 inner steps, 4 fragments" in page["summary"] and "1,000 bytes exchanged" in page["summary"]
