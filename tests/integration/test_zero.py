"""ShardedOptimizer over real Gloo groups of processes that exit at named points of the sharded step.

``tests/integration/zero_job.py`` runs the processes (killed at the instrumented loop's points,
:data:`stalwart.launch.loop.KILL_POINTS`): every process gets the same mean
gradient each step (as after the all-reduce), so the final parameters must
equal a single-process run of the same optimizer bit for bit whatever fails,
and every copy of a shard must be bitwise equal to its primary.
"""

from __future__ import annotations

import datetime
import json
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.launch.processes import preloaded_context
from stalwart.redundancy.config import Parity
from stalwart.redundancy.layout import layout_from, make_layout
from stalwart.redundancy.memory import state_bytes
from tests.integration import zero_job

STEPS = 6
JOB_TIMEOUT = 300


def run_job(tmp_path: Path, world: int, options: list[str], *, join_at: int | None = None) -> list[int]:
    """Run ``world`` processes (and a joiner at ``join_at``); their exit codes.

    The processes are forked from the fork server that imported torch once
    (``preloaded_context``), so a process starts in a fraction of a second; not
    from this process, whose other threads (an HTTP client's, a progress
    monitor's) could hold a lock at the fork and leave the child stuck on it.
    The store they meet on lives here.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=JOB_TIMEOUT)
    )
    processes = world + (join_at is not None)
    common = ["--world", str(world), "--port", str(store.port), "--steps", str(STEPS), "--out", str(tmp_path)]
    joining = [] if join_at is None else ["--join-at", str(join_at)]
    fork = preloaded_context()
    launched = [
        fork.Process(target=zero_job.run, args=(["--rank", str(rank), *common, *options, *joining],))
        for rank in range(processes)
    ]
    for process in launched:
        process.start()
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        for process in launched:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
        return [-1 if process.exitcode is None else process.exitcode for process in launched]
    finally:
        for process in launched:
            process.kill()
            process.join(timeout=10)


def results(tmp_path: Path) -> dict[int, dict]:
    return {int(path.stem.split("-")[1]): torch.load(path) for path in sorted(tmp_path.glob("rank-*.pt"))}


def check_run(tmp_path: Path, optimizer: str, finishers: int) -> dict[int, dict]:
    """Final parameters and optimizer state equal the single-process run's bit for bit; so do copies their primary."""
    expected, expected_state = zero_job.reference(optimizer, STEPS)
    finished = results(tmp_path)
    assert len(finished) == finishers
    (whole,) = [result["optimizer"] for result in finished.values() if result["optimizer"] is not None]
    assert whole.keys() == expected_state.keys()
    for index, state in expected_state.items():
        assert whole[index].keys() == state.keys()
        assert all(torch.equal(whole[index][key], value) for key, value in state.items()), index
    for result in finished.values():  # gathered onto every rank: the same whole state on each
        everywhere = result["optimizer_everywhere"]
        assert everywhere.keys() == whole.keys()
        for index, state in whole.items():
            assert all(torch.equal(everywhere[index][key], value) for key, value in state.items()), index
    holders: dict[int, list[torch.Tensor]] = {}
    for result in finished.values():
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value), name
        for shard, rows in result["rows"].items():
            holders.setdefault(shard, []).append(rows)
    for copies in holders.values():
        assert all(torch.equal(copy, copies[0]) for copy in copies)
    return finished


CASES = [
    (["--overlap", "0.25"], ["3:during_update:1"]),
    (["--overlap", "0.25"], ["3:step_started:0"]),
    (["--parity", "3,1"], ["3:during_parity:1"]),
    (["--parity", "3,1"], ["3:during_gather:2"]),
    (["--parity", "2,2", "--optimizer", "sgd"], ["1:during_update:1", "1:during_update:2"]),
    (["--overlap", "0.5", "--optimizer", "adamw"], ["4:during_gather:1", "4:during_update:2"]),
    (["--parity", "3,1", "--optimizer", "adamw-groups"], ["3:during_parity:1"]),  # groups, each its own lr and decay
    (["--overlap", "0.25", "--optimizer", "adamw-groups"], ["2:during_update:2"]),
    (["--overlap", "1"], ["3:during_gather:1"]),  # every process holds every shard: no gather to die in
]


