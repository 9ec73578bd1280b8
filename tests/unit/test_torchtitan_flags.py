"""The torchtitan trainer's flags and config checks (pure: no torchtitan needed), and its packed dataset."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from stalwart.integrations.torchtitan.config import (
    FaultTolerance,
    TrainingShape,
    check_fault_tolerance,
    check_min_replica_size,
    check_training,
)
from stalwart.integrations.torchtitan.data import check_packing_fits, pack_samples
from stalwart.runtime.config import Checkpointing
from stalwart.runtime.diloco.config import DiLoCo

SHAPE = TrainingShape(
    global_batch_size=8,
    local_batch_size=2,
    steps=10,
    degrees={"tensor_parallel_degree": 1, "pipeline_parallel_degree": 1},
    optimizers=1,
    cuda_graphs=False,
)


def test_the_defaults_run_every_step_as_member_replica_0() -> None:
    flags = FaultTolerance()
    check_fault_tolerance(flags, device_type="cpu")
    check_training(SHAPE, flags)
    assert flags.member() == "replica-0"
    assert flags.sync() is None


def test_checkpoint_flags_build_the_managers_durable_checkpoints(tmp_path: Path) -> None:
    assert FaultTolerance().checkpointing() is None
    flags = FaultTolerance(checkpoint_folder=str(tmp_path), checkpoint_interval=4)
    check_fault_tolerance(flags, device_type="cpu")
    assert flags.checkpointing() == Checkpointing(str(tmp_path), every_steps=4)


def test_diloco_flags_build_the_managers_sync() -> None:
    flags = FaultTolerance(semi_sync_method="diloco", sync_steps=5, num_fragments=2)
    check_fault_tolerance(flags, device_type="cpu")
    check_training(SHAPE, flags)
    assert flags.sync() == DiLoCo(inner_steps=5, fragments=2)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (FaultTolerance(replica_id=-1), "fault_tolerance.replica_id=-1"),
        (FaultTolerance(replica_id=2, group_size=2), "fault_tolerance.replica_id=2 must be below"),
        (FaultTolerance(process_group="nccl"), "fault_tolerance.process_group='nccl': allowed is 'gloo' on cpu"),
        (FaultTolerance(process_group_timeout_ms=0), "fault_tolerance.process_group_timeout_ms=0"),
        (FaultTolerance(semi_sync_method="local_sgd"), "fault_tolerance.semi_sync_method='local_sgd'"),
        (FaultTolerance(sync_steps=0), "fault_tolerance.sync_steps=0"),
        (FaultTolerance(num_fragments=2), "fault_tolerance.num_fragments=2 needs"),
        (FaultTolerance(redundancy="raid:5"), "fault_tolerance.redundancy: redundancy must be"),
        (FaultTolerance(redundancy="parity:1,1", semi_sync_method="diloco"), "fault_tolerance.redundancy='parity"),
        (FaultTolerance(audit_dir=""), "fault_tolerance.audit_dir"),
        (FaultTolerance(min_replica_size=-1), "fault_tolerance.min_replica_size=-1: allowed is an integer >= 0"),
        (FaultTolerance(min_replica_size=3, group_size=2), "fault_tolerance.min_replica_size=3 exceeds"),
        (FaultTolerance(checkpoint_folder="ckpt"), "fault_tolerance.checkpoint_folder='ckpt' needs"),
        (FaultTolerance(checkpoint_folder=""), "fault_tolerance.checkpoint_folder must be"),
        (FaultTolerance(checkpoint_interval=5), "fault_tolerance.checkpoint_interval=5 needs"),
        (FaultTolerance(checkpoint_folder="c", checkpoint_interval=-1), "fault_tolerance.checkpoint_interval=-1"),
    ],
)
def test_a_bad_flag_is_refused_by_name_value_and_what_is_allowed(flags: FaultTolerance, named: str) -> None:
    with pytest.raises(ValueError) as error:
        check_fault_tolerance(flags, device_type="cpu")
    assert named in str(error.value)


def test_nccl_is_the_backend_on_cuda() -> None:
    check_fault_tolerance(FaultTolerance(process_group="nccl"), device_type="cuda")
    with pytest.raises(ValueError, match=r"process_group='gloo': allowed is 'nccl' on cuda"):
        check_fault_tolerance(FaultTolerance(process_group="gloo"), device_type="cuda")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"global_batch_size": -1}, "training.global_batch_size=-1"),
        ({"degrees": {"tensor_parallel_degree": 2}}, "parallelism.tensor_parallel_degree=2"),
        ({"optimizers": 2}, "build 2 optimizers"),
        ({"cuda_graphs": True}, "training.disable_cuda_graphs=False"),
        ({"checkpointing": True}, "checkpoint.enable with fault_tolerance.redundancy='parity:1,1'"),
    ],
)
def test_a_config_the_trainer_cannot_run_is_refused(change: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError) as error:
        check_training(dataclasses.replace(SHAPE, **change), FaultTolerance(redundancy="parity:1,1"))  # type: ignore[arg-type]
    assert named in str(error.value)


def test_diloco_needs_whole_rounds() -> None:
    with pytest.raises(ValueError, match=r"training\.steps=10 must be a multiple of fault_tolerance\.sync_steps=3"):
        check_training(SHAPE, FaultTolerance(semi_sync_method="diloco", sync_steps=3))


@given(lighthouse=st.integers(1, 64))
def test_min_replica_size_passes_when_unset_or_equal_to_the_lighthouses(lighthouse: int) -> None:
    status = {"min_replicas": lighthouse, "members": []}
    check_min_replica_size(FaultTolerance(), status)
    check_min_replica_size(FaultTolerance(min_replica_size=lighthouse), status)
    check_fault_tolerance(FaultTolerance(min_replica_size=lighthouse, group_size=lighthouse), device_type="cpu")


@given(wanted=st.integers(1, 64), lighthouse=st.integers(1, 64))
def test_a_min_replica_size_other_than_the_lighthouses_is_refused_naming_both(wanted: int, lighthouse: int) -> None:
    assume(wanted != lighthouse)
    with pytest.raises(ValueError) as error:
        check_min_replica_size(FaultTolerance(min_replica_size=wanted), {"min_replicas": lighthouse})
    message = str(error.value)
    assert f"fault_tolerance.min_replica_size={wanted}," in message
    assert f"the lighthouse runs with --min-replicas {lighthouse} " in message
    assert f"start the lighthouse with --min-replicas {wanted}, or drop --fault_tolerance.min_replica_size" in message


@pytest.mark.parametrize("value", [-1, True, 2.0])
def test_the_min_replica_size_check_refuses_a_flag_that_is_no_count(value: object) -> None:
    with pytest.raises(ValueError, match=r"fault_tolerance\.min_replica_size=.*allowed is an integer >= 0"):
        check_min_replica_size(FaultTolerance(min_replica_size=value), {"min_replicas": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [{}, {"min_replicas": None}, {"min_replicas": "2"}, {"min_replicas": True}])
def test_a_status_without_min_replicas_is_refused_when_the_flag_is_set(status: dict[str, object]) -> None:
    check_min_replica_size(FaultTolerance(), status)
    with pytest.raises(ValueError, match=r"min_replica_size=2: the lighthouse's status has no integer min_replicas"):
        check_min_replica_size(FaultTolerance(min_replica_size=2), status)


def samples(count: int, seq_len: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    return [
        (
            {"input": torch.arange(seq_len) + i, "positions": torch.arange(seq_len)},
            torch.arange(seq_len) + i + 1,
        )
        for i in range(count)
    ]


@given(count=st.integers(1, 20), limit=st.integers(1, 30), seq_len=st.integers(1, 8))
def test_packing_keeps_the_first_samples_as_torchtitan_yields_them(count: int, limit: int, seq_len: int) -> None:
    given_samples = samples(count, seq_len)
    packed = pack_samples(iter(given_samples), limit)
    assert len(packed) == min(count, limit)
    for index in range(len(packed)):
        inputs, labels = packed[index]
        expected_inputs, expected_labels = given_samples[index]
        assert labels.dtype == torch.long and torch.equal(labels, expected_labels)
        assert inputs.keys() == expected_inputs.keys()
        assert all(torch.equal(inputs[name], expected_inputs[name]) for name in inputs)


def test_the_fingerprint_tells_packed_datasets_apart() -> None:
    assert pack_samples(samples(4, 3), 4).fingerprint == pack_samples(samples(4, 3), 4).fingerprint
    assert pack_samples(samples(4, 3), 4).fingerprint != pack_samples(samples(4, 3), 3).fingerprint


def test_a_corpus_too_short_for_one_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="packed no sample"):
        pack_samples(iter([]), 4)
    with pytest.raises(ValueError, match=r"limit must be in"):
        pack_samples(samples(2, 2), 0)


@given(
    limit=st.integers(1, 10**7),
    seq_len=st.integers(1, 1 << 16),
    processes=st.integers(1, 16),
    memory=st.integers(1 << 20, 1 << 41),
)
def test_a_run_is_refused_exactly_when_its_packed_copies_exceed_half_the_nodes_memory(
    limit: int, seq_len: int, processes: int, memory: int
) -> None:
    copies = limit * seq_len * 3 * 4 * processes  # int32 inputs, positions and labels; one copy per process
    if copies <= memory // 2 - processes:  # (the allowance is rounded down per process)
        check_packing_fits(limit, seq_len, processes, memory)
    elif copies > memory // 2:
        with pytest.raises(ValueError, match=f"{limit} samples of training.seq_len = {seq_len} tokens"):
            check_packing_fits(limit, seq_len, processes, memory)


def test_a_real_run_of_c4_is_refused_naming_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"not supported yet\): lower training.steps or training.seq_len"):
        check_packing_fits(100_000 * 256, 2048, 8, 2 << 40)  # 100k steps of 256 x 2,048 tokens: 586 GiB a process
    check_packing_fits(6 * 4, 32, 2, 1 << 30)  # the CPU recipe's runs: kilobytes
