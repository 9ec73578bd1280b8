"""A script's own ``torch.save({"optimizer": optimizer.state_dict()})`` under sharded state holds the whole state.

Real worker processes (forked, :mod:`stalwart.testing.own_checkpoint_job`)
against a real lighthouse: a job under ``Overlap(0.5)`` or ``Parity(2, 1)``
saves its own checkpoint after step 3; the saved optimizer state equals a
replicated run's at that step (one process, no stalwart: what a replicated
Manager run computes), and a new job that loads it (two workers, or three
loading it between steps) trains on as the replicated run resumed from its
own checkpoint does. Today's failure, 0 state entries, fails the first check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.processes import ForkedWorker
from stalwart.testing.own_checkpoint_job import PLAN, reference

SAVE_AT, RESUMED_STEPS = 3, 3
TOLERANCE = 1e-5
JOB_TIMEOUT = 120.0
ENTRY = "stalwart.testing.own_checkpoint_job:run"


def run_job(
    out: Path, workers: int, args: list[str], *, min_replicas: int | None = None, env: dict[str, str] | None = None
) -> list[int]:
    """``workers`` workers of one job (a lighthouse of its own) until they exit; their exit codes.

    Each must exit 0 unless ``min_replicas`` is given (default ``workers``).
    """
    out.mkdir(parents=True, exist_ok=True)
    least = workers if min_replicas is None else min_replicas
    with Lighthouse(PLAN, min_replicas=least, start_replicas=workers, heartbeat_timeout=1.0) as server:
        processes = [
            ForkedWorker(
                ["--lighthouse", server.url, "--member", f"w{n}", "--out", str(out), *args],
                {**os.environ, **(env or {})},
                out / f"w{n}.log",
                entry=ENTRY,
            )
            for n in range(workers)
        ]
        try:
            codes = [process.wait(JOB_TIMEOUT) for process in processes]
        finally:
            for process in processes:
                process.kill()
    logs = "\n".join(path.read_text()[-3000:] for path in sorted(out.glob("w*.log")))
    assert min_replicas is not None or codes == [0] * workers, logs
    return codes


def assert_close(left: Any, right: Any, where: str = "") -> None:
    """Nested dicts, lists and tensors equal within TOLERANCE (tensors), exactly (the rest)."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.shape == right.shape, where
        assert left.numel() == 0 or float((left.float() - right.float()).abs().max()) < TOLERANCE, where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and set(left) == set(right), f"{where}: {sorted(left)} != {sorted(right)}"
        for key in left:
            assert_close(left[key], right[key], f"{where}/{key}")
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_close(a, b, f"{where}/{index}")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


@pytest.fixture(scope="module")
def replicated() -> dict[str, Any]:
    """The replicated run's checkpoint after SAVE_AT steps, and where it stands RESUMED_STEPS steps after resuming."""
    saved = reference(SAVE_AT)
    return {"saved": saved, "resumed": reference(RESUMED_STEPS, resume=saved)["model"]}


@pytest.mark.slow  # two jobs of three workers each
@pytest.mark.parametrize(
    ("saved_args", "resumed_args", "resumed_workers"),
    [
        # every process calls optimizer.state_dict() at the same point, the leader saves; resumed by 2 workers
        (["--redundancy", "overlap:0.5", "--save", "every"], ["--redundancy", "overlap:0.5"], 2),
        # nanoGPT's way: only the leader, inside manager.on_leader; resumed by 3 workers loading in the loop
        (["--redundancy", "parity:2,1", "--save", "leader"], ["--redundancy", "parity:2,1", "--load", "in-loop"], 3),
    ],
    ids=["overlap", "parity"],
)
def test_a_scripts_own_checkpoint_holds_the_whole_sharded_state_and_resumes_at_another_size(
    tmp_path: Path, replicated: dict[str, Any], saved_args: list[str], resumed_args: list[str], resumed_workers: int
) -> None:
    """Three workers save after step SAVE_AT; a new job loads the file and trains RESUMED_STEPS more steps."""
    run_job(tmp_path / "saved", 3, ["--steps", str(SAVE_AT + 1), "--save-at", str(SAVE_AT), *saved_args])
    saved = torch.load(tmp_path / "saved" / "ckpt.pt", weights_only=True)
    expected = replicated["saved"]
    assert len(saved["optimizer"]["state"]) == len(expected["optimizer"]["state"]) == 4  # never empty
    assert_close(saved["optimizer"], expected["optimizer"], "optimizer")
    assert_close(saved["model"], expected["model"], "model")
    for member in range(3):  # after manager.close() only the shards are left: an error, never torch's empty state
        said = (tmp_path / "saved" / f"after-close-w{member}.txt").read_text()
        assert "call it inside the manager.steps() loop, before manager.close()" in said

    ckpt = str(tmp_path / "saved" / "ckpt.pt")
    run_job(tmp_path / "resumed", resumed_workers, ["--steps", str(RESUMED_STEPS), "--resume", ckpt, *resumed_args])
    finals = sorted((tmp_path / "resumed").glob("final-*.pt"))
    assert len(finals) == resumed_workers
    for path in finals:
        assert_close(torch.load(path, weights_only=True), replicated["resumed"], path.name)


def test_moments_restarted_from_zero_would_end_elsewhere(replicated: dict[str, Any]) -> None:
    """The resumed comparison can fail: resuming with the model alone (fresh AdamW) ends beyond TOLERANCE."""
    fresh = {"model": replicated["saved"]["model"], "optimizer": reference(0)["optimizer"]}
    ended = reference(RESUMED_STEPS, resume=fresh)["model"]
    assert max(float((ended[k] - v).abs().max()) for k, v in replicated["resumed"].items()) > 100 * TOLERANCE


def test_a_state_dict_called_on_one_process_alone_says_what_to_do(tmp_path: Path) -> None:
    """The leader calls optimizer.state_dict() outside on_leader, the others do not: a StepContractError, no file.

    Its peers' next collective outlasts the meeting's rendezvous_timeout, so
    the error is the meeting's; the others finish the job without it.
    """
    env = {"STALWART_RENDEZVOUS_TIMEOUT": "5", "STALWART_COLLECTIVE_TIMEOUT": "60"}
    args = ["--steps", str(SAVE_AT + 2), "--save-at", str(SAVE_AT), "--redundancy", "overlap:0.5"]
    codes = run_job(tmp_path, 3, [*args, "--save", "leader-alone"], min_replicas=1, env=env)
    assert sorted(codes) == [0, 0, 1]
    failed = tmp_path / f"w{codes.index(1)}.log"
    assert "StepContractError: optimizer.state_dict() is a collective" in failed.read_text()
    assert "call it on every process at the same point of the loop body" in failed.read_text()
    assert not (tmp_path / "ckpt.pt").exists()
