"""The torchtitan trainer's flags and config checks (pure: no torchtitan needed), and its streamed dataset."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from stalwart.integrations.torchtitan.data import StreamedText
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


class CountingSource:
    """A resumable stream of ``count`` distinct samples (sample ``i`` holds ``i``), as torchtitan's text dataset is."""

    def __init__(self, stream: CountingStream) -> None:
        self.stream = stream
        self.next = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while self.next < self.stream.count:
            self.next += 1
            self.stream.reads += 1
            yield self.stream.sample(self.next - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next = state_dict["next"]


class CountingStream:
    """Opens :class:`CountingSource` streams, counting how often one started and how many samples were read."""

    def __init__(self, count: int, seq_len: int) -> None:
        self.count = count
        self.seq_len = seq_len
        self.starts = 0
        self.reads = 0

    def sample(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return (
            {"input": torch.arange(self.seq_len) + index, "positions": torch.arange(self.seq_len)},
            torch.arange(self.seq_len) + index + 1,
        )

    def __call__(self) -> CountingSource:
        self.starts += 1
        return CountingSource(self)


def assert_is_sample(sample: tuple[dict[str, torch.Tensor], torch.Tensor], stream: CountingStream, index: int) -> None:
    inputs, labels = sample
    expected_inputs, expected_labels = stream.sample(index)
    assert labels.dtype == torch.long and torch.equal(labels, expected_labels)
    assert inputs.keys() == expected_inputs.keys()
    assert all(torch.equal(inputs[name], expected_inputs[name]) for name in inputs)


@given(
    step=st.integers(1, 6),
    steps=st.integers(1, 8),
    retained_steps=st.integers(1, 3),
    retries=st.lists(st.integers(0, 8), max_size=8),
    data=st.data(),
)
def test_each_position_is_the_streams_sample_there_and_memory_holds_only_the_retained_ones(
    step: int, steps: int, retained_steps: int, retries: list[int], data: st.DataObject
) -> None:
    """Steps asked in order (a share in any order), some retried: every answer is the stream's sample at that
    position; the stream starts again only for a position older than the kept ones, which never hold more than
    ``retain`` samples."""
    stream = CountingStream(step * steps, seq_len=3)
    retain = retained_steps * step
    dataset = StreamedText(stream, step * steps, retain, step, identity="test")
    assert len(dataset) == step * steps
    for number in range(steps):
        asked = [number]
        if number in retries:
            asked.insert(0, max(0, number - data.draw(st.integers(0, 3))))  # a retried (older) step first
        for earlier_or_this in asked:
            packed_before = dataset.packed
            positions = data.draw(st.permutations(range(earlier_or_this * step, (earlier_or_this + 1) * step)))
            restarts_before = dataset.restarts
            for position in positions:
                assert_is_sample(dataset[position], stream, position)
            too_old = min(positions) < packed_before - retain
            assert (dataset.restarts > restarts_before) == too_old, (positions, packed_before, retain)
            assert len(dataset.kept) <= retain
    assert stream.starts == 1 + dataset.restarts


def test_the_fingerprint_tells_streams_apart_by_what_they_read_and_their_first_sample() -> None:
    def fingerprint(stream: CountingStream, identity: str = "a") -> str:
        return StreamedText(stream, 4, 2, 1, identity).fingerprint

    assert fingerprint(CountingStream(4, 3)) == fingerprint(CountingStream(9, 3))
    assert fingerprint(CountingStream(4, 3)) != fingerprint(CountingStream(4, 2))
    assert fingerprint(CountingStream(4, 3)) != fingerprint(CountingStream(4, 3), identity="b")


def test_a_stream_shorter_than_the_run_is_refused_when_it_runs_out() -> None:
    with pytest.raises(ValueError, match="packed only 0 samples and the run needs 4"):
        StreamedText(CountingStream(0, 3), 4, 2, 1, "a")
    dataset = StreamedText(CountingStream(3, 3), 4, 2, 1, "a")
    with pytest.raises(ValueError, match="packed only 3 samples and the run needs 4"):
        dataset[3]
    with pytest.raises(ValueError, match=r"index must be in \[0, 3\], got 4"):
        dataset[4]
    with pytest.raises(ValueError, match=r"retain must be in \[2, inf\], got 1"):
        StreamedText(CountingStream(3, 3), 4, 1, 2, "a")


@given(step=st.integers(1, 5), live_steps=st.integers(0, 12), retained_steps=st.integers(1, 3))
def test_a_stream_loaded_with_a_live_ones_state_packs_from_near_its_step_not_from_the_start(
    step: int, live_steps: int, retained_steps: int
) -> None:
    """A joiner healed at the live group's step: each position from there is the stream's sample, and the joiner
    reads at most the kept steps' samples before it, however long the live group trained."""
    length = step * 20
    live = StreamedText(CountingStream(length, 3), length, retained_steps * step, step, "a")
    for position in range(live_steps * step):
        live[position]
    state = live.state_dict()
    assert live_steps * step - retained_steps * step <= state["position"] <= live_steps * step
    joiner_stream = CountingStream(length, 3)
    joiner = StreamedText(joiner_stream, length, retained_steps * step, step, "a")
    joiner.load_state_dict(json.loads(json.dumps(state)))  # as a heal sends it
    reads_before = joiner_stream.reads
    for position in range(live_steps * step, length):
        assert_is_sample(joiner[position], joiner_stream, position)
    assert joiner.restarts == 0
    assert joiner_stream.reads - reads_before == length - state["position"]


def test_a_malformed_state_is_refused_by_name() -> None:
    dataset = StreamedText(CountingStream(4, 3), 4, 2, 1, "a")
    with pytest.raises(ValueError, match="state_dict must be"):
        dataset.load_state_dict({"position": 0})
    with pytest.raises(ValueError, match=r"state_dict\['position'\] must be in \[0, 4\], got 5"):
        dataset.load_state_dict({"position": 5, "stream": {}})
    with pytest.raises(ValueError, match=r"state_dict\['stream'\] must be a dict, got list"):
        dataset.load_state_dict({"position": 1, "stream": []})
    assert_is_sample(dataset[3], CountingStream(4, 3), 3)  # nothing changed
