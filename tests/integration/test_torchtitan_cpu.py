"""The tests' torchtitan launcher (:mod:`stalwart.testing.torchtitan_cpu`): plain torchtitan's llama3 debug model
trains on two CPU processes (FSDP2 over Gloo) with the generated tokenizer and corpus, and the shims' pieces."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

from stalwart.testing import torchtitan_cpu
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
def test_plain_torchtitan_trains_on_two_cpu_processes(torchtitan_assets: TorchtitanAssets, tmp_path: Path) -> None:
    command = torchtitan_cpu.torchrun_command(2, debug_args(torchtitan_assets, tmp_path / "dump"))
    result = subprocess.run(
        command,
        env=torchtitan_cpu.environment(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = step_records(result.stdout + result.stderr)
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


def test_cpu_flags_come_before_the_callers() -> None:
    args = torchtitan_cpu.torchtitan_args(["--parallelism.spmd-backend", "full_dtensor"])
    assert args[:2] == list(torchtitan_cpu.SPMD_BACKEND_FLAGS)
    assert args[-1] == "full_dtensor"  # the caller's choice is parsed last and wins


@pytest.mark.parametrize("nproc", [0, -1, True, 1.5])
def test_torchrun_command_refuses_a_bad_process_count(nproc: object) -> None:
    with pytest.raises(ValueError, match="nproc"):
        torchtitan_cpu.torchrun_command(nproc, [])  # type: ignore[arg-type]


def test_eager_flex_attention_matches_masked_attention_and_has_gradients() -> None:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=generator, requires_grad=True) for _ in range(3))
    documents = torch.tensor([[0] * 15 + [1] * 25, [0] * 33 + [1] * 7])

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    block_mask = create_block_mask(same_document_causal, 2, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    out, _ = torchtitan_cpu.eager_flex_attention(
        q,
        k,
        v,
        score_mod=None,
        block_mask=block_mask,
        scale=None,
        enable_gqa=False,
        return_aux=AuxRequest(),
        kernel_options={},
    )
    positions = torch.arange(40)
    allowed = (positions[None, :, None] >= positions[None, None, :]) & (documents[:, :, None] == documents[:, None, :])
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    expected = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert q.grad is not None and bool(q.grad.abs().sum() > 0)


def test_eager_flex_attention_refuses_what_it_does_not_compute() -> None:
    from torch.nn.attention.flex_attention import AuxRequest

    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(NotImplementedError, match="score_mod"):
        torchtitan_cpu.eager_flex_attention(
            q,
            q,
            q,
            score_mod=lambda score, *_: score,
            block_mask=None,
            scale=None,
            enable_gqa=False,
            return_aux=AuxRequest(),
            kernel_options={},
        )
    with pytest.raises(NotImplementedError, match="auxiliary"):
        torchtitan_cpu.eager_flex_attention(
            q,
            q,
            q,
            score_mod=None,
            block_mask=None,
            scale=None,
            enable_gqa=False,
            return_aux=AuxRequest(lse=True),
            kernel_options={},
        )
