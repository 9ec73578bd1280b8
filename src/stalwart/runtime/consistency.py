"""Checks that ride on each step's all-reduce: replicas that drifted, and samples that were not the ledger's.

Replica consistency
    Every process writes a checksum of its parameters and its applied step into
    its own slots of the all-reduce tail (zeros elsewhere), so the reduced tail
    holds every process's values exactly (a value plus zeros is exact in any
    order): all members see the same table and take the same decision
    (:func:`drift_plan`). The checksum is ``S1 = sum_i w_i * sum(p_i)`` (float64
    accumulation) and ``S2 = sum_i w_i * dot(p_i, p_i)`` with a fixed weight
    ``w_i`` per parameter, so a parameter moved to another layer shows too.
    Each float64 value travels as two float32 pieces (high and low part).
    Costs (one CPU thread): ~0.03 ms for the digits MLP (4.8k parameters),
    ~43 ms for a 10M-parameter MLP, whose forward and backward of 32 samples
    take ~40 ms, and ~0.8 ms for the GPT example's 0.8M (its step: ~70 ms on
    two processes); hence by default one check every ``ceil(parameters / 2**17)``
    steps (at most 100): under 1% of a step, every step for small models.

Data audit
    Every process adds a 64-bit hash of each ``(epoch, index)`` its loader
    actually produced in the step, summed mod 2**64, as eight 8-bit pieces in
    float32 slots: each piece is < 256 and the reduced piece < 256 * processes,
    exact in float32 (< 2**24) for up to 65536 processes. Pieces in the one
    all-reduce cost nothing; a separate int64 all-reduce would cost a second
    collective (its latency) per step. The reduced value must equal the hash
    sum of the samples at the step's ledger positions (:func:`index_checksum`).

Row audit
    Positions alone cannot see a loader that hands out other rows than its
    indices name (a member whose dataset is shuffled on its own, a wrong
    shard). A loader whose dataset keys its rows (``ShardedDataset.row_keys``:
    a column, or a content hash) also sums ``hash(index, key)`` over the rows
    it handed out (:func:`row_checksum`, the same eight pieces). Nobody can
    know the expected value of one step without reading every row, but an
    epoch that covers the whole dataset sums every ``(index, key)`` pair once,
    whichever member read which: every complete epoch must give the same sum
    (:class:`RowDigest`). Reading another member's view of the rows shows as a
    different sum at the end of the next epoch whose order gives those
    indices to another member.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stalwart._validate import check_int
from stalwart.data.rowkeys import mix64
from stalwart.errors import StalwartError

DRIFT_SLOTS = 5
"""Per process: S1 high, S1 low, S2 high, S2 low, applied step."""
AUDIT_PIECES = 8
_PIECE_BITS = 8
MAX_PROCESSES = 1 << (24 - _PIECE_BITS)
_S1_TOLERANCE = 1e-9
_S2_TOLERANCE = 1e-5
_MAX_EVERY = 100
_GOLDEN = 0.6180339887498949
_MASK = (1 << 64) - 1
_CHUNK = 1 << 20
_STEP_MODULUS = 1 << 24
"""Applied steps are compared mod 2**24, exact in float32."""


class ReplicaDriftError(StalwartError, RuntimeError):
    """Replicas kept differing after being healed: the training step itself is not deterministic across them."""


class AuditError(StalwartError, RuntimeError):
    """The samples the quorum loaded in a step are not those of the step's ledger positions."""


