"""The lighthouse's state in SQLite, so that a killed and restarted lighthouse resumes.

One row holds the JSON of :meth:`LighthouseState.state_dict
<stalwart.coord.quorum.LighthouseState.state_dict>` (never pickle), replaced
after every ledger commit and quorum formation. The database runs in WAL mode
with ``synchronous=NORMAL``: a committed write survives the process being
killed (SIGKILL) at any instant; only an operating-system crash can lose the
last writes, and even then the ledger catches up again from the members'
heartbeats.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from stalwart.data.plan import EpochPlan

_SCHEMA = """
CREATE TABLE IF NOT EXISTS lighthouse_state (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    revision INTEGER NOT NULL,
    saved_at REAL NOT NULL,
    state TEXT NOT NULL
)
"""


class StateStore:
    """Reads and replaces the one persisted lighthouse state in the SQLite file ``path``.

    Used from one thread at a time (the lighthouse's event loop once it runs).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        self.path = Path(path)
        self._connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.execute("PRAGMA synchronous=NORMAL")
        self._connection.execute(_SCHEMA)

    def load(self) -> dict[str, Any] | None:
        """The persisted state, or None when nothing was saved yet."""
        row = self._connection.execute("SELECT state FROM lighthouse_state WHERE id = 0").fetchone()
        if row is None:
            return None
        try:
            state = json.loads(row[0])
        except ValueError as error:
            raise ValueError(f"the lighthouse state in {self.path} is not valid JSON: {error}") from error
        if not isinstance(state, dict):
            raise ValueError(f"the lighthouse state in {self.path} must be a JSON object")
        return state

    def save(self, state: dict[str, Any], revision: int, saved_at: float) -> None:
        """Replace the persisted state (one transaction)."""
        text = json.dumps(state, separators=(",", ":"), allow_nan=False)
        self._connection.execute(
            "INSERT OR REPLACE INTO lighthouse_state (id, revision, saved_at, state) VALUES (0, ?, ?, ?)",
            (revision, saved_at, text),
        )

    def close(self) -> None:
        """Close the database."""
        self._connection.close()


def read_plan(path: str | os.PathLike[str]) -> EpochPlan | None:
    """The plan persisted in ``path``, or None when the file does not exist or holds no state."""
    if not Path(path).exists():
        return None
    store = StateStore(path)
    try:
        state = store.load()
    finally:
        store.close()
    if state is None:
        return None
    return EpochPlan(**state["ledger"]["plan"])
