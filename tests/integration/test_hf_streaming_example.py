"""The README's recipe as written: a Hugging Face streaming dataset under torchrun with DataLoader workers.

Two torchrun launches over one epoch (2 ranks x 2 workers, then 1 rank
without workers), the second resuming from the first one's checkpoint: every
row is trained on exactly once by the ids the ranks read out of their rows,
and the audit agrees, labelling each rank with its world size (other changes
of ranks and workers: ``test_dataloader_workers``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from stalwart.cli.audit import audit_command
from stalwart.data.audit import audit_directory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_streaming_torchrun.py"
RUNS = [(2, 2, 6), (1, 0, None)]
"""(ranks, DataLoader workers, steps before stopping; None: to the end of the epoch)."""


def torchrun(ranks: int, *arguments: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        str(EXAMPLE), *arguments,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_the_recipe_trains_each_row_once_across_world_size_changes(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    data = tmp_path / "data"
    data.mkdir()
    for shard in range(6):  # small shards: 6 x 50 rows, 300 rows in 13 steps of 24
        rows = range(shard * 50, (shard + 1) * 50)
        (data / f"part-{shard}.jsonl").write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in rows))
    common = ["--data", str(data), "--global-batch", "24", "--checkpoint", str(tmp_path / "checkpoint.pt")]
    common += ["--audit", str(tmp_path / "audit"), "--record", str(tmp_path / "ids")]
    for ranks, workers, steps in RUNS:
        torchrun(ranks, *common, "--workers", str(workers), *(["--max-steps", str(steps)] if steps else []))
    trained = Counter(i for path in (tmp_path / "ids").glob("*.json") for i in json.loads(path.read_text()))
    assert sorted(trained) == list(range(300)) and set(trained.values()) == {1}
    assert len(list((tmp_path / "ids").glob("*.json"))) == 3
    report = audit_directory(tmp_path / "audit")
    assert report.ok and [epoch.complete for epoch in report.epochs] == [True]
    (epoch,) = report.epochs
    assert set(epoch.rank_samples) == {(0, 2), (1, 2), (0, 1)}
    assert epoch.keys is not None and epoch.keys.distinct == 300
    assert sum(epoch.rank_batches[(rank, 2)] for rank in range(2)) == 2 * 6
    from click.testing import CliRunner

    result = CliRunner().invoke(audit_command, [str(tmp_path / "audit")])
    assert result.exit_code == 0 and "0 of 3" in result.output and "OK" in result.output, result.output
