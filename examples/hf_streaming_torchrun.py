"""The proposal's loop, a Hugging Face streaming dataset under torchrun with DataLoader workers, on ShardedStream.

The proposal (``../shared/proposals/microbatches-per-rank.txt``) shuffles the
stream with ``42 + global_rank`` and gives the DataLoader no sampler: every
rank then draws from the whole stream, so over a pass rows are trained on by
several ranks and others by none. Here every rank builds the same
``ShardedStream`` with its own rank: each step's global batch is split over
the ranks, each rank's part over its DataLoader workers, and together they
take every row of an epoch exactly once. The checkpoint holds the stream's
state, so a job stopped after ``--max-steps`` resumes at any world size and
worker count and still covers the epoch exactly once::

    python examples/hf_streaming_torchrun.py --make-data data          # 8 JSON-lines shards of 5000 rows
    torchrun --standalone --nproc-per-node 2 examples/hf_streaming_torchrun.py --data data --workers 2 \\
        --max-steps 200 --checkpoint run/checkpoint.pt --audit run/audit
    torchrun --standalone --nproc-per-node 3 examples/hf_streaming_torchrun.py --data data --workers 2 \\
        --checkpoint run/checkpoint.pt --audit run/audit                 # resumes at step 200 on 3 ranks
    stalwart audit run/audit                                            # each row once, ranks "r of w"

The model is wrapped in DDP; under FSDP2 (``fully_shard``) the data side is
the same. ``--record DIR`` writes the ids each rank trained on (one file per run
and rank), for a check that does not rely on the audit.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from stalwart.data import ShardedDataset, ShardedStream, WorldInfo

TEXT_BYTES = 32


def make_data(directory: Path, shards: int, rows: int) -> None:
    """``shards`` JSON-lines files of ``rows`` rows ``{"id", "text"}``, ids numbering every row once."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        ids = range(shard * rows, (shard + 1) * rows)
        lines = "".join(json.dumps({"id": i, "text": f"sample {i} " * (1 + i % 5)}) + "\n" for i in ids)
        (directory / f"part-{shard:05d}.jsonl").write_text(lines)


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Ids and the first ``TEXT_BYTES`` bytes of each text, zero-padded."""
    data = torch.zeros(len(rows), TEXT_BYTES, dtype=torch.long)
    for row, text in enumerate(row["text"].encode()[:TEXT_BYTES] for row in rows):
        data[row, : len(text)] = torch.tensor(list(text))
    return {"id": torch.tensor([row["id"] for row in rows]), "text": data}


class Model(torch.nn.Module):
    """Predicts a text's length in bytes from a bag of its first bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(256, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(text)).squeeze(-1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-data", type=Path, help="write demo shards into this directory and exit")
    parser.add_argument("--data", type=Path, help="directory of *.jsonl shards")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--global-batch", type=int, default=64, help="rows per step, all ranks (default 64)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train (default 1)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps of this run, saving a checkpoint")
    parser.add_argument("--checkpoint", type=Path, help="model, optimizer and stream state; loaded when present")
    parser.add_argument("--audit", type=Path, help="audit directory for `stalwart audit`")
    parser.add_argument("--record", type=Path, help="write the ids each rank trained on into this directory")
    args = parser.parse_args(argv)
    if args.make_data is not None:
        make_data(args.make_data, shards=8, rows=5000)
        return
    if args.data is None:
        parser.error("--data DIR is required (or --make-data DIR)")
    import datasets  # the hf extra: pip install 'stalwart[hf]'

    torch.set_num_threads(1)
    world = WorldInfo.from_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    files = sorted(str(path) for path in args.data.glob("*.jsonl"))  # every rank lists the same files, in order
    hf = datasets.load_dataset("json", data_files=files, split="train", streaming=True)  # no .shuffle(42 + rank)
    stream = ShardedStream(
        ShardedDataset.from_hf_iterable(hf, key="id"),
        args.global_batch,
        rank=world.rank,
        world_size=world.world_size,
        seed=0,
        collate_fn=collate,
        audit_dir=args.audit,
    )
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.checkpoint is not None and args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        stream.load_state_dict(json.loads(checkpoint["stream"]))
    start = f"e{stream.epoch}s{stream.step}"
    ddp = DistributedDataParallel(model)
    loader = DataLoader(stream, batch_size=None, num_workers=args.workers)
    trained: list[int] = []
    steps = 0
    stopped = False
    for epoch in range(stream.epoch, args.epochs):
        stream.set_epoch(epoch)
        for batch in stream.consume(loader):
            lengths = (batch.rows["text"] != 0).sum(dim=1).float()
            loss = ((ddp(batch.rows["text"]) - lengths) ** 2).sum()
            optimizer.zero_grad()
            (loss * world.world_size / stream.step_total(batch.step)).backward()  # DDP averages: the step's mean
            optimizer.step()
            trained.extend(batch.rows["id"].tolist())
            steps += 1
            if steps == args.max_steps:
                stopped = True
                break
        if stopped:
            break
    if args.checkpoint is not None and world.rank == 0:
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "stream": json.dumps(stream.state_dict())}, args.checkpoint)
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        name = f"ids-{start}-rank{world.rank}-of{world.world_size}.json"
        (args.record / name).write_text(json.dumps(trained))
    stream.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
