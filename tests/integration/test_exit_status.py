"""Exit status 0 after a correct run, whatever joined when: a worker restarted to rejoin at the job's last step.

The cause, alone: a process that retires its quorum's group (as
``Manager.close()`` does) and returns at once. The group is destroyed on a
helper thread; a daemon one was still inside the C++ destructor when the
interpreter finalized and the process aborted (``terminate called without an
active exception``, exit 134), every time.

The whole story: a user's script (``late_join_job.py``) that ends through
the interpreter's own teardown. Worker 1 SIGKILLs itself at step 1; worker 0
trains on alone and is held before the last step until the lighthouse asks
it for a boundary. Once it is held there, worker 1 is let go again and asks
to join: its torchrun agent's restart, or a plain one the test started at the
beginning (waiting, so that its interpreter start overlaps the job's steps).
Worker 0 then commits the job's last step, forms a quorum with the joiner at
the job's end and heals it, and both close. Every process must exit 0 and
hold the same parameters. Without the fix it aborted under torchrun (2 runs
of 2) and in some plain runs; before the probe listener's close returned at
once, its half-second wait hid the race here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.coord.server import Lighthouse
from stalwart.testing.loopback import HOST
from stalwart.testing.waiting import wait_until
from tests.integration import late_join_job

STEPS = 4
WORKERS = 2
PLAN = late_join_job.PLAN
JOB = Path(late_join_job.__file__)
TIMEOUT = 120.0
RETIRE_AND_RETURN = """
import sys, torch
from stalwart.runtime.comm import Communicator
from stalwart.testing.loopback import prefix_store
port, rank = int(sys.argv[1]), int(sys.argv[2])
comm = Communicator(prefix_store(sys.argv[3], port, "exit/", 60.0), rank, 2, timeout=60.0, device=torch.device("cpu"))
comm.start_all_reduce_sum(torch.ones(4))()
comm.retire()
"""
"""Two fresh interpreters: a group, one all-reduce, the group retired, and the script's end."""


def test_a_process_that_retires_its_group_and_returns_exits_0(store: dist.TCPStore) -> None:
    command = [sys.executable, "-c", RETIRE_AND_RETURN, str(store.port)]
    environ = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    peers = [
        subprocess.Popen([*command, str(rank), HOST], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environ)
        for rank in range(2)
    ]
    outputs = [peer.communicate(timeout=TIMEOUT)[0].decode(errors="replace") for peer in peers]
    assert [peer.returncode for peer in peers] == [0, 0], outputs


def launch(
    member: str, out: Path, lighthouse: Lighthouse, options: list[str], torchrun: bool, restarts: int = 0
) -> subprocess.Popen[bytes]:
    """One worker: the job script in a fresh interpreter, or under torchrun (``restarts`` restarts allowed)."""
    script = [str(JOB), "--out", str(out), "--max-steps", str(STEPS), "--hold-file", str(out / "hold"), *options]
    if torchrun:
        agent = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.1"]
        command = [sys.executable, *agent, "--max-restarts", str(restarts), *script]
    else:
        command = [sys.executable, *script]
    environ = {
        **os.environ,
        "STALWART_LIGHTHOUSE": lighthouse.url,
        "STALWART_MEMBER": member,
        "PYTHONFAULTHANDLER": "1",
        "OMP_NUM_THREADS": "1",
    }
    log = open(out / f"{member}.log", "ab")  # noqa: SIM115 - the child holds its own descriptor
    with log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ)


def held_at_the_last_step(lighthouse: Lighthouse) -> bool:
    """Whether worker 0 applied every step but the last (it is held there) while worker 1 is dead."""
    members = {entry["member"]: entry for entry in lighthouse.status()["members"]}
    w0, w1 = members.get("w0"), members.get("w1")
    return w0 is not None and w0["applied_step"] == STEPS - 1 and w1 is not None and w1["state"] == "dead"


@pytest.mark.slow  # a job of two workers, one restarted (under torchrun: two agents)
@pytest.mark.parametrize("torchrun", [False, True], ids=["plain", "torchrun"])
def test_every_process_exits_0_when_a_restarted_worker_rejoins_at_the_last_step(
    tmp_path: Path, lighthouse: Lighthouse, torchrun: bool
) -> None:
    (tmp_path / "hold").write_text(str(STEPS - 1), encoding="utf-8")  # worker 0 waits before the last step
    go = tmp_path / "go"
    processes = {"w0": launch("w0", tmp_path, lighthouse, [], torchrun)}
    killed = ["--kill-at", "1", "--restart-waits-for", str(go)]
    processes["w1"] = launch("w1", tmp_path, lighthouse, killed, torchrun, restarts=1)
    if not torchrun:  # worker 1's replacement, started now but waiting for `go` (as a torchrun restart does)
        processes["w1 again"] = launch("w1", tmp_path, lighthouse, ["--waits-for", str(go)], torchrun)
    try:
        wait_until(lambda: held_at_the_last_step(lighthouse), TIMEOUT, "worker 0 held before the last step")
        if not torchrun:
            assert processes["w1"].wait(TIMEOUT) == -signal.SIGKILL
            processes["w1"] = processes.pop("w1 again")
        go.touch()  # worker 1 (its agent's restart, or the replacement) joins now
        wait_until(lambda: all(p.poll() is not None for p in processes.values()), TIMEOUT, "the workers to exit")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    logs = "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(tmp_path.glob("*.log")))
    assert {member: p.returncode for member, p in processes.items()} == {"w0": 0, "w1": 0}, logs
    assert "terminate called" not in logs
    quorums = lighthouse.status()["quorums"]
    last = quorums[-1]
    assert (sorted(last["members"]), last["applied_step"]) == (["w0", "w1"], STEPS), quorums
    finals = [torch.load(path, weights_only=True) for path in sorted(tmp_path.glob("final-*.pt"))]
    assert len(finals) == WORKERS
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name])