@pytest.mark.parametrize(("options", "kills"), CASES, ids=lambda value: " ".join(value))
def test_exit_at_a_point_of_the_sharded_step(tmp_path: Path, options: list[str], kills: list[str]) -> None:
    codes = run_job(tmp_path, 4, [*options, *(f"--kill={kill}" for kill in kills)])
    killed = {int(kill.split(":")[2]) for kill in kills}
    assert codes == [-signal.SIGKILL if process in killed else 0 for process in range(4)]
    optimizer = options[options.index("--optimizer") + 1] if "--optimizer" in options else "adam"
    finished = check_run(tmp_path, optimizer, finishers=4 - len(kills))
    assert all(result["layout_processes"] == 4 - len(kills) for result in finished.values())
    assert all(result["repairs"] == 1 for result in finished.values())
    for result in finished.values():  # what each holds is what the formula says for its layout
        layout = layout_from(result["layout"])
        expected = state_bytes(layout.placement, zero_job.parameters(), state_elements=3 if optimizer != "sgd" else 2)
        assert result["state_bytes"] == expected[result["rank"]]


def test_two_processes_of_one_node_are_survived_by_node_aware_copies(tmp_path: Path) -> None:
    """Six processes on three nodes, overlap 1/3 (two copies): node b's two processes die at once."""
    nodes = "a,a,b,b,c,c"
    codes = run_job(
        tmp_path, 6, ["--overlap", "0.34", "--nodes", nodes, "--kill=3:during_gather:2", "--kill=3:during_gather:3"]
    )
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL, 0, 0]
    check_run(tmp_path, "adam", finishers=4)


def test_a_joiner_gets_its_shards_without_disk(tmp_path: Path) -> None:
    codes = run_job(tmp_path, 3, ["--parity", "2,1"], join_at=3)
    assert codes == [0, 0, 0, 0]
    finished = check_run(tmp_path, "adam", finishers=4)
    layout = make_layout(Parity(2, 1), ["node0", "node1", "node2", "node3"], zero_job.parameters())
    expected = state_bytes(layout.placement, zero_job.parameters(), state_elements=3)
    assert sorted(result["state_bytes"] for result in finished.values()) == sorted(expected)
    assert {result["layout_processes"] for result in finished.values()} == {4}


def test_more_failures_than_the_redundancy_covers_name_the_lost_shards(tmp_path: Path) -> None:
    codes = run_job(tmp_path, 4, ["--overlap", "0", "--kill=2:during_gather:1"])
    assert codes[1] == -signal.SIGKILL and sorted(codes[:1] + codes[2:]) == [3, 3, 3]
    for rank in (0, 2, 3):
        lost = json.loads((tmp_path / f"lost-{rank}.json").read_text())
        assert lost["shards"] == [1]
        assert "resume from a checkpoint" in lost["message"]


def test_a_copy_that_differs_by_one_bit_stops_the_job(tmp_path: Path) -> None:
    assert run_job(tmp_path, 3, ["--overlap", "0.34", "--flip-at", "2"]) == [4, 4, 4]
    message = (tmp_path / "mismatch-1.txt").read_text()
    assert "differ from its primary's after 3 updates" in message and "processes [0]" in message


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--parity", "3,2"], "parity k + m must be at most the number of processes (4), got 3 + 2 = 5"),
        (["--overlap", "0.5", "--nodes", "a,a,a,b"], "cannot place overlap 0.5 over 4 processes on 2 nodes"),
    ],
)
def test_a_redundancy_the_first_quorum_cannot_hold_is_refused_before_training(
    tmp_path: Path, options: list[str], message: str
) -> None:
    assert run_job(tmp_path, 4, options) == [5] * 4
    assert message in (tmp_path / "refused-0.txt").read_text()
