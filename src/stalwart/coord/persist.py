"""The lighthouse's state in SQLite, so that a killed and restarted lighthouse resumes.

Two tables (JSON, never pickle): ``lighthouse_state`` holds one small *core*
row (the ledger, the quorum, its formation, members, healing, identities and
the history's counts: :meth:`LighthouseState.core_state_dict
<stalwart.coord.quorum.LighthouseState.core_state_dict>`), rewritten on every
change; ``history`` holds one append-only row per failure, departure, quorum
and recovery, inserted as it happens and trimmed to ``HISTORY_LIMIT`` rows per
kind. A save is one transaction, so its cost does not grow with the history.
The database runs in WAL mode with ``synchronous=NORMAL``: a committed write
survives the process being killed (SIGKILL) at any instant; only an
operating-system crash can lose the last writes, and even then the ledger
catches up again from the members' heartbeats.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stalwart.coord.history import HISTORY_LIMIT, KINDS
from stalwart.data.plan import EpochPlan

_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS lighthouse_state (
        id INTEGER PRIMARY KEY CHECK (id = 0),
        revision INTEGER NOT NULL,
        saved_at REAL NOT NULL,
        state TEXT NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS history (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL,
        event TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS history_kind ON history (kind, seq)",
)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class StateStore:
    """Reads and saves the persisted lighthouse state in the SQLite file ``path``.

    Used from one thread at a time (the lighthouse's single save thread once it runs).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        self.path = Path(path)
        self._connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.execute("PRAGMA synchronous=NORMAL")
        for statement in _SCHEMA:
            self._connection.execute(statement)

    def load(self) -> dict[str, Any] | None:
        """The persisted state (a full ``state_dict``, history included), or None when nothing was saved yet."""
        row = self._connection.execute("SELECT state FROM lighthouse_state WHERE id = 0").fetchone()
        if row is None:
            return None
        try:
            state = json.loads(row[0])
        except ValueError as error:
            raise ValueError(f"the lighthouse state in {self.path} is not valid JSON: {error}") from error
        if not isinstance(state, dict) or not isinstance(state.get("history"), dict):
            raise ValueError(f"the lighthouse state in {self.path} must be a JSON object with a history")
        history = state["history"]
        rows = self._connection.execute("SELECT kind, event FROM history ORDER BY seq").fetchall()
        if rows or any(kind not in history for kind in KINDS):
            events: dict[str, list[Any]] = {kind: [] for kind in KINDS}
            for kind, event in rows:
                if kind in events:
                    events[kind].append(json.loads(event))
            for kind in KINDS:
                history[kind] = [*history.get(kind, []), *events[kind]][-HISTORY_LIMIT:]
        return state

    def save(
        self, core: dict[str, Any], events: Sequence[tuple[str, dict[str, Any]]], revision: int, saved_at: float
    ) -> None:
        """Replace the core row and append ``events`` (``(kind, event)``), trimming each kind; one transaction."""
        core_text = _dumps(core)
        rows = [(kind, _dumps(event)) for kind, event in events]
        connection = self._connection
        connection.execute("BEGIN")
        try:
            connection.execute(
                "INSERT OR REPLACE INTO lighthouse_state (id, revision, saved_at, state) VALUES (0, ?, ?, ?)",
                (revision, saved_at, core_text),
            )
            if rows:
                connection.executemany("INSERT INTO history (kind, event) VALUES (?, ?)", rows)
                for kind in {kind for kind, _ in rows}:
                    connection.execute(
                        "DELETE FROM history WHERE kind = ? AND seq <= "
                        "(SELECT seq FROM history WHERE kind = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                        (kind, kind, HISTORY_LIMIT),
                    )
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close the database."""
        self._connection.close()


def read_ledger(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ledger state persisted in ``path``, or None when the file does not exist or holds no state."""
    if not Path(path).exists():
        return None
    store = StateStore(path)
    try:
        state = store.load()
    finally:
        store.close()
    return None if state is None else dict(state["ledger"])


def read_plan(path: str | os.PathLike[str]) -> EpochPlan | None:
    """The plan persisted in ``path``, or None when the file does not exist or holds no state."""
    ledger = read_ledger(path)
    return None if ledger is None else EpochPlan(**ledger["plan"])
