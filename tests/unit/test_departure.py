"""Preemption's parts: the departure request and its SIGTERM handler (real signals), who leaves, the tail's slots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stalwart import Manager
from stalwart.runtime.consistency import DRIFT_SLOTS
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.preemption import Departure, departing_members
from stalwart.runtime.tail import TailHead, TailLayout


@pytest.fixture
def restored_sigterm() -> Iterator[None]:
    """Whatever a test installs for SIGTERM, the handler before it is put back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_requests_a_departure_and_chains_to_the_previous_handler(restored_sigterm: None) -> None:
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    departure = Departure()
    departure.install()
    assert not departure.requested
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next bytecode of this thread
    assert departure.requested and departure.reason == "SIGTERM"
    assert seen == [signal.SIGTERM]
    departure.uninstall()
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM] * 2, "the previous handler is back"


def test_the_default_action_is_not_chained(restored_sigterm: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    departure = Departure()
    departure.install()
    os.kill(os.getpid(), signal.SIGTERM)  # with SIG_DFL chained, this process would end here
    assert departure.requested
    departure.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_second_sigterm_takes_the_default_action() -> None:
    script = (
        "import os, signal\n"
        "from stalwart.runtime.preemption import Departure\n"
        "departure = Departure()\n"
        "departure.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "assert departure.requested\n"
        "print('first', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('survived')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "first\n"), done.stderr


def test_uninstall_leaves_a_handler_installed_after_it(restored_sigterm: None) -> None:
    departure = Departure()
    departure.install()

    def later(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGTERM, later)
    departure.uninstall()
    assert signal.getsignal(signal.SIGTERM) is later


def test_the_first_reason_is_kept_and_a_reason_is_checked() -> None:
    departure = Departure()
    departure.request("spot notice")
    departure.request("SIGTERM")
    assert departure.reason == "spot notice"
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        departure.request("")


def test_install_outside_the_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            Departure().install()
        except ValueError as error:
            errors.append(error)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(10.0)
    assert len(errors) == 1 and "main thread" in str(errors[0])


@pytest.mark.parametrize(
    ("sigterm", "sync", "error", "match"),
    [
        ("yes", None, TypeError, "sigterm must be True, False or None, got 'yes'"),
        (1, None, TypeError, "sigterm must be True, False or None, got 1"),
        (True, DiLoCo(inner_steps=2), ValueError, "sigterm=True with sync=DiLoCo"),
    ],
)
def test_the_managers_sigterm_argument_is_checked(sigterm: Any, sync: Any, error: type, match: str) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        Manager(
            model, optimizer, max_microbatch=1, lighthouse="http://127.0.0.1:9", member="m", sigterm=sigterm, sync=sync
        )


@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.data())
def test_a_group_leaves_whole_when_any_of_its_processes_asks(sizes: list[int], data: st.DataObject) -> None:
    members = [f"group-{index}" for index in range(len(sizes))]
    total = sum(sizes)
    ranks = data.draw(st.lists(st.integers(0, total - 1), unique=True, max_size=total))
    leaving = departing_members(ranks, members, sizes)
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    expected = [
        m for m, start, size in zip(members, starts, sizes, strict=True) if set(ranks) & set(range(start, start + size))
    ]
    assert list(leaving) == expected
    assert departing_members([], members, sizes) == ()


def test_departing_ranks_outside_the_quorum_are_refused() -> None:
    with pytest.raises(ValueError, match="not all in the quorum's 3 processes"):
        departing_members([3], ["a", "b"], [1, 2])
    with pytest.raises(ValueError, match="2 members but 1 group sizes"):
        departing_members([0], ["a", "b"], [1])


@given(st.integers(1, 6), st.data())
def test_the_tail_carries_each_processs_departure(processes: int, data: st.DataObject) -> None:
    layout = TailLayout(processes, balanced=False)
    departing = data.draw(st.sets(st.integers(0, processes - 1)))
    total = torch.zeros(layout.size)
    for rank in range(processes):  # the all-reduce's sum of every process's tail
        head = TailHead(
            drift=torch.zeros(DRIFT_SLOTS * processes),
            loaded_checksum=0,
            row_checksum=0,
            samples=1,
            reconfigure=False,
            departures=layout.departure_slots(rank, rank in departing),
        )
        total += layout.encode(layout.balance_slots(rank, 0.0, 0), head, torch.tensor(1.0), torch.tensor(0.5))
    reduced = layout.decode(total)
    assert reduced.departing == tuple(sorted(departing))
    assert (reduced.samples, reduced.reconfigure, reduced.weight) == (processes, False, float(processes))
