"""The torchtitan CPU recipe on CUDA with NCCL (issue 39, item 4): ``scripts/gpu-check`` runs it.

Two replica groups of torchtitan's llama3 debug model, one process each on a
GPU of its own (``CUDA_VISIBLE_DEVICES``), NCCL across the groups: group 1
is SIGKILLed at a step, launched again, rejoins and is healed; every step
keeps its global batch, every sample is trained once (audited), and both
groups end within the tolerance of a failure-free run of one group on the
first GPU. The launcher applies only the torch/torchtitan version shims
there (``STALWART_TORCHTITAN_DEVICE=cuda``, :mod:`stalwart.testing.torchtitan_cpu`):
torchtitan runs on its own device, with its compiled FlexAttention.

NCCL cannot put two ranks of one communicator on one GPU, so this needs two
GPUs and is skipped, with the count, on fewer. Not yet run on a GPU (no
machine was lent when it was written): the first run on one says whether
CUDA's float32 sums (TF32 off by default in torch's matmuls) stay within
the CPU recipe's 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

from stalwart.coord.server import Lighthouse
from stalwart.testing.torchtitan_assets import TorchtitanAssets
from stalwart.testing.torchtitan_cpu import DEVICE_VARIABLE
from tests.integration.test_torchtitan_stalwart import (
    RUN_TIMEOUT,
    TOLERANCE,
    Groups,
    assert_audited_exactly_once_at_a_constant_global_batch,
    finals,
    groups_log,
    kill_restart_and_heal,
    worst_difference,
)

GPUS = torch.cuda.device_count()
NCCL = ("--fault-tolerance.process-group", "nccl")


def on_gpu(index: int) -> dict[str, str]:
    """A group's environment: the launcher's CUDA mode and GPU ``index`` alone."""
    return {DEVICE_VARIABLE: "cuda", "CUDA_VISIBLE_DEVICES": str(index)}


@pytest.mark.skipif(GPUS < 2, reason=f"NCCL across two groups needs 2 GPUs, this machine has {GPUS}")
def test_a_killed_group_restarts_rejoins_and_is_healed_over_nccl(
    tmp_path: Path, make_lighthouse: Callable[..., Lighthouse], torchtitan_assets: TorchtitanAssets
) -> None:
    reference_dir = tmp_path / "failure-free"
    reference_dir.mkdir()
    with Lighthouse(None, min_replicas=1, start_replicas=1, heartbeat_timeout=5.0, join_timeout=30.0) as alone:
        reference_groups = Groups(reference_dir, alone, torchtitan_assets, 1, per_replica={0: on_gpu(0)})
        try:
            code = reference_groups.launch(0, *NCCL).wait(timeout=RUN_TIMEOUT)
        finally:
            reference_groups.end()
    assert code == 0, groups_log(reference_dir, 0)[-6000:]
    reference = finals(reference_dir)["final-replica-0.0.pt"]

    lighthouse = make_lighthouse(None, workers=2, heartbeat_timeout=5.0, join_timeout=120.0)
    kill_restart_and_heal(tmp_path, lighthouse, torchtitan_assets, 1, NCCL, per_replica={0: on_gpu(0), 1: on_gpu(1)})
    assert_audited_exactly_once_at_a_constant_global_batch(tmp_path / "audit")
    found = finals(tmp_path)
    assert sorted(found) == ["final-replica-0.0.pt", "final-replica-1.0.pt"]
    for name, parameters in found.items():
        assert worst_difference(parameters, reference) < TOLERANCE, name
