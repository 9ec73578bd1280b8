"""Persistence fails closed: a quorum the lighthouse could not save is not handed out until a save succeeds."""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stalwart.coord.client import LighthouseClient
from stalwart.coord.history import HISTORY_LIMIT
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import LighthouseState
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan

PLAN = EpochPlan(64, 8, seed=2)


def post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_quorum_that_could_not_be_saved_is_not_handed_out_until_a_save_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    options: dict[str, Any] = {"state_path": path, "heartbeat_timeout": 5.0, "join_timeout": 0.5}
    with Lighthouse(PLAN, **options) as server, LighthouseClient(server.url, "a", heartbeat_interval=0.05) as client:
        client.start_heartbeat(lambda: 0)
        assert client.quorum(0, None, "join", 20).quorum_id == 1
        database = server.saves.database
        assert database is not None
        database._connection.close()  # the real SQLite connection fails under the running lighthouse
        headers = client.identity_headers()
        request = {"member": "a", "applied_step": 0, "quorum_id": 1, "reason": "reconfigure"}
        status, body = post(server.url + "/v1/quorum", request, headers)
        assert status == 503 and "could not persist quorum 2" in body["error"], body
        assert server.status()["quorum"]["quorum_id"] == 2, "formed in memory, but never handed out"
        with pytest.raises(TimeoutError):
            client.quorum(0, 1, "reconfigure", 1.0)
        database._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        answer = client.quorum(0, 1, "reconfigure", 20)
        assert answer.quorum_id == 2, "the retried request gets the quorum once it is saved"
    with Lighthouse(PLAN, **options) as restarted:
        assert restarted.status()["quorum"]["quorum_id"] == 2


def test_history_rows_are_appended_and_trimmed_and_load_back(tmp_path: Path) -> None:
    state = LighthouseState(PLAN, heartbeat_timeout=1.0)
    store = StateStore(tmp_path / "state.db")
    try:
        for n in range(HISTORY_LIMIT + 30):
            state.connected(f"m{n}", float(n))
            state.disconnected(f"m{n}", float(n))
            if n % 100 == 0 or n == HISTORY_LIMIT + 29:
                store.save(state.changes(), float(n))
        rows = store._connection.execute(  # private on purpose: the rows on disk, not what the store says
            "SELECT COUNT(*) FROM history WHERE kind = 'failures'"
        ).fetchone()[0]
        assert rows == HISTORY_LIMIT
        loaded = store.load()
        assert loaded is not None
        assert loaded == json.loads(json.dumps(state.state_dict()))
        assert loaded["history"]["counts"]["failures"] == HISTORY_LIMIT + 30
    finally:
        store.close()
