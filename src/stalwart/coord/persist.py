"""The lighthouse's state in SQLite, so that a killed and restarted lighthouse resumes.

Five tables (JSON, never pickle), each written only when its part changed
(:class:`~stalwart.coord.snapshot.Changes`), so a save costs what changed, not
the number of members: ``lighthouse_state`` holds one small *core* row (the
ledger, healing, the history's counts, the checkpoint), rewritten on every
change; ``parts`` holds the ``formation`` row (the quorum and its formation),
rewritten when a quorum forms; ``answered`` holds one row per request the
quorum answered, written once as it is answered (a file written before this
table kept them in the formation row, and loads as before); ``members`` holds
one row per member (its registered incarnation and the hashes of its secrets),
written when it appears, registers or is forgotten; ``history`` holds one
append-only row per failure, departure, quorum and recovery, trimmed to
``HISTORY_LIMIT`` rows per kind. A save is one transaction. The database runs
in WAL mode with ``synchronous=FULL``: every commit is synced to the disk
before it returns, so a quorum answer, registration or checkpoint (each
awaits its save) survives an operating-system crash as well as the process
being killed; ``benchmarks/persist_save.py`` measures what the sync costs.
A file written before the parts existed (one row holding the whole state)
loads as before.

One lighthouse at a time: the database file itself is locked exclusively
(``flock`` on a descriptor of the file, so a symlink or a hard link to it
meets the same lock; SQLite's own locks are POSIX record locks, which do not
interact with it) while a :class:`StateStore` is open, so a second lighthouse
on the same state, by whatever name, refuses to start
(:class:`StateLockedError`, naming the holder's pid from ``/proc/locks``, or
the note ``REALPATH.lock`` the holder writes) instead of serving a split
brain. The database, its ``-wal`` and ``-shm`` files and the note are
created readable by their owner only (0600): they hold the quorum's members,
incarnations and the hashes of their secrets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

from stalwart.coord.history import HISTORY_LIMIT, KINDS
from stalwart.coord.snapshot import Changes
from stalwart.data.plan import EpochPlan
from stalwart.errors import StalwartError

FILE_MODE = 0o600

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
    "CREATE TABLE IF NOT EXISTS answered (member TEXT PRIMARY KEY, request TEXT NOT NULL)",
)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class StateLockedError(StalwartError, RuntimeError):
    """Another lighthouse holds the state file (the message names it): two would split the job's brain."""


class StateStore:
    """Reads and saves the persisted lighthouse state in the SQLite file ``path``, which it locks while open.

    Used from one thread at a time (the lighthouse's single save thread once
    it runs). ``synchronous``: SQLite's setting, ``FULL`` (every commit synced)
    unless a benchmark compares.
    """

    def __init__(self, path: str | os.PathLike[str], *, synchronous: str = "FULL") -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be 'FULL' or 'NORMAL', got {synchronous!r}")
        self.path = Path(path)
        self._lock = _lock(self.path)
        try:
            for suffix in ("", "-wal", "-shm"):
                _owner_only(Path(f"{self.path}{suffix}"))
            self._connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute(f"PRAGMA synchronous={synchronous}")
            for statement in _SCHEMA:
                self._connection.execute(statement)
        except BaseException:
            os.close(self._lock)
            raise

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
        answered = self._connection.execute("SELECT member, request FROM answered ORDER BY rowid").fetchall()
        if answered:
            state["answered"] = {member: json.loads(text) for member, text in answered}
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
        """Write what changed: the core row, the formation row, member and answer rows that changed (every row, the
        others deleted, for ``every_member`` and ``every_answer``), new events; one transaction."""
        core_text = _dumps(changes.core)
        formation_text = None if changes.formation is None else _dumps(changes.formation)
        upserts = [(name, _dumps(row)) for name, row in changes.members.items() if row is not None]
        deletes = [(name,) for name, row in changes.members.items() if row is None]
        answers = [(member, _dumps(request)) for member, request in changes.answered.items() if request is not None]
        withdrawn = [(member,) for member, request in changes.answered.items() if request is None]
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
            if changes.every_member:
                connection.execute("DELETE FROM members")
            if upserts:
                connection.executemany(
                    "INSERT INTO members (name, state) VALUES (?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET state = excluded.state",  # keeps the row's order
                    upserts,
                )
            if deletes:
                connection.executemany("DELETE FROM members WHERE name = ?", deletes)
            if changes.every_answer:
                connection.execute("DELETE FROM answered")
            if answers:
                connection.executemany(
                    "INSERT INTO answered (member, request) VALUES (?, ?) "
                    "ON CONFLICT (member) DO UPDATE SET request = excluded.request",
                    answers,
                )
            if withdrawn:
                connection.executemany("DELETE FROM answered WHERE member = ?", withdrawn)
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
        """Close the database, remove the holder's note and release the lock."""
        self._connection.close()
        if self._lock >= 0:
            with contextlib.suppress(OSError):
                Path(f"{self.path.resolve()}.lock").unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = -1


def _lock(path: Path) -> int:
    """Open the database file (created 0600 when missing) and lock it exclusively: its descriptor.

    :class:`StateLockedError` naming ``path`` and the holder when another process holds it.
    """
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    note = Path(f"{path.resolve()}.lock")
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(os.fstat(descriptor), note)
        os.close(descriptor)
        raise StateLockedError(
            f"the lighthouse state {path} is in use by another lighthouse ({holder}); stop it first, or give this "
            "one another --state file"
        ) from None
    except BaseException:
        os.close(descriptor)
        raise
    try:
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        note.unlink(missing_ok=True)
        note_descriptor = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.write(note_descriptor, holder.encode())
        finally:
            os.close(note_descriptor)
    except OSError:
        pass  # the note only helps name the holder; the lock is the database's
    return descriptor


def _holder(stat: os.stat_result, note: Path) -> str:
    """Who holds the lock on the file of ``stat``: the pid from ``/proc/locks`` (Linux, this machine), else the
    holder's note, else "an unknown process"."""
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:
                return f"pid {fields[4]}"
    except OSError:
        pass
    try:
        return note.read_text(errors="replace").strip()[:200] or "an unknown process"
    except OSError:
        return "an unknown process"


def _owner_only(path: Path) -> None:
    """Make an existing file readable and writable by its owner only (an older lighthouse created 0644 files)."""
    try:
        if path.stat().st_mode & 0o777 != FILE_MODE:
            path.chmod(FILE_MODE)
    except FileNotFoundError:
        pass


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
