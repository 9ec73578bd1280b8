"""State bytes per process: the sharded optimizer state (fp32 master and moments) each process holds.

The state is ``P * s`` elements of ``b`` bytes, ``s`` per parameter (Adam: two
moments and the fp32 master, 3; SGD with momentum: 2). It is cut into ``N``
shards of consecutive parameters, the first ``P mod N`` one element longer
(``torch.tensor_split``'s rule), and each shard into ``cells_per_shard``
cells by the same rule. A process holds its own shard, and each redundant unit
it holds is as long as the longest data cell of its stripe (shorter cells are
zero-padded for parity). A copy holds all ``s`` rows; a parity unit holds the
``s - 1`` state rows only, since the masters are the parameters, which every
process holds. With ``S = P * s * b``, that is about

- overlap with ``r`` copies: ``(1 + r) * S / N``
- parity ``(k, m)``: ``(1 + (s - 1) / s * m / k) * S / N``

and exactly what :func:`state_bytes` returns, process by process. The model's
parameters and gradients stay whole on every process and are not counted.
"""

from __future__ import annotations

from stalwart._validate import check_int
from stalwart.redundancy.config import Parity
from stalwart.redundancy.placement import Placement

OPTIMIZER_STATE_ELEMENTS: dict[str, int] = {"adam": 3, "sgd": 2}
"""Sharded fp32 elements per parameter: Adam's two moments and SGD's momentum, each plus the fp32 master."""

FP32_BYTES = 4


def split_lengths(total: int, parts: int) -> tuple[int, ...]:
    """``total`` elements in ``parts`` consecutive pieces, the first ``total mod parts`` one longer."""
    total = check_int("total", total, minimum=0)
    parts = check_int("parts", parts, minimum=1)
    base, extra = divmod(total, parts)
    return tuple(base + (part < extra) for part in range(parts))


def state_bytes(
    placement: Placement, parameters: int, *, state_elements: int, element_bytes: int = FP32_BYTES
) -> tuple[int, ...]:
    """Bytes of sharded state held by each process: its shard plus its copies or parity units (no master rows)."""
    parameters = check_int("parameters", parameters, minimum=1)
    per_element = check_int("state_elements", state_elements, minimum=1) * check_int(
        "element_bytes", element_bytes, minimum=1
    )
    per_unit = per_element - element_bytes if isinstance(placement.redundancy, Parity) else per_element
    shards = split_lengths(parameters, placement.processes)
    cells = [split_lengths(length, placement.cells_per_shard) for length in shards]
    unit = [max(cells[cell.shard][cell.index] for cell in stripe.cells) for stripe in placement.stripes]
    return tuple(
        shards[process] * per_element + sum(unit[stripe] for stripe, _ in held) * per_unit
        for process, held in enumerate(placement.redundant_units)
    )
