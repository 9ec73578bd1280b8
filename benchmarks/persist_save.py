"""Time one lighthouse save at the history cap: the old single JSON row against what changed (core row, events),
and what makes a save durable on an operating-system crash costs (``synchronous=FULL``, the lighthouse's, against
``NORMAL``: a sync of the write-ahead log per commit).

Run: ``python -m benchmarks.persist_save`` (prints milliseconds per save, median of ``--repeat`` saves, with the
spread; the FULL and NORMAL saves alternate, so the disk's and the machine's load fall on both alike).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._rounds import fixed, interleaved_rounds, span
from stalwart.coord.history import HISTORY_LIMIT
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import LighthouseState, QuorumRequest
from stalwart.data.plan import EpochPlan


def full_state(members: int) -> LighthouseState:
    """A lighthouse state whose four histories are at ``HISTORY_LIMIT``."""
    state = LighthouseState(EpochPlan(100_000, 256, seed=0), heartbeat_timeout=1.0, join_timeout=1.0)
    now = 0.0
    for n in range(HISTORY_LIMIT + 10):
        name = f"member-{n}"
        state.connected(name, now)
        state.request(QuorumRequest(name, 0, None, "join"), now)
        state.tick(now)
        state.leave(name, now) if n % 2 else state.disconnected(name, now)
        now += 1.0
    for n in range(members):
        state.connected(f"live-{n}", now)
    state.history.drain()
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--members", type=int, default=64)
    args = parser.parse_args()
    state = full_state(args.members)
    with tempfile.TemporaryDirectory() as folder:
        old = sqlite3.connect(Path(folder) / "old.db", isolation_level=None)
        old.execute("PRAGMA journal_mode=WAL")
        old.execute("PRAGMA synchronous=NORMAL")
        old.execute("CREATE TABLE s (id INTEGER PRIMARY KEY, revision INTEGER, saved_at REAL, state TEXT)")
        store = StateStore(Path(folder) / "new.db")
        store.save(state.changes(), 0.0)
        old_times, new_times = [], []
        for n in range(args.repeat):
            state.connected(f"extra-{n}", float(n))
            state.disconnected(f"extra-{n}", float(n))
            started = time.perf_counter()
            text = json.dumps(state.state_dict(), separators=(",", ":"), allow_nan=False)
            old.execute("INSERT OR REPLACE INTO s VALUES (0, ?, ?, ?)", (state.revision, 0.0, text))
            old_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            changes = state.changes()
            store.save(changes, 0.0)
            new_times.append(time.perf_counter() - started)
        size = len(json.dumps(state.state_dict()))
        core = len(json.dumps(changes.core))
        print(f"history at the cap ({HISTORY_LIMIT} per kind), {args.members} live members, {args.repeat} saves:")
        print(f"  old single JSON row: {statistics.median(old_times) * 1e3:.2f} ms/save ({size} bytes of JSON)")
        median = statistics.median(new_times) * 1e3
        print(f"  what changed (core row, events): {median:.2f} ms/save ({core} bytes of core)")
        store.close()
        old.close()
        durable = StateStore(Path(folder) / "full.db")
        loose = StateStore(Path(folder) / "normal.db", synchronous="NORMAL")
        targets = {"FULL": durable, "NORMAL": loose}
        for target in targets.values():
            target.save(state.changes(), 0.0)

        def save(name: str, n: int) -> float:
            state.connected(f"durable-{name}-{n}", float(n))
            changes = state.changes()
            started = time.perf_counter()
            targets[name].save(changes, 0.0)
            return time.perf_counter() - started

        times = interleaved_rounds(tuple(targets), args.repeat, save)
        full, normal = (statistics.median(times[name]) * 1e3 for name in targets)
        for name in targets:
            spread = span(times[name], fixed(2, 1e3))
            print(f"  synchronous={name}: {statistics.median(times[name]) * 1e3:.2f} ms/save (spread {spread})")
        print(f"  durable on an OS crash (FULL) / NORMAL: {full / normal:.1f}x")
        durable.close()
        loose.close()


if __name__ == "__main__":
    main()
