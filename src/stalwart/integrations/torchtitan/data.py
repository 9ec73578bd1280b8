"""torchtitan's text samples as a map-style dataset: what stalwart's loader needs for exactly-once steps.

torchtitan's ``HuggingFaceTextDataset`` is an iterable: it tokenizes each
document with the job's tokenizer and packs the tokens into samples of
``seq_len`` inputs, labels and positions, each data-parallel rank reading its
own part. stalwart hands out sample *positions* (a step's share, a dead
group's positions again), so it needs random access: :func:`packed_text`
runs torchtitan's dataset once over the whole corpus (one rank of one) and
keeps the packed samples, the same samples torchtitan would train on, in
memory as int32. ``limit`` bounds them (the trainer passes the samples the
whole run needs), so a streamed corpus is read only as far as the run goes;
a run whose samples would not fit in memory is refused before any is packed
(:func:`check_packing_fits`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import Dataset

from stalwart._validate import check_int
from stalwart.data.world import WorldInfo

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


class PackedText(Dataset[Sample]):
    """Packed token samples: item ``i`` is ``({"input": ..., "positions": ...}, labels)`` as torchtitan yields it."""

    def __init__(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        if any(tensor.shape != labels.shape for tensor in inputs.values()):
            shapes = {name: tuple(tensor.shape) for name, tensor in inputs.items()}
            raise ValueError(f"inputs {shapes} must have the labels' shape {tuple(labels.shape)}")
        self.inputs = inputs
        self.labels = labels
        digest = hashlib.sha256()
        for name in sorted(inputs):
            digest.update(name.encode())
            digest.update(inputs[name].numpy().tobytes())
        digest.update(labels.numpy().tobytes())
        self.fingerprint = digest.hexdigest()[:16]
        """Equal on every group exactly when they packed the same samples (the Manager compares it)."""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        return {name: tensor[index].long() for name, tensor in self.inputs.items()}, self.labels[index].long()


def pack_samples(samples: Iterable[Sample], limit: int) -> PackedText:
    """The first ``limit`` of ``samples`` (all if fewer) as a :class:`PackedText`; at least one is needed."""
    check_int("limit", limit, minimum=1)
    inputs: dict[str, list[torch.Tensor]] = {}
    labels: list[torch.Tensor] = []
    for input_dict, sample_labels in samples:
        for name, tensor in input_dict.items():
            inputs.setdefault(name, []).append(tensor.to(torch.int32))
        labels.append(sample_labels.to(torch.int32))
        if len(labels) == limit:
            break
    if not labels:
        raise ValueError("the dataset packed no sample: its documents hold fewer tokens than training.seq_len")
    return PackedText({name: torch.stack(tensors) for name, tensors in inputs.items()}, torch.stack(labels))


PACKED_TENSORS = 3
"""Tensors a packed sample holds at most (torchtitan's inputs and positions, the labels), each of int32."""
MEMORY_SHARE = 2
"""The packed samples of all of a node's processes may take up to 1/``MEMORY_SHARE`` of its memory."""


def check_packing_fits(limit: int, seq_len: int, processes_per_node: int, memory_bytes: int) -> None:
    """Refuse, before tokenizing anything, a run whose packed samples would not fit in memory.

    Every process packs the samples of the whole run (``limit``) for itself,
    so a node holds ``processes_per_node`` copies: together they may take up
    to half of ``memory_bytes``. A run past that would be found out of memory
    only after the tokenizer ran over its corpus; corpora larger than memory
    (streamed) are not supported by this trainer yet.
    """
    needed = limit * seq_len * PACKED_TENSORS * 4
    allowed = memory_bytes // (MEMORY_SHARE * processes_per_node)
    if needed > allowed:
        raise ValueError(
            f"training.steps x training.global_batch_size = {limit} samples of training.seq_len = {seq_len} tokens "
            f"packed in memory take {needed / 2**30:.1f} GiB per process, and this node's {processes_per_node} "
            f"process(es) may take {allowed / 2**30:.1f} GiB each (half of its {memory_bytes / 2**30:.1f} GiB): "
            "stalwart's torchtitan trainer holds the run's packed samples in memory (a streamed corpus larger than "
            "memory is not supported yet): lower training.steps or training.seq_len"
        )


def node_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def packed_text(dataloader_config: Any, tokenizer: Any, seq_len: int, limit: int) -> PackedText:
    """torchtitan's text dataset of ``dataloader_config`` (a ``HuggingFaceTextDataLoader.Config``), packed."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

    if not isinstance(dataloader_config, HuggingFaceTextDataLoader.Config):
        raise ValueError(
            f"dataloader={type(dataloader_config).__name__}: stalwart's torchtitan trainer reads text datasets "
            "through HuggingFaceTextDataLoader.Config (--dataloader.dataset, --dataloader.dataset_path)"
        )
    check_packing_fits(limit, seq_len, WorldInfo.from_env().local_world_size, node_memory_bytes())
    dataset = HuggingFaceTextDataset(
        dataset_name=dataloader_config.dataset,
        dataset_path=dataloader_config.dataset_path,
        tokenizer=tokenizer,
        seq_len=check_int("training.seq_len", seq_len, minimum=1),
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    return pack_samples(dataset, limit)
