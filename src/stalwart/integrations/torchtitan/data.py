"""torchtitan's text stream as positions: what stalwart's loader needs for exactly-once steps, in bounded memory.

torchtitan's ``HuggingFaceTextDataset`` is an iterable: it tokenizes each
document with the job's tokenizer and packs the tokens into samples of
``seq_len`` inputs, labels and positions, looping over the corpus
(``infinite``). stalwart hands out sample *positions* (a step's share, a dead
group's positions again), so it needs random access. :class:`StreamedText`
gives it without holding the corpus: position ``p`` is the ``p``-th sample
the stream packs (one rank of one), packed when it is first asked for, in
order, and the last ``retain`` samples are kept (int32) for the positions
asked again (a dead group's share of the step, the step retried). The plan
hands positions out in order (``shuffle=False``, torchtitan's own order), so
memory holds about two steps' samples whatever the run's length or the
corpus's size. A position older than what is kept is found by packing the
stream again from its start: slow, never wrong.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
from torch.utils.data import Dataset

from stalwart._validate import check_int

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]

logger = logging.getLogger(__name__)


class SampleStream(Protocol):
    """An iterable of packed samples that can say where it is and resume there (torchtitan's text dataset is one)."""

    def __iter__(self) -> Iterator[Sample]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StreamedText(Dataset[Sample]):
    """``length`` positions of a packed sample stream; item ``p`` is ``({"input": ..., "positions": ...}, labels)``.

    ``stream`` returns a fresh :class:`SampleStream` at the stream's start.
    ``identity`` names what the stream reads (dataset, path, ``seq_len``):
    with the first sample's tokens (which the tokenizer made) it makes
    :attr:`fingerprint`, which the Manager compares across groups.

    Every ``anchor_every`` positions (a step's samples) the stream's own state
    is noted; :meth:`state_dict` is the oldest noted one still kept, so a
    group that joins late, healed with it, packs from about the live groups'
    step instead of from the stream's start (and a whole-fleet restart
    resumes there from stalwart's checkpoint). Thread-safe: the loader's
    prefetch and the training thread may ask at once.
    """

    def __init__(
        self, stream: Callable[[], SampleStream], length: int, retain: int, anchor_every: int, identity: str
    ) -> None:
        if not callable(stream):
            raise TypeError(f"stream must be callable (a fresh sample stream at its start), got {stream!r}")
        self.length = check_int("length", length, minimum=1)
        self.anchor_every = check_int("anchor_every", anchor_every, minimum=1)
        self.retain = check_int("retain", retain, minimum=self.anchor_every)
        self.identity = identity
        self._stream = stream
        self._lock = threading.Lock()
        self._kept: deque[Sample] = deque(maxlen=self.retain)
        self._anchors: dict[int, dict[str, Any]] = {}
        self._open(0, None)
        self.restarts = 0
        """How many times a position older than the kept ones made the stream start again."""
        inputs, labels = self[0]
        digest = hashlib.sha256(identity.encode())
        for name in sorted(inputs):
            digest.update(name.encode())
            digest.update(inputs[name].numpy().tobytes())
        digest.update(labels.numpy().tobytes())
        self.fingerprint = digest.hexdigest()[:16]
        """Equal on groups that read the same stream the same way (the Manager compares it)."""

    def __len__(self) -> int:
        return self.length

    @property
    def packed(self) -> int:
        """The next position the stream packs: positions below it were read, the rest not yet."""
        return self._packed

    @property
    def kept(self) -> range:
        """The positions held in memory (the last ``retain`` packed)."""
        return range(self._packed - len(self._kept), self._packed)

    def __getitem__(self, index: int) -> Sample:
        position = check_int("index", index, minimum=0, maximum=self.length - 1)
        with self._lock:
            if position < self.kept.start:
                self._start_again(position)
            while self._packed <= position:
                self._pack_next()
            inputs, labels = self._kept[position - self.kept.start]
        return {name: tensor.long() for name, tensor in inputs.items()}, labels.long()

    def state_dict(self) -> dict[str, Any]:
        """``{"position": p, "stream": ...}``: the stream's state just before it packs position ``p``."""
        with self._lock:
            position = min(self._anchors)
            return {"position": position, "stream": copy.deepcopy(self._anchors[position])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume packing at ``state_dict["position"]`` (what :meth:`state_dict` of a stream like this one gave)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"position", "stream"}:
            raise ValueError(f"state_dict must be {{'position': int, 'stream': dict}}, got {state_dict!r:.200}")
        position = check_int("state_dict['position']", state_dict["position"], minimum=0, maximum=self.length)
        if not isinstance(state_dict["stream"], dict):
            raise ValueError(f"state_dict['stream'] must be a dict, got {type(state_dict['stream']).__name__}")
        with self._lock:
            self._open(position, state_dict["stream"])

    def _open(self, position: int, state: dict[str, Any] | None) -> None:
        """Read the stream from ``position``: from its start, or from ``state`` noted there."""
        source = self._stream()
        if state is not None:
            source.load_state_dict(copy.deepcopy(state))
        self._source = source
        self._samples = iter(source)
        self._packed = position
        self._kept.clear()
        self._anchors = {position: copy.deepcopy(source.state_dict())}

    def _pack_next(self) -> None:
        try:
            inputs, labels = next(self._samples)
        except StopIteration:
            raise ValueError(
                f"the dataset packed only {self._packed} samples and the run needs {self.length}: its documents "
                "hold too few tokens for training.seq_len, or the stream is not looped (dataloader.infinite)"
            ) from None
        self._kept.append(({name: tensor.to(torch.int32) for name, tensor in inputs.items()}, labels.to(torch.int32)))
        self._packed += 1
        if self._packed % self.anchor_every == 0:
            self._anchors[self._packed] = copy.deepcopy(self._source.state_dict())
        oldest_kept = self.kept.start
        for position in [position for position in self._anchors if position < oldest_kept]:
            del self._anchors[position]

    def _start_again(self, position: int) -> None:
        logger.warning(
            "sample %d was asked after %d newer ones were packed (%d are kept): packing the stream again from its "
            "start",
            position,
            self._packed - position,
            self.retain,
        )
        self.restarts += 1
        self._open(0, None)


def streamed_text(
    dataloader_config: Any, tokenizer: Any, seq_len: int, length: int, retain: int, anchor_every: int
) -> StreamedText:
    """torchtitan's text dataset of ``dataloader_config`` (a ``HuggingFaceTextDataLoader.Config``), streamed."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

    if not isinstance(dataloader_config, HuggingFaceTextDataLoader.Config):
        raise ValueError(
            f"dataloader={type(dataloader_config).__name__}: stalwart's torchtitan trainer reads text datasets "
            "through HuggingFaceTextDataLoader.Config (--dataloader.dataset, --dataloader.dataset_path)"
        )
    seq_len = check_int("training.seq_len", seq_len, minimum=1)

    def stream() -> SampleStream:
        return cast(
            SampleStream,
            HuggingFaceTextDataset(
                dataset_name=dataloader_config.dataset,
                dataset_path=dataloader_config.dataset_path,
                tokenizer=tokenizer,
                seq_len=seq_len,
                dp_rank=0,
                dp_world_size=1,
                infinite=dataloader_config.infinite,
            ),
        )

    identity = f"dataset={dataloader_config.dataset} path={dataloader_config.dataset_path} seq_len={seq_len}"
    return StreamedText(stream, length, retain, anchor_every, identity)
