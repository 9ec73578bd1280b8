"""A client of the lighthouse's dashboard routes for tests: GETs with the token, /metrics parsed, the first event,
and the headless Chromium flags the page tests use."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TOKEN = "dashboard-test-token"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1200",
)  # fmt: skip


def http(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    """One GET: (status, body, headers)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def metric_values(url: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's parser: ``name{label=value,...}`` -> value."""
    status, body, headers = http(url + "/metrics", bearer())
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def first_event(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The data of the first ``status`` event of ``/v1/events``."""
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        event = None
        for _ in range(100):
            line = response.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: ") and event == "status":
                return json.loads(line[len("data: ") :])
    raise AssertionError("no status event in the first 100 lines")
