"""The HSDP failure scenario (a process of group B SIGKILLed mid-reduction, B relaunched and healed shard by shard),
shared by ``test_hsdp.py`` on Gloo and ``gpu/test_gpu_nccl.py`` on NCCL; and the checks of its records."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import latest_step
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.digits_job import PARAM_TOLERANCE, together
from stalwart.testing.groups import GROUP_PLAN as PLAN
from stalwart.testing.groups import GROUP_STEPS as STEPS
from stalwart.testing.groups import end_group, launch_group
from stalwart.testing.waiting import wait_until

KILL_AT = 7
HOLD_AT = 12
TIMEOUT = 240.0


def events(run_dir: Path, name: str) -> list[str]:
    path = run_dir / f"events-{name}.jsonl"
    return [line.split('"event": "', 1)[1].split('"', 1)[0] for line in path.read_text().splitlines() if line]


def assert_finals_match_the_reference(run_dir: Path, groups: str) -> None:
    """Both processes of each of ``groups`` finished, within the tolerance of the failure-free parameters."""
    reference, _ = reference_run(PLAN, STEPS)
    finals = sorted(path.name for path in run_dir.glob("final-*.pt"))
    assert finals == [f"final-group-{g}.{rank}.pt" for g in groups for rank in (0, 1)]
    for name in finals:
        parameters = torch.load(run_dir / name, weights_only=True)
        worst = max(float((parameters[key] - value).abs().max()) for key, value in reference.items())
        assert worst < PARAM_TOLERANCE, name


def kill_restart_and_heal(tmp_path: Path, lighthouse: Lighthouse, envs: Mapping[str, Mapping[str, str]]) -> None:
    """The scenario of the module docstring; ``envs``: extra environment per group (its GPUs on CUDA)."""
    hold, hold_a = tmp_path / "hold", tmp_path / "hold-a"
    hold.write_text(str(HOLD_AT))
    hold_a.write_text(str(KILL_AT))

    def launch(name: str, hold_file: Path, *more: str) -> subprocess.Popen[bytes]:
        more = ("--fsdp", "--hold-file", str(hold_file), *more)
        return launch_group(lighthouse.url, name, tmp_path, more, envs.get(name))

    # Group B's process 1 SIGKILLs itself while step KILL_AT's buckets are in flight: group A's reduction fails,
    # and it computes B's share on top of its own (a second FSDP2 reduce-scatter into its shards). A waits before
    # that step until B is gone: B's buckets and tail are launched from its backward's hooks, before the kill point,
    # and a group A already waiting in the step's reduction would complete it with them (B's share reduced, the
    # step committed by both groups, A's retry never run).
    kill = ["--kill-at", f"{KILL_AT}:during_reduce", "--kill-rank", "1"]
    agents = {"group-a": launch("group-a", hold_a), "group-b": launch("group-b", hold, *kill)}
    restarted: subprocess.Popen[bytes] | None = None
    try:
        assert agents["group-b"].wait(timeout=TIMEOUT) != 0
        hold_a.write_text(str(HOLD_AT))
        wait_until(lambda: latest_step(tmp_path)[0] >= HOLD_AT, TIMEOUT, "group A to reach the hold alone")
        since = lighthouse.status()["quorums"][-1]["quorum_id"]
        restarted = launch("group-b", hold)
        wait_until(  # in one quorum, not only asking: released before A hears of B, A could finish alone
            lambda: together(lighthouse, ["group-a", "group-b"], since),
            TIMEOUT,
            "the restarted group B to join group A's quorum",
        )
        hold.unlink()
        hold_a.unlink()
        assert agents["group-a"].wait(timeout=TIMEOUT) == 0
        assert restarted.wait(timeout=TIMEOUT) == 0
    finally:
        for agent in [*agents.values(), restarted]:
            if agent is not None:
                end_group(agent)
    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    world_sizes = [record["world_size"] for record in steps]
    assert world_sizes[0] == 2 and 1 in world_sizes and world_sizes[-1] == 2
    assert steps[KILL_AT]["world_size"] == 1  # committed by group A alone, after its retry
    assert "healed" in events(tmp_path, "group-b.0") and "healed" in events(tmp_path, "group-b.1")
    assert_finals_match_the_reference(tmp_path, "ab")
