"""The lighthouse's state in SQLite, so that a killed and restarted lighthouse resumes.

Four tables (JSON, never pickle), each written only when its part changed
(:class:`~stalwart.coord.quorum.Changes`), so a save costs what changed, not
the number of members: ``lighthouse_state`` holds one small *core* row (the
ledger, healing, the history's counts, the checkpoint), rewritten on every
change; ``parts`` holds the ``formation`` row (the quorum, its formation and
the requests it answered), rewritten when a quorum forms; ``members`` holds
one row per member (its registered incarnation and the hashes of its secrets),
written when it appears, registers or is forgotten; ``history`` holds one
append-only row per failure, departure, quorum and recovery, trimmed to
``HISTORY_LIMIT`` rows per kind. A save is one transaction. The database runs
in WAL mode with ``synchronous=NORMAL``: a committed write survives the process
being killed (SIGKILL) at any instant; only an operating-system crash can lose
the last writes, and even then the ledger catches up again from the members'
heartbeats. A file written before the parts existed (one row holding the whole
state) loads as before.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from stalwart.coord.history import HISTORY_LIMIT, KINDS
from stalwart.coord.quorum import Changes
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
    "CREATE TABLE IF NOT EXISTS parts (name TEXT PRIMARY KEY, state TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS members (name TEXT PRIMARY KEY, state TEXT NOT NULL)",
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
        for (text,) in self._connection.execute("SELECT state FROM parts WHERE name = 'formation'"):
            state.update(json.loads(text))
        members = self._connection.execute("SELECT name, state FROM members ORDER BY rowid").fetchall()
        if members or "members" not in state:
            state["members"] = {}
            state["identities"] = {"current": {}, "retired": {}}
        for name, text in members:
            member = json.loads(text)
            state["members"][name] = None
            if member["identity"] is not None:
                state["identities"]["current"][name] = member["identity"]
            if member["retired"]:
                state["identities"]["retired"][name] = member["retired"]
        for key, empty in (("quorum", None), ("formation", None), ("answered", {})):
            state.setdefault(key, empty)
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

    def save(self, changes: Changes, saved_at: float) -> None:
        """Write what changed: the core row, the formation row and member rows that changed, new events; one
        transaction."""
        core_text = _dumps(changes.core)
        formation_text = None if changes.formation is None else _dumps(changes.formation)
        upserts = [(name, _dumps(row)) for name, row in changes.members.items() if row is not None]
        deletes = [(name,) for name, row in changes.members.items() if row is None]
        rows = [(kind, _dumps(event)) for kind, event in changes.events]
        connection = self._connection
        connection.execute("BEGIN")
        try:
            connection.execute(
                "INSERT OR REPLACE INTO lighthouse_state (id, revision, saved_at, state) VALUES (0, ?, ?, ?)",
                (changes.revision, saved_at, core_text),
            )
            if formation_text is not None:
                connection.execute(
                    "INSERT OR REPLACE INTO parts (name, state) VALUES ('formation', ?)", (formation_text,)
                )
            if upserts:
                connection.executemany(
                    "INSERT INTO members (name, state) VALUES (?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET state = excluded.state",  # keeps the row's order
                    upserts,
                )
            if deletes:
                connection.executemany("DELETE FROM members WHERE name = ?", deletes)
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
