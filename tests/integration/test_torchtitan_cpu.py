"""The tests' torchtitan launcher (:mod:`stalwart.testing.torchtitan_cpu`): plain torchtitan's llama3 debug model
trains on two CPU processes (FSDP2 over Gloo) with the generated tokenizer and corpus (the shims' pure pieces are
tested in ``tests/unit/test_torchtitan_launcher.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
pytest.importorskip("triton", reason="triton is not installed (torchtitan imports it at load; the torchtitan extra)")

from stalwart.testing import torchtitan_cpu
from stalwart.testing.groups import ForkedGroup, end_group
from stalwart.testing.torchtitan_assets import TorchtitanAssets
from stalwart.testing.torchtitan_log import step_records

STEPS = 3
RUN_TIMEOUT = 240.0


def debug_args(assets: TorchtitanAssets, dump: Path, steps: int = STEPS) -> list[str]:
    """The llama3 debug model, short sequences and small batches, a fixed seed."""
    return [
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        *assets.flags(),
        "--training.seq-len",
        "128",
        "--training.local-batch-size",
        "2",
        "--training.steps",
        str(steps),
        "--debug.seed",
        "7",
        "--metrics.disable-color-printing",
        "--dump-folder",
        str(dump),
    ]


@pytest.mark.slow
def test_plain_torchtitan_trains_on_two_cpu_processes(
    torchtitan_assets: TorchtitanAssets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two processes are forked with torchrun's environment (stalwart's trainer runs under torchrun itself in
    ``test_torchtitan_stalwart``); each exits at once, without the interpreter's teardown."""
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "run.log"
    group = ForkedGroup(
        debug_args(torchtitan_assets, tmp_path / "dump"),
        {**torchtitan_cpu.environment(tmp_path), torchtitan_cpu.EXIT_VARIABLE: "1"},
        log,
        2,
        entry="stalwart.testing.torchtitan_cpu:forked_main",
    )
    try:
        assert group.wait(timeout=RUN_TIMEOUT) == 0, log.read_text()[-4000:]
    finally:
        end_group(group)
    records = step_records(log.read_text())
    # Each of the two ranks logs every step with the same (globally reduced) loss and gradient norm.
    assert sorted(record.step for record in records) == sorted([*range(1, STEPS + 1)] * 2)
    by_step: dict[int, set[tuple[float, float]]] = {}
    for record in records:
        by_step.setdefault(record.step, set()).add((record.loss, record.grad_norm))
    assert all(len(values) == 1 for values in by_step.values()), by_step
    losses = [next(iter(by_step[step]))[0] for step in range(1, STEPS + 1)]
    assert all(math.isfinite(loss) for loss in losses)
    # Starts near ln(vocab) (an untrained model over the 2,048 ids) and learns.
    assert abs(losses[0] - math.log(2048)) < 1.0
    assert losses[-1] < losses[0]