def default_check_every(parameters: int) -> int:
    """Steps between two replica-consistency checks for a model of ``parameters`` elements."""
    return max(1, min(_MAX_EVERY, -(-parameters // (1 << 17))))


def parameter_checksum(params: Sequence[torch.Tensor]) -> tuple[float, float]:
    """``(S1, S2)`` of ``params`` (see the module docstring); one device sync."""
    if not params:
        return 0.0, 0.0
    terms = []
    for position, param in enumerate(params):
        weight = 1.0 + (position * _GOLDEN) % 1.0
        # sum(dtype=float64) casts its whole input first: in chunks, the cast costs 8 MiB, not 2x the parameter.
        for chunk in param.detach().reshape(-1).split(_CHUNK):
            terms.append(torch.stack([chunk.sum(dtype=torch.float64), torch.dot(chunk, chunk).double()]) * weight)
    s1, s2 = torch.stack(terms).sum(dim=0).tolist()
    return float(s1), float(s2)


def drift_slots(rank: int, world_size: int, s1: float, s2: float, applied_step: int) -> torch.Tensor:
    """The float32 drift part of the tail: this process's values in its slots, zeros elsewhere."""
    if world_size > MAX_PROCESSES:
        raise ValueError(f"world_size must be <= {MAX_PROCESSES} processes for the step checks, got {world_size}")
    slots = torch.zeros(DRIFT_SLOTS * world_size, dtype=torch.float64)
    values = [*_split(s1), *_split(s2), applied_step % _STEP_MODULUS]
    slots[DRIFT_SLOTS * rank : DRIFT_SLOTS * (rank + 1)] = torch.tensor(values, dtype=torch.float64)
    return slots.to(torch.float32)


def _split(value: float) -> tuple[float, float]:
    high = float(np.float32(value)) if math.isfinite(value) else value
    low = float(np.float32(value - high)) if math.isfinite(value) else 0.0
    return high, low


@dataclass(frozen=True)
class DriftPlan:
    """Which replicas to heal (``targets``) from which (``source``), after a check found replicas differing.

    A replica is a process, or a group of FSDP2 processes (then the indices are the groups').
    """

    source: int
    targets: tuple[int, ...]


def drift_plan(reduced_slots: torch.Tensor, world_size: int, group_size: int = 1) -> DriftPlan | None:
    """None when every replica reported the same checksums and step; else the odd ones out and a source.

    With ``group_size`` G, processes ``g * G`` to ``g * G + G - 1`` are
    replica ``g``, a group whose processes each hold one shard of it (FSDP2):
    two replicas are the same when each of their processes reported the same
    values as the other's process of the same intra-group rank. Replicas are
    grouped by equal values (first come, by index); the largest group wins,
    ties going to the group of the lowest index (so with no majority every
    replica but the lowest one is healed). A pure function of the reduced
    tail, so every member decides the same.
    """
    group_size = check_int("group_size", group_size, minimum=1)
    if world_size % group_size:
        raise ValueError(f"world_size must be a multiple of group_size={group_size}, got {world_size}")
    table = reduced_slots.to(torch.float64).reshape(world_size, DRIFT_SLOTS).tolist()
    values = [(row[0] + row[1], row[2] + row[3], round(row[4])) for row in table]
    replicas = [values[start : start + group_size] for start in range(0, world_size, group_size)]
    groups: list[list[int]] = []
    for index, replica in enumerate(replicas):
        for group in groups:
            if all(_same(left, right) for left, right in zip(replicas[group[0]], replica, strict=True)):
                group.append(index)
                break
        else:
            groups.append([index])
    if len(groups) == 1:
        return None
    winner = max(groups, key=len)  # max keeps the first (lowest-indexed) of equally large groups
    return DriftPlan(source=winner[0], targets=tuple(index for index in range(len(replicas)) if index not in winner))


def _same(left: tuple[float, float, int], right: tuple[float, float, int]) -> bool:
    if left[2] != right[2]:
        return False
    scale = abs(left[1]) + abs(right[1]) + 1.0
    return _close(left[0], right[0], _S1_TOLERANCE * scale) and _close(left[1], right[1], _S2_TOLERANCE * scale)


def _close(left: float, right: float, tolerance: float) -> bool:
    if math.isnan(left) or math.isnan(right):
        return math.isnan(left) and math.isnan(right)
    return left == right or abs(left - right) <= tolerance


def index_checksum(epochs: np.ndarray | int, indices: np.ndarray | Sequence[int]) -> int:
    """Sum mod 2**64 of a fixed 64-bit hash of each ``(epoch, index)``: order-free, so shares can be split any way."""
    index_array = np.asarray(indices, dtype=np.uint64).reshape(-1)
    epoch_array = np.broadcast_to(np.asarray(epochs, dtype=np.uint64), index_array.shape)
    hashed = _mix(index_array ^ _mix(epoch_array))
    return int(hashed.sum(dtype=np.uint64))


def check_loaded(loaded_checksum: int, epoch: int, indices: np.ndarray, where: str, loader: str, share: str) -> None:
    """Raise ``AuditError`` unless ``loaded_checksum`` is the checksum of the samples ``indices`` of ``epoch``.

    ``indices`` are the sample indices of the step's positions (the plan's
    permutation of them); ``where`` names the step, ``loader`` who loaded
    (``the quorum``), ``share`` whose positions (``the ledger's``).
    """
    expected = index_checksum(epoch, indices)
    if loaded_checksum != expected:
        raise AuditError(
            f"{where}: the samples {loader} loaded (checksum {loaded_checksum:#018x}) are not those of {share} "
            f"{indices.size} positions (checksum {expected:#018x}): a member's loader produced other samples than "
            "its share"
        )


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    return mix64(values)


def row_checksum(indices: np.ndarray | Sequence[int], row_hashes: np.ndarray | Sequence[int]) -> int:
    """Sum mod 2**64 of a hash of each ``(index, row hash)``: order-free and the same in every epoch."""
    index_array = np.asarray(indices, dtype=np.uint64).reshape(-1)
    hash_array = np.asarray(row_hashes, dtype=np.uint64).reshape(-1)
    if index_array.shape != hash_array.shape:
        raise ValueError(f"row_hashes must give one hash per index ({index_array.size}), got {hash_array.size}")
    return int(_mix(_mix(index_array) ^ hash_array).sum(dtype=np.uint64))


class RowDigest:
    """The row checksums of an epoch, summed; every complete epoch must match the first one (see the module doc).

    ``add(epoch, value)`` after each committed step with the quorum's reduced
    row checksum; ``close_epoch(epoch)`` when that epoch's last step
    committed, for plans that cover the whole dataset every epoch (not
    ``drop_last``, whose dropped tail differs by epoch). Its state is part of
    a member's state: healed, checkpointed, the same on every member.
    """

    def __init__(self) -> None:
        self.reference: int | None = None
        self.epoch = 0
        self.running = 0

    def add(self, epoch: int, value: int) -> None:
        """Add a committed step's row checksum to epoch ``epoch``'s sum."""
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self.running = epoch, 0
        self.running = (self.running + check_int("value", value, minimum=0, maximum=_MASK)) & _MASK

    def close_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` is complete: its sum becomes the reference, or must equal it (else :class:`AuditError`)."""
        epoch = check_int("epoch", epoch, minimum=0)
        running = self.running if epoch == self.epoch else 0
        self.epoch, self.running = epoch + 1, 0
        if self.reference is None:
            self.reference = running
        elif running != self.reference:
            raise AuditError(
                f"epoch {epoch}: the rows the quorum trained on sum to {running:#018x}, earlier epochs to "
                f"{self.reference:#018x}: some member's loader hands out other rows for the same indices than earlier "
                "epochs did (a dataset shuffled or seeded per member, other files, a source that changed)"
            )

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the sums as hex strings."""
        reference = None if self.reference is None else f"{self.reference:#x}"
        return {"reference": reference, "epoch": self.epoch, "running": f"{self.running:#x}"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s form."""
        if not isinstance(state, Mapping) or set(state) != {"reference", "epoch", "running"}:
            raise ValueError(f"state must be a RowDigest.state_dict(), got {state!r}")
        try:
            reference = None if state["reference"] is None else int(state["reference"], 16)
            running = int(state["running"], 16)
        except (TypeError, ValueError) as error:
            raise ValueError(f"state's sums must be hex strings, got {state!r}") from error
        self.reference, self.epoch, self.running = (
            reference,
            check_int("state['epoch']", state["epoch"], minimum=0),
            running,
        )


def audit_pieces(checksum: int) -> torch.Tensor:
    """``checksum`` (a 64-bit value) as eight float32 pieces of 8 bits, lowest first."""
    mask = (1 << _PIECE_BITS) - 1
    return torch.tensor([(checksum >> (_PIECE_BITS * j)) & mask for j in range(AUDIT_PIECES)], dtype=torch.float32)


def audit_value(reduced_pieces: Sequence[float]) -> int:
    """The summed checksum (mod 2**64) from the reduced pieces' values (the decoded tail's numbers)."""
    return sum(round(piece) << (_PIECE_BITS * j) for j, piece in enumerate(reduced_pieces)) & _MASK
