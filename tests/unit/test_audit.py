"""Audit files: writing, reading back, what counts as a violation, and the ``stalwart audit`` command."""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.cli.audit import audit_command
from stalwart.data.audit import (
    AuditFileError,
    AuditWriter,
    audit_directory,
    read_expected,
    write_expected,
)
from stalwart.data.plan import EpochPlan


def write_epoch(directory: Path, epoch: int, parts: dict[int, list[list[int]]]) -> None:
    """Write each rank's batches of one epoch (``parts[rank]`` is a list of batches)."""
    for rank, batches in parts.items():
        with AuditWriter(directory, rank) as writer:
            for step, indices in enumerate(batches):
                writer.write(epoch, step, indices)


def test_round_trip_counts_ranks_and_workers(tmp_path: Path) -> None:
    with AuditWriter(tmp_path, 0, expected={"dataset_size": 10}) as writer:
        writer.write(0, 0, np.array([3, 1]))
        writer.write(0, 1, [0])
    for worker, indices in enumerate([[2, 4], [5, 6, 7]]):
        with AuditWriter(tmp_path, 1, worker=worker, expected={"dataset_size": 10}) as writer:
            writer.write(0, worker, indices)
    write_epoch(tmp_path, 0, {2: [[8, 9]]})
    assert sorted(path.name for path in tmp_path.glob("rank-*")) == [
        "rank-00000.jsonl",
        "rank-00001-w00.jsonl",
        "rank-00001-w01.jsonl",
        "rank-00002.jsonl",
    ]
    first = json.loads((tmp_path / "rank-00000.jsonl").read_text().splitlines()[0])
    assert first == {"epoch": 0, "step": 0, "rank": 0, "indices": [3, 1]}
    report = audit_directory(tmp_path)
    assert report.ok and report.torn_lines == 0 and report.spec == {"dataset_size": 10}
    (epoch,) = report.epochs
    assert epoch.complete and epoch.coverage.exactly_once and epoch.expected == 10
    assert epoch.rank_samples == {(0, None): 3, (1, None): 5, (2, None): 2}
    assert epoch.rank_batches == {(0, None): 2, (1, None): 2, (2, None): 1}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.lists(st.integers(0, 59), max_size=80), st.integers(1, 4), st.data())
def test_duplicates_and_missing_are_found(size: int, taken: list[int], ranks: int, data: st.DataObject) -> None:
    taken = [index % size for index in taken]
    owners = data.draw(st.lists(st.integers(0, ranks - 1), min_size=len(taken), max_size=len(taken)))
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        write_expected(root, {"dataset_size": size})
        for rank in range(ranks):
            write_epoch(root, 0, {rank: [[i for i, owner in zip(taken, owners, strict=True) if owner == rank]]})
        (epoch,) = audit_directory(root).epochs
    counts = np.bincount(np.asarray(taken, dtype=np.int64), minlength=size)
    assert epoch.coverage.duplicates == {i: int(c) for i, c in enumerate(counts) if c > 1}
    assert epoch.coverage.consumed == len(taken)
    assert epoch.complete == (len(taken) >= size)
    if epoch.complete:
        assert epoch.ok == (counts == 1).all()
        assert epoch.coverage.missing == [i for i, c in enumerate(counts) if c == 0]
    else:
        assert epoch.ok == (counts <= 1).all()


def test_epoch_in_progress_is_ok_until_a_later_epoch_starts(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 6})
    write_epoch(tmp_path, 0, {0: [[0, 1]], 1: [[2]]})
    report = audit_directory(tmp_path)
    assert report.ok and not report.epochs[0].complete
    write_epoch(tmp_path, 0, {1: [[2]]})
    assert not audit_directory(tmp_path).ok, "a repeat is a violation even before the epoch ends"
    other = tmp_path / "other"
    write_expected(other, {"dataset_size": 6})
    write_epoch(other, 0, {0: [[0, 1]], 1: [[2]]})
    write_epoch(other, 1, {0: [[5]]})
    report = audit_directory(other)
    assert [epoch.complete for epoch in report.epochs] == [True, False]
    assert report.epochs[0].coverage.missing == [3, 4, 5] and not report.ok


