"""The demo's task: an MLP on scikit-learn's handwritten digits.

The data set (1797 8x8 images) ships inside the scikit-learn package, so the
demo needs no download. :func:`write_digits_shards` writes it as Parquet or
JSON-lines shards and :func:`digits_source` reads it back through
:class:`~stalwart.data.shards.ShardedDataset` or Hugging Face ``datasets``, in
the same index order, so a run over shards trains exactly as over memory.
The model is seeded, so every worker starts from the same parameters; the
loss is the micro-batch's mean, as a user's loop under the Manager has it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from stalwart.data.shards import ShardedDataset

SOURCE_KINDS = ("digits", "parquet", "hf", "hf-iterable")


def digits_dataset() -> TensorDataset:
    """The digits as (features scaled to [0, 1], label) pairs."""
    features, labels = _digits_arrays()
    return TensorDataset(torch.tensor(features / 16.0, dtype=torch.float32), torch.tensor(labels, dtype=torch.int64))


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 rows of 64 pixel values (0 to 16) and their labels, as ``sklearn.datasets.load_digits`` gives them.

    Read from the file ``load_digits`` reads, found without importing
    scikit-learn: its import (SciPy's among it) costs about 1.4 s of CPU, and
    every fresh worker of the demo and of the tests loads the digits. Where a
    scikit-learn release keeps the file elsewhere, ``load_digits`` reads it.
    """
    spec = importlib.util.find_spec("sklearn")
    bundled = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if bundled is not None and bundled.is_file():
        rows = np.loadtxt(bundled, delimiter=",")
        return rows[:, :-1], rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


def write_digits_shards(directory: Path, shards: int, *, kind: str = "parquet", row_group: int = 32) -> list[Path]:
    """Write the digits in index order as ``shards`` files ``part-K.parquet`` (row groups of ``row_group``) or
    ``part-K.jsonl`` (``kind="jsonl"``); rows are ``{"features": 64 floats, "label": int}``."""
    features, labels = digits_dataset().tensors
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, rows in enumerate(np.array_split(np.arange(len(labels)), shards)):
        table = {"features": features[rows].tolist(), "label": labels[rows].tolist()}
        if kind == "parquet":
            path = directory / f"part-{number:03d}.parquet"
            schema = pa.schema([("features", pa.list_(pa.float32())), ("label", pa.int64())])
            pq.write_table(pa.table(table, schema=schema), path, row_group_size=row_group)
        elif kind == "jsonl":
            path = directory / f"part-{number:03d}.jsonl"
            lines = (json.dumps({"features": f, "label": y}) for f, y in zip(*table.values(), strict=True))
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        else:
            raise ValueError(f"kind must be 'parquet' or 'jsonl', got {kind!r}")
        paths.append(path)
    return paths


def digits_rows_collate(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``{"features", "label"}`` (from shards) as the (features, labels) batch of :func:`mean_loss`."""
    features = torch.tensor([row["features"] for row in rows], dtype=torch.float32)
    return features, torch.tensor([row["label"] for row in rows], dtype=torch.int64)


def digits_source(spec: str) -> tuple[Dataset[Any], Callable[[list[Any]], Any]]:
    """The digits and their collate function from ``spec``: ``digits`` (in memory), ``parquet:DIR``
    (:class:`ShardedDataset` over DIR's Parquet files), ``hf:DIR`` (a ``datasets.Dataset`` saved with
    ``save_to_disk``) or ``hf-iterable:DIR`` (an ``IterableDataset`` over DIR's JSON-lines or Parquet files)."""
    kind, _, location = spec.partition(":")
    if kind not in SOURCE_KINDS or (kind == "digits") != (location == ""):
        raise ValueError(f"data must be 'digits' or KIND:DIR with KIND in {SOURCE_KINDS[1:]}, got {spec!r}")
    if kind == "digits":
        return digits_dataset(), default_collate
    directory = Path(location)
    if kind == "parquet":
        return ShardedDataset.from_parquet(sorted(directory.glob("*.parquet"))), digits_rows_collate
    import datasets

    if kind == "hf":
        return datasets.load_from_disk(str(directory)), digits_rows_collate
    files = sorted(str(path) for path in directory.glob("*.jsonl")) or sorted(
        str(path) for path in directory.glob("*.parquet")
    )
    builder = "json" if files and files[0].endswith(".jsonl") else "parquet"
    stream = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
    return ShardedDataset.from_hf_iterable(stream), digits_rows_collate


def digits_model(seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    """A two-layer MLP with parameters drawn from ``seed``."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    torch.random.set_rng_state(generator_state)
    return model


DEFAULT_LR = 0.01


def digits_optimizer(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """Adam: per-parameter moments and a step count, so a heal or a checkpoint must carry its state."""
    return torch.optim.Adam(model.parameters(), lr=lr)


def digits_sgd(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (its learning rate ten times Adam's)."""
    return torch.optim.SGD(model.parameters(), lr=10 * lr, momentum=0.9)


def digits_plain_sgd(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """SGD without momentum: no optimizer state (its learning rate ten times Adam's)."""
    return torch.optim.SGD(model.parameters(), lr=10 * lr)


def digits_adamw(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """AdamW with weight decay 0.01."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable[[torch.nn.Module, float], torch.optim.Optimizer]] = {
    "adam": digits_optimizer,
    "adamw": digits_adamw,
    "sgd": digits_sgd,
    "plain-sgd": digits_plain_sgd,
}
"""The optimizers a worker may train with, by name."""


def digits_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Halve the learning rate every 10 steps: state outside the optimizer that a heal must carry too."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)


def mean_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy, the mean over the micro-batch (torch's default reduction)."""
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels)
