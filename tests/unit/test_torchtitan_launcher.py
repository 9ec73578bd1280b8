"""The torchtitan CPU launcher's pure pieces: its command line and environment, and the eager attention that stands
in for torchtitan's compiled FlexAttention (torch alone: no torchtitan needed)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.testing import torchtitan_cpu


def test_environment_runs_the_same_stalwart_offline_with_its_own_cache(tmp_path: Path) -> None:
    env = torchtitan_cpu.environment(tmp_path, {"PYTHONPATH": "/elsewhere", "KEEP": "1"})
    source_root = str(Path(stalwart.__file__).resolve().parents[1])
    assert env["PYTHONPATH"].split(os.pathsep) == [source_root, "/elsewhere"]
    assert env["HF_DATASETS_CACHE"] == str(tmp_path / "hf_datasets")
    assert (env["HF_HUB_OFFLINE"], env["HF_DATASETS_OFFLINE"], env["KEEP"]) == ("1", "1", "1")


def test_cpu_flags_come_before_the_callers() -> None:
    args = torchtitan_cpu.torchtitan_args(["--parallelism.spmd-backend", "full_dtensor"])
    assert args[:2] == list(torchtitan_cpu.SPMD_BACKEND_FLAGS)
    assert args[-1] == "full_dtensor"  # the caller's choice is parsed last and wins


def test_a_process_exits_at_once_only_when_the_environment_says_1() -> None:
    assert not torchtitan_cpu.exits_at_once({})
    assert not torchtitan_cpu.exits_at_once({torchtitan_cpu.EXIT_VARIABLE: "0"})
    assert torchtitan_cpu.exits_at_once({torchtitan_cpu.EXIT_VARIABLE: "1"})
    with pytest.raises(ValueError, match="STALWART_TORCHTITAN_EXIT_AT_ONCE must be 0 or 1, got 'yes'"):
        torchtitan_cpu.exits_at_once({torchtitan_cpu.EXIT_VARIABLE: "yes"})


def test_the_launch_device_is_cpu_unless_the_environment_names_cuda() -> None:
    assert torchtitan_cpu.launch_device({}) == "cpu"
    assert torchtitan_cpu.launch_device({torchtitan_cpu.DEVICE_VARIABLE: "cuda"}) == "cuda"
    with pytest.raises(ValueError, match=rf"{torchtitan_cpu.DEVICE_VARIABLE}.*'gpu'"):
        torchtitan_cpu.launch_device({torchtitan_cpu.DEVICE_VARIABLE: "gpu"})
    with pytest.raises(ValueError, match=r"device.*'mps'"):
        torchtitan_cpu.apply_shims("mps")


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


def test_a_block_masks_dense_mask_is_evaluated_once_and_a_new_block_masks_again() -> None:
    """Every layer (and every recompute) of a step attends over the same block mask: its ``mask_mod`` is evaluated
    densely once; the next step's block mask (another batch's documents) is evaluated anew."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    evaluated = []
    documents = torch.tensor([[0] * 5 + [1] * 11])

    def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        evaluated.append(1)  # once per dense evaluation (vmap calls the function once)
        return documents[b, q_idx] == documents[b, kv_idx]

    q = torch.randn(1, 2, 16, 4, generator=torch.Generator().manual_seed(1))
    outputs = []
    for _ in range(2):
        block_mask = create_block_mask(same_document, 1, None, 16, 16, device="cpu", BLOCK_SIZE=16)
        before = len(evaluated)
        for _layer in range(3):
            out, _ = torchtitan_cpu.eager_flex_attention(
                q, q, q, score_mod=None, block_mask=block_mask, scale=None, enable_gqa=False,
                return_aux=AuxRequest(), kernel_options={},
            )  # fmt: skip
            outputs.append(out)
        assert len(evaluated) == before + 1
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0])


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
