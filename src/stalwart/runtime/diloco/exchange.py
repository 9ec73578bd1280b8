"""A fragment's exchange across replica groups: the weighted sum of every group's pseudo-gradient, and its weight.

Process ``r`` of each group exchanges slice ``r`` of the fragment (the
fragment cut into as many slices as the group has processes) with process
``r`` of every other group, over a communicator of one process per group;
the group's processes then all-gather the reduced slices among themselves.
So a group puts a fragment on the cross-group link once, whatever its size,
and every process of every group ends with the same bits.

By codec (``n`` groups, ``M`` values in the slice; what one process sends, as
a ring algorithm moves it):

- float32: one all-reduce of the values and the group's weight:
  ``2 (n - 1) / n * 4 (M + 1)`` bytes;
- bfloat16: an all-reduce of the values in bfloat16 (``2 (n - 1) / n * 2 M``)
  and one of the weight in float32;
- int8: the slice in ``n`` chunks of whole blocks, each packed (int8 values,
  float32 scales) with the weight's 4 bytes; an all-to-all sends chunk ``d``
  to group ``d``, which sums the ``n`` chunks it received in float32, packs the
  sum and the summed weight, and an all-gather returns every sum to every
  group: ``2 (n - 1) / n * (packed chunks + 4 n)`` bytes, about a quarter of
  float32's.

:func:`prepare` encodes a contribution (and tells what the receivers will
decode of it: the codec's rounding, which error feedback carries into the
next send), :func:`run` moves it (blocking: the caller runs it on a thread to
overlap it with compute), :func:`sent_bytes` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.runtime.comm import Communicator
from stalwart.runtime.diloco.codec import BFLOAT16, FLOAT32, INT8, pack_int8, packed_size, unpack_int8


@dataclass(frozen=True)
class Prepared:
    """One process's encoded contribution to a fragment slice's exchange."""

    codec: str
    numel: int
    members: int
    block: int
    payload: torch.Tensor
    """What goes on the wire: float32 values and the weight; bfloat16 values; or packed bytes per member."""
    weight: float
    decoded: torch.Tensor
    """The contribution as the receivers decode it (float32, ``numel`` values)."""


def chunk_numel(numel: int, members: int, block: int) -> int:
    """Values per member's chunk of an int8 exchange: whole blocks, so that every chunk packs alone."""
    return -(-numel // (members * block)) * block


def prepare(values: torch.Tensor, weight: float, codec: str, members: int, block: int) -> Prepared:
    """Encode ``values`` (1-D float32, already weighted) and ``weight`` for an exchange among ``members`` groups."""
    values = values.reshape(-1).float()
    numel = values.numel()
    if codec == FLOAT32:
        payload = torch.cat([values, torch.tensor([float(weight)], device=values.device)])
        return Prepared(codec, numel, members, block, payload, weight, values)
    if codec == BFLOAT16:
        payload = values.to(torch.bfloat16)
        return Prepared(codec, numel, members, block, payload, weight, payload.float())
    if codec != INT8:
        raise ValueError(f"codec must be float32, bfloat16 or int8, got {codec!r}")
    chunk = chunk_numel(numel, members, block)
    padded = torch.zeros(members * chunk, dtype=torch.float32, device=values.device)
    padded[:numel] = values
    rows, decoded = [], []
    weight_bytes = _float_bytes(weight, values.device)
    for member in range(members):
        packed = pack_int8(padded[member * chunk : (member + 1) * chunk], block)
        rows.append(torch.cat([packed, weight_bytes]))
        decoded.append(unpack_int8(packed, chunk, block))
    return Prepared(codec, numel, members, block, torch.cat(rows), weight, torch.cat(decoded)[:numel])


def run(comm: Communicator, prepared: Prepared) -> tuple[torch.Tensor, float]:
    """Exchange ``prepared`` over ``comm`` (one process per group): the summed values (float32) and weight."""
    if prepared.codec == FLOAT32:
        buffer = prepared.payload.clone()
        comm.start_all_reduce_sum(buffer)()
        return buffer[:-1], float(buffer[-1])
    if prepared.codec == BFLOAT16:
        values = prepared.payload.clone()
        weight = torch.tensor([prepared.weight], dtype=torch.float32, device=values.device)
        wait_values = comm.start_all_reduce_sum(values)
        wait_weight = comm.start_all_reduce_sum(weight)
        wait_values()
        wait_weight()
        return values.float(), float(weight[0])
    return _run_int8(comm, prepared)


def _run_int8(comm: Communicator, prepared: Prepared) -> tuple[torch.Tensor, float]:
    members, block = prepared.members, prepared.block
    chunk = chunk_numel(prepared.numel, members, block)
    row = packed_size(chunk, block) + 4
    received = comm.all_to_all(prepared.payload, [row] * members, [row] * members)
    total = torch.zeros(chunk, dtype=torch.float32, device=received.device)
    weight = 0.0
    for member in range(members):
        part = received[member * row : (member + 1) * row]
        total += unpack_int8(part[:-4], chunk, block)
        weight += float(part[-4:].clone().view(torch.float32)[0])
    mine = torch.cat([pack_int8(total, block), _float_bytes(weight, total.device)])
    gathered = comm.all_gather(mine)
    sums = [unpack_int8(gathered[member * row : (member + 1) * row - 4], chunk, block) for member in range(members)]
    weight = float(gathered[row - 4 : row].clone().view(torch.float32)[0])
    return torch.cat(sums)[: prepared.numel], weight


def sent_bytes(codec: str, numel: int, members: int, block: int) -> int:
    """Bytes one process sends in an exchange of ``numel`` values among ``members`` groups (ring algorithms)."""
    if members <= 1:
        return 0
    ring = 2 * (members - 1) / members
    if codec == FLOAT32:
        return round(ring * 4 * (numel + 1))
    if codec == BFLOAT16:
        return round(ring * 2 * numel + ring * 4)
    row = packed_size(chunk_numel(numel, members, block), block) + 4
    return 2 * (members - 1) * row  # the all-to-all sends n - 1 rows, the all-gather n - 1 copies of one


def collectives(codec: str) -> int:
    """How many collectives one exchange issues (each pays the link's round trips)."""
    return 1 if codec == FLOAT32 else 2


def _float_bytes(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([float(value)], dtype=torch.float32, device=device).view(torch.uint8)