def test_unexpected_indices_are_a_violation(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 3})
    write_epoch(tmp_path, 0, {0: [[0, 7]]})
    report = audit_directory(tmp_path)
    assert report.epochs[0].coverage.unexpected == [7] and not report.ok


def test_drop_last_plan_does_not_expect_the_tail(tmp_path: Path) -> None:
    plan = EpochPlan(23, 5, seed=4, drop_last=True)
    write_expected(tmp_path, {"plan": plan.to_dict()})
    for epoch in (0, 1):
        batches = [plan.indices(epoch, plan.step_start(t), plan.step_start(t + 1)) for t in range(plan.steps_per_epoch)]
        write_epoch(tmp_path, epoch, {0: [b.tolist() for b in batches]})
    report = audit_directory(tmp_path)
    assert report.ok and all(epoch.complete and epoch.expected == 20 for epoch in report.epochs)
    tail = np.setdiff1d(np.arange(23), plan.indices(1, 0, 20)).tolist()
    write_epoch(tmp_path, 1, {1: [tail[:1]]})
    assert audit_directory(tmp_path).epochs[1].coverage.unexpected == tail[:1]


def test_torn_last_line_is_skipped_and_cut_before_the_next_write(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 4})
    write_epoch(tmp_path, 0, {0: [[0, 1]]})
    path = tmp_path / "rank-00000.jsonl"
    with path.open("a") as file:
        file.write('{"epoch": 0, "step": 1, "rank": 0, "indi')
    report = audit_directory(tmp_path)
    assert report.torn_lines == 1 and report.epochs[0].coverage.consumed == 2 and report.ok
    with AuditWriter(tmp_path, 0) as writer:
        writer.write(0, 1, [2, 3])
    assert path.read_text().count("\n") == 2
    report = audit_directory(tmp_path)
    assert report.torn_lines == 0 and report.epochs[0].complete and report.ok


def test_malformed_lines_are_errors_that_name_the_line(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 4})
    write_epoch(tmp_path, 0, {0: [[0]]})
    path = tmp_path / "rank-00000.jsonl"
    path.write_text("garbage\n" + path.read_text())
    with pytest.raises(AuditFileError, match=r"rank-00000\.jsonl:1: not a JSON line"):
        audit_directory(tmp_path)
    path.write_text('{"epoch": 0, "step": 0, "rank": 1, "indices": [0]}\n')
    with pytest.raises(AuditFileError, match=r"rank-00000\.jsonl:1: rank 1 in a file of rank 0"):
        audit_directory(tmp_path)
    path.write_text('{"epoch": -1, "step": 0, "rank": 0, "indices": [0]}\n')
    with pytest.raises(AuditFileError, match="epoch must be an int >= 0"):
        audit_directory(tmp_path)


def test_expected_spec_is_idempotent_and_refuses_conflicts(tmp_path: Path) -> None:
    plan = EpochPlan(10, 3, drop_last=True)
    threads = [threading.Thread(target=write_expected, args=(tmp_path, {"plan": plan.to_dict()})) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert read_expected(tmp_path) == {"plan": plan.to_dict()}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["audit.json"], "no staging files left behind"
    with pytest.raises(ValueError, match="conflicts with the spec already recorded"):
        write_expected(tmp_path, {"dataset_size": 10})
    with pytest.raises(ValueError, match="conflicts with the spec already recorded"):
        write_expected(tmp_path, {"plan": {**plan.to_dict(), "seed": 1}})
    with pytest.raises(ValueError, match=r"spec must be \{'dataset_size': N\} or"):
        write_expected(tmp_path, {"dataset_size": 10, "shard": []})
    with pytest.raises(ValueError, match=r"spec must be \{'dataset_size': N\} or"):
        write_expected(tmp_path, {"dataset_size": 10, "plan": plan.to_dict()})
    with pytest.raises(ValueError, match=r"spec\['dataset_size'\] must be in \[1, inf\], got 0"):
        write_expected(tmp_path, {"dataset_size": 0})
    with pytest.raises(ValueError, match=r"spec\['plan'\] is not an EpochPlan"):
        write_expected(tmp_path, {"plan": {"size": 3}})


def test_missing_expected_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"audit\.json not found"):
        audit_directory(tmp_path)


