"""Training through failures from sharded sources: Parquet files and Hugging Face datasets over local files.

The loader tests check that ``ElasticLoader`` reads a share through the
dataset's ``__getitems__`` (each piece once). The job tests run the digits job
on real worker processes whose data comes from shards written here, under the
lighthouse's windowed block order, SIGKILL a member mid-step, and check the
audit (every committed position exactly once, the loaders' checksums) and
the final parameters against a failure-free run in one process; then bad
input: members reading different shards, and a shard that fails to read.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.data.shards import InMemoryShard, ShardedDataset
from stalwart.data.streaming import ShardedStream
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.digits import digits_dataset, digits_rows_collate, write_digits_shards
from stalwart.launch.report import audit_steps, committed_steps, loader_audit_mismatches, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.runtime.loader import ElasticLoader

STEPS = 10
WORKERS = 2  # a SIGKILL leaves one survivor to train the lost share
PLAN = EpochPlan(1797, 48, seed=0, block_size=32, window=4)
PARAM_TOLERANCE = 1e-4
JOB_TIMEOUT = 150.0
WORKER_ARGS = ["--max-steps", str(STEPS), "--max-microbatch", "8", "--collective-timeout", "1.0"]


class CountingShard(InMemoryShard):
    """Rows in memory in pieces of ``piece`` rows; records every read."""

    def __init__(self, rows: list[Any], piece: int) -> None:
        super().__init__(rows)
        self.piece_starts = (*range(0, len(rows), piece), len(rows))
        self.reads = 0

    def read(self, start: int, stop: int) -> list[Any]:
        self.reads += 1
        return super().read(start, stop)


@pytest.mark.parametrize(("num_workers", "prefetch"), [(0, False), (0, True), (2, True)])
def test_the_loader_reads_a_share_through_getitems_one_piece_at_a_time(num_workers: int, prefetch: bool) -> None:
    shards = [CountingShard(list(range(start, start + 100)), 20) for start in range(0, 400, 100)]
    loader = ElasticLoader(ShardedDataset(shards), collate_fn=list, num_workers=num_workers, prefetch=prefetch)
    plan = EpochPlan(400, 100, block_size=20, window=5, seed=1)
    try:
        for step in range(plan.steps_per_epoch):
            share = plan.indices(0, plan.step_start(step), plan.step_start(step) + 50).tolist()  # half the step
            loader.prefetch(0, share)
            batches = list(loader.microbatches(0, share, 16))
            assert [row for batch in batches for row in batch] == share
    finally:
        loader.close()
    if num_workers == 0:  # the reads happened in this process: each 20-row piece at most once per share
        assert sum(shard.reads for shard in shards) <= plan.steps_per_epoch * (50 // 20 + 2)


class LoggedShard(InMemoryShard):
    """Rows in memory in pieces of ``piece`` rows; appends ``pid shard start`` to ``log`` at every read."""

    def __init__(self, rows: list[Any], piece: int, number: int, log: Path) -> None:
        super().__init__(rows)
        self.piece_starts = (*range(0, len(rows), piece), len(rows))
        self.number, self.log = number, log

    def read(self, start: int, stop: int) -> list[Any]:
        with self.log.open("a") as log:
            log.write(f"{os.getpid()} {self.number} {start}\n")
        return super().read(start, stop)


def test_dataloader_workers_each_read_their_own_run_of_blocks(tmp_path: Path) -> None:
    log = tmp_path / "reads.log"
    shards = [LoggedShard(list(range(start, start + 100)), 20, start // 100, log) for start in range(0, 400, 100)]
    loader = ElasticLoader(ShardedDataset(shards), collate_fn=list, num_workers=2, prefetch=True)
    plan = EpochPlan(400, 100, block_size=20, window=5, seed=2)
    try:
        for step in range(plan.steps_per_epoch):
            share = plan.indices(0, plan.step_start(step), plan.step_start(step + 1)).tolist()
            loader.prefetch(0, share)
            assert [row for batch in loader.microbatches(0, share, 16) for row in batch] == share
    finally:
        loader.close()
    readers: dict[tuple[str, str], set[str]] = {}
    for line in log.read_text().splitlines():
        pid, shard, start = line.split()
        readers.setdefault((shard, start), set()).add(pid)
    assert len(readers) == 20  # every 20-row piece read
    assert sum(len(pids) for pids in readers.values()) <= 20 + plan.steps_per_epoch  # one split block per step


def test_the_loader_reads_a_hugging_face_dataset_in_groups(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    paths = write_digits_shards(tmp_path / "parquet", 4)
    dataset = datasets.Dataset.from_parquet([str(path) for path in paths], cache_dir=str(tmp_path / "cache"))
    loader = ElasticLoader(dataset, collate_fn=digits_rows_collate)
    share = PLAN.indices(0, 96, 144).tolist()
    features, labels = digits_dataset()[torch.tensor(share)]
    batches = list(loader.microbatches(0, share, 16))
    assert torch.equal(torch.cat([batch[0] for batch in batches]), features)
    assert torch.equal(torch.cat([batch[1] for batch in batches]), labels)
    loader.close()


def test_an_iterable_dataset_is_refused_with_the_way_to_shard_it() -> None:
    stream = ShardedStream([InMemoryShard([1, 2, 3])], 2, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"ShardedDataset\(stream.shards\), ShardedDataset.from_hf_iterable"):
        ElasticLoader(stream)  # type: ignore[arg-type]


# --- jobs of real worker processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards_reference() -> dict[str, torch.Tensor]:
    """The failure-free parameters of this module's block-shuffled plan."""
    parameters, _ = reference_run(PLAN, STEPS)
    return parameters


def write_source(directory: Path, kind: str) -> str:
    """Digits shards of ``kind`` under ``directory``; the worker's ``--data`` for them."""
    if kind == "parquet":
        write_digits_shards(directory, 8, row_group=32)
        return f"parquet:{directory}"
    if kind == "hf-iterable":
        write_digits_shards(directory, 6, kind="jsonl")
        return f"hf-iterable:{directory}"
    datasets = pytest.importorskip("datasets")
    paths = write_digits_shards(directory / "parquet", 4)
    dataset = datasets.Dataset.from_parquet([str(path) for path in paths], cache_dir=str(directory / "cache"))
    dataset.save_to_disk(str(directory / "saved"))
    return f"hf:{directory / 'saved'}"


def offline(worker: int) -> dict[str, str]:
    """Workers' environment: Hugging Face never goes to the network."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def wait_for_exit(cluster: LocalCluster, timeout: float = JOB_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while cluster.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if cluster.running():
        cluster.terminate()
        logs = "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(cluster.run_dir.glob("*.log")))
        pytest.fail(f"job did not end in {timeout} s; worker logs:\n{logs}")


def check_exactly_once(run_dir: Path, steps_run: int) -> None:
    steps = committed_steps(run_dir)
    assert [record["step"] for record in steps] == list(range(steps_run))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(steps_run)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    assert loader_audit_mismatches(PLAN, steps) == 0


def worst_difference(run_dir: Path, reference: dict[str, torch.Tensor], finishers: int) -> float:
    finals = sorted(run_dir.glob("final-*.pt"))
    assert len(finals) == finishers
    worst = 0.0
    for path in finals:
        parameters = torch.load(path, weights_only=True)
        worst = max(worst, *(float((parameters[name] - value).abs().max()) for name, value in reference.items()))
    return worst


@pytest.mark.parametrize("kind", ["parquet", "hf", "hf-iterable"])
def test_sigkill_mid_step_training_from_shards_is_exactly_once_and_matches(
    tmp_path: Path, lighthouse: Lighthouse, shards_reference: dict[str, torch.Tensor], kind: str
) -> None:
    data = write_source(tmp_path / "data", kind)
    cluster = LocalCluster(lighthouse.url, tmp_path / "run", [*WORKER_ARGS, "--data", data], worker_env=offline)
    for worker in range(WORKERS):
        cluster.start(worker, ["--kill-at", "4:during_backward"] if worker == 1 else None)
    wait_for_exit(cluster)
    assert cluster.processes[1].returncode == -signal.SIGKILL
    check_exactly_once(tmp_path / "run", STEPS)
    assert min(record["world_size"] for record in committed_steps(tmp_path / "run")) == WORKERS - 1
    assert worst_difference(tmp_path / "run", shards_reference, finishers=WORKERS - 1) < PARAM_TOLERANCE


def test_a_member_reading_other_shards_is_refused_and_the_job_goes_on(
    tmp_path: Path, shards_reference: dict[str, torch.Tensor]
) -> None:
    ours = write_source(tmp_path / "eight", "parquet")
    write_digits_shards(tmp_path / "five", 5, row_group=32)  # the same rows, cut into other files
    run_dir = tmp_path / "run"
    with Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, run_dir, WORKER_ARGS)
        cluster.start(0, ["--data", ours])
        cluster.start(1, ["--data", f"parquet:{tmp_path / 'five'}"])
        wait_for_exit(cluster)
    codes = {worker: cluster.processes[worker].returncode for worker in (0, 1)}
    assert sorted(codes.values()) == [0, 2]  # the quorum's rank 0 is the reference; the other one is refused
    refused = next(worker for worker, code in codes.items() if code == 2)
    error = (run_dir / f"worker-{refused}.log").read_text().strip().splitlines()[-1]
    assert error.startswith(f"stalwart worker worker-{refused}: member 'worker-{refused}' reads a dataset with")
    assert "every member must read the same shards in the same order" in error
    check_exactly_once(run_dir, STEPS)
    assert worst_difference(run_dir, shards_reference, finishers=1) < PARAM_TOLERANCE


def test_a_shard_that_fails_to_read_stops_the_job_with_its_name_and_nothing_twice(tmp_path: Path) -> None:
    data = write_source(tmp_path / "data", "parquet")
    broken = tmp_path / "data" / "part-005.parquet"
    content = bytearray(broken.read_bytes())
    footer = len(content) - 8 - int.from_bytes(content[-8:-4], "little")
    content[4:footer] = bytes(footer - 4)  # every row group's pages, not the footer: the shard opens, reads fail
    broken.write_bytes(bytes(content))
    offsets = np.cumsum([0, *(pq.read_metadata(path).num_rows for path in sorted(broken.parent.glob("*.parquet")))])
    first_step = min(
        step
        for step in range(PLAN.steps_per_epoch)
        if np.any(
            np.searchsorted(offsets, PLAN.indices(0, PLAN.step_start(step), PLAN.step_start(step + 1)), "right") == 6
        )
    )
    run_dir = tmp_path / "run"
    with Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, run_dir, [*WORKER_ARGS[:1], "200", *WORKER_ARGS[2:], "--data", data])
        cluster.start(0)
        cluster.start(1)
        wait_for_exit(cluster)
    assert sorted(cluster.processes[worker].returncode for worker in (0, 1)) == [2, 2]
    for worker in (0, 1):
        line = (run_dir / f"worker-{worker}.log").read_text().strip().splitlines()[-1]
        assert line.startswith(f"stalwart worker worker-{worker}: shard 5 (part-005.parquet) failed to read rows ")
    steps = committed_steps(run_dir)
    assert len(steps) <= first_step
    positions = np.concatenate([np.asarray(record["positions"], dtype=np.int64) for record in steps] or [np.zeros(0)])
    assert np.array_equal(np.sort(positions), np.arange(positions.size))