def test_writer_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, inf\], got -1"):
        AuditWriter(tmp_path, -1)
    with pytest.raises(ValueError, match=r"worker must be in \[0, inf\], got -2"):
        AuditWriter(tmp_path, 0, worker=-2)
    writer = AuditWriter(tmp_path, 0)
    with pytest.raises(ValueError, match=r"step must be in \[0, inf\], got -1"):
        writer.write(0, -1, [1])
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(0, 0, [1])


def test_cli_exit_codes(tmp_path: Path) -> None:
    clean, broken, unreadable = tmp_path / "clean", tmp_path / "broken", tmp_path / "unreadable"
    write_expected(clean, {"dataset_size": 4})
    write_epoch(clean, 0, {0: [[0, 1]], 1: [[2, 3]]})
    write_expected(broken, {"dataset_size": 4})
    write_epoch(broken, 0, {0: [[0, 1]], 1: [[1, 3]]})
    unreadable.mkdir()
    runner = CliRunner()
    result = runner.invoke(audit_command, [str(clean)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "epoch 0 (complete)" in result.output
    result = runner.invoke(audit_command, [str(broken)])
    assert result.exit_code == 1, result.output
    assert "VIOLATION" in result.output and "1 duplicated, 1 missing" in result.output
    result = runner.invoke(audit_command, [str(unreadable)])
    assert result.exit_code == 2, result.output
    assert "audit.json not found" in result.output


def test_no_records_is_an_error_not_a_pass(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 4})  # a stream was built with audit_dir but nothing was consumed
    report = audit_directory(tmp_path)
    assert report.empty and not report.ok
    result = CliRunner().invoke(audit_command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "NO RECORDS" in result.output and "nothing was consumed through an audited loop" in result.output


def test_ranks_are_labelled_with_their_world_size(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 10})
    for world, parts in ((2, [[0, 1], [2, 3]]), (3, [[4, 5], [6, 7], [8, 9]])):  # resumed at another world size
        for rank, indices in enumerate(parts):
            with AuditWriter(tmp_path, rank, world_size=world) as writer:
                writer.write(0, world, indices)
    assert json.loads((tmp_path / "rank-00000.jsonl").read_text().splitlines()[1])["world_size"] == 3
    (epoch,) = audit_directory(tmp_path).epochs
    assert epoch.rank_samples == {(0, 2): 2, (1, 2): 2, (0, 3): 2, (1, 3): 2, (2, 3): 2}
    assert [str(consumer) for consumer in epoch.rank_samples] == ["0 of 2", "1 of 2", "0 of 3", "1 of 3", "2 of 3"]
    result = CliRunner().invoke(audit_command, [str(tmp_path)])
    assert result.exit_code == 0 and "0 of 2" in result.output and "2 of 3" in result.output, result.output
    with pytest.raises(ValueError, match=r"world_size must be in \[3, inf\], got 2"):
        AuditWriter(tmp_path, 2, world_size=2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.data())
def test_rows_delivered_twice_are_named_and_the_missing_counted(size: int, ranks: int, data: st.DataObject) -> None:
    """Every index once, but each rank reads its own view of the rows (a per-rank shuffle): only keys can tell."""
    views = [data.draw(st.permutations(range(size)), label=f"rank {rank}'s rows") for rank in range(ranks)]
    owners = data.draw(st.lists(st.integers(0, ranks - 1), min_size=size, max_size=size), label="owner of each index")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        write_expected(root, {"dataset_size": size, "key": "id"})
        for rank in range(ranks):
            mine = [index for index in range(size) if owners[index] == rank]
            with AuditWriter(root, rank, world_size=ranks) as writer:
                writer.write(0, 0, mine, keys=[views[rank][index] for index in mine])
        report = audit_directory(root)
    (epoch,) = report.epochs
    delivered = [views[owners[index]][index] for index in range(size)]
    counts = np.bincount(delivered, minlength=size)
    assert epoch.coverage.exactly_once, "by position alone every index was consumed once"
    assert epoch.keys is not None and epoch.keys.keyed == size
    assert set(epoch.keys.duplicates) == {key for key in range(size) if counts[key] > 1}
    for key, deliveries in epoch.keys.duplicates.items():
        assert sorted(delivery.index for delivery in deliveries) == [i for i in range(size) if delivered[i] == key]
        assert all(delivery.consumer == (owners[delivery.index], ranks) for delivery in deliveries)
    assert epoch.missing_rows == int((counts == 0).sum())
    assert epoch.ok == report.ok == (counts == 1).all()


def test_an_index_delivered_as_two_rows_is_named_across_epochs(tmp_path: Path) -> None:
    write_expected(tmp_path, {"dataset_size": 3})
    with AuditWriter(tmp_path, 0, world_size=2) as writer:
        writer.write(0, 0, [0, 1, 2], keys=["a", "b", "c"])
    with AuditWriter(tmp_path, 1, world_size=2) as writer:
        writer.write(1, 0, [0, 1, 2], keys=["a", "c", "b"])  # another rank sees rows 1 and 2 swapped
    report = audit_directory(tmp_path)
    assert all(epoch.ok for epoch in report.epochs) and not report.ok
    assert [(conflict.index, [key for key, _ in conflict.deliveries]) for conflict in report.conflicts] == [
        (1, ["b", "c"]),
        (2, ["c", "b"]),
    ]
    first = report.conflicts[0].deliveries[1][1]
    assert (first.consumer, first.epoch, first.step, first.index) == ((1, 2), 1, 0, 1)
    result = CliRunner().invoke(audit_command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "2 indices delivered as different rows (index 1: key 'b' at rank 0 of 2, epoch 0 step 0" in result.output


def test_keys_must_match_the_indices(tmp_path: Path) -> None:
    with AuditWriter(tmp_path, 0) as writer:
        with pytest.raises(ValueError, match=r"keys must be a list of one key per index \(2\)"):
            writer.write(0, 0, [1, 2], keys=[1])
        with pytest.raises(TypeError, match=r"keys must be ints or strings, got 1\.5"):
            writer.write(0, 0, [1], keys=[1.5])
    write_expected(tmp_path, {"dataset_size": 4})
    (tmp_path / "rank-00000.jsonl").write_text('{"epoch": 0, "step": 0, "rank": 0, "indices": [0], "keys": []}\n')
    with pytest.raises(AuditFileError, match=r"rank-00000\.jsonl:1: keys must be a list of one key per index"):
        audit_directory(tmp_path)


def test_the_spec_records_the_shards_and_refuses_other_data_naming_the_shard(tmp_path: Path) -> None:
    shards = [["a.parquet", 10, "00aa"], ["b.parquet", 12, "00bb"]]
    write_expected(tmp_path, {"dataset_size": 22, "shards": shards, "key": "id"})
    moved = [["/elsewhere/a.parquet", 10, "00aa"], ["/elsewhere/b.parquet", 12, "00bb"]]
    write_expected(tmp_path, {"dataset_size": 22, "shards": moved, "key": "id"})  # the same data under other paths
    with pytest.raises(ValueError, match=r"^shard 0 is 'b.parquet' \(12 rows, content 00bb\) here but 'a.parquet'"):
        write_expected(tmp_path, {"dataset_size": 22, "shards": shards[::-1], "key": "id"})
    with pytest.raises(ValueError, match="a per-rank shuffle or seed of the source gives each rank other rows"):
        write_expected(tmp_path, {"dataset_size": 22, "shards": [shards[0], ["b.parquet", 12, "0bad"]], "key": "id"})
    with pytest.raises(ValueError, match="conflicts with the spec already recorded"):
        write_expected(tmp_path, {"dataset_size": 22, "shards": shards, "key": None})
    with pytest.raises(ValueError, match=r"a shard identity must be \[name, rows, digest\]"):
        write_expected(tmp_path, {"dataset_size": 22, "shards": [["a", "10", "00aa"]]})
