"""Repair and reshard of the sharded state when the quorum changes: rebuild the dead's shards, move every range.

Every process of the new quorum tells all others what it holds (layout,
updates, whether its last update was synced: one all-gather of JSON
records); all derive the same new layout and
:func:`~stalwart.redundancy.layout.plan_repair` (pure) says which cells are
rebuilt where, from copies or parity, and which element ranges move. One
all-to-all carries the rebuilds' units, another the moves; a process keeps
what it already holds. A cell whose update was not synced anywhere is
rebuilt as it was before the update and updated again with the kept
gradients (a replay), so a failure anywhere in the step ends with the
failure-free run's state. A joining process gets its shards the same way,
with no disk round-trip.

What a peer publishes is checked before use (:func:`peer_info`): the fields
and their types, its layout against this job's element count, its rank
against that layout, its optimizer keys against this process's own. A
malformed value is a failed collective (the quorum is asked again), never a
crash.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import torch

from stalwart.redundancy.config import Overlap, Parity, Redundancy
from stalwart.redundancy.layout import (
    Range,
    Rebuild,
    RepairPlan,
    ShardLayout,
    ShardsLostError,
    layout_from,
    make_layout,
    plan_repair,
)
from stalwart.redundancy.parity import ParityCode, byte_view
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.zero.state import ShardState, clone

log = logging.getLogger(__name__)

PEER_FIELDS = frozenset(
    {"node", "layout", "rank", "updates", "committed", "parity_valid", "keys", "scalars", "rows_before", "loaded"}
)
"""What each process tells the others of its sharded state before a reshard."""
MAX_PEER_BYTES = 1 << 20
_MAX_NAME = 256
_SCALAR_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"})


def reshard(state: ShardState, comm: Communicator, applied_step: int) -> bool:
    """Give every process of ``comm``'s quorum its shards under the new layout; whether an update was replayed.

    The caller syncs afterwards (gathering the parameters only when this
    returns True: some update was applied again here, or some process missed
    the last gather).
    """
    started = time.perf_counter()
    repaired = False
    replayed = True
    info = {
        "node": state.node,
        "layout": None if state.layout is None else state.layout.describe(),
        "rank": state.rank,
        "updates": state.updates,
        "committed": state.committed,
        "parity_valid": state.parity_valid,
        "keys": state.keys(),
        "scalars": _encode_scalars(state.scalars()),
        "rows_before": len(state.keys()) + 1 if state.snapshot is None else len(_snapshot_keys(state)) + 1,
        "loaded": bool(state.template.state),
    }
    records = comm.all_gather_bytes(json.dumps(info).encode(), MAX_PEER_BYTES)
    infos = [peer_info(record, rank, state) for rank, record in enumerate(records)]
    nodes = [str(peer["node"]) for peer in infos]
    holding = [peer for peer in infos if peer["layout"] is not None]
    # The job's first layout must fit as configured (a bad choice is an error before training); later ones adapt.
    first = not holding and applied_step == 0
    new = make_layout(state.redundancy, nodes, state.elements) if first else _new_layout(state, nodes)
    newest = max((int(peer["updates"]) for peer in holding), default=0)
    reference = next((peer for peer in holding if int(peer["updates"]) == newest), None)
    same = [(rank, peer) for rank, peer in enumerate(infos) if reference and peer["layout"] == reference["layout"]]
    valid = {int(peer["rank"]): rank for rank, peer in same if int(peer["updates"]) == newest}
    if reference is None:
        if applied_step > 0 and not all(peer["loaded"] for peer in infos):
            raise ShardsLostError(
                tuple(range(new.processes)),
                f"no process of the quorum holds optimizer shards at step {applied_step}: all are lost; resume "
                "from a checkpoint",
            )
        keys, scalars = state.loaded_keys()
        rows = {s: state.fresh_rows(new, s, keys) for s in new.held_shards(comm.rank)}
        state.template.state.clear()  # a checkpoint's whole state, loaded into the user's optimizer: sharded now
        state.install(new, comm.rank, rows, keys, scalars)
        state.updates = applied_step
    else:
        old = layout_from(reference["layout"])
        parity_valid = {int(peer["rank"]) for peer in infos if peer["parity_valid"]} & set(valid)
        committed = any(infos[rank]["committed"] for rank in valid.values())
        # Before the update's sync ended anywhere, a process that missed the update (it did not see the
        # gradient's reduction end) holds the state as it was before it: usable, once updated again.
        behind = {} if committed else {int(p["rank"]): rank for rank, p in same if int(p["updates"]) == newest - 1}
        stale = [rank for rank, peer in enumerate(infos) if peer["layout"] is not None and rank not in valid.values()]
        replayed = bool(behind or stale) or not all(peer["committed"] for peer in infos)
        # A parity rebuild takes the cell's master from the rebuilder's parameters: after a commit, only those of
        # the processes that committed (their gather ended) are current; before it, no gather ended anywhere.
        rebuilders = {rank for rank in valid.values() if infos[rank]["committed"]} if committed else None
        try:
            plan = plan_repair(old, valid, new, parity_valid=parity_valid, behind=behind, rebuilders=rebuilders)
        except ShardsLostError as error:
            state.stats.shards_lost += len(error.shards)
            raise
        keys = [str(key) for key in reference["keys"]]
        scalars = _decode_scalars(reference["scalars"])
        unit_rows = 1 + len(keys) if committed else int(reference["rows_before"])
        rebuilt = _rebuild(state, comm, old, plan, committed, unit_rows, keys)
        rows = _move(state, comm, old, new, plan, rebuilt, 1 + len(keys), masters_move=replayed)
        state.install(new, comm.rank, rows, keys, scalars)
        state.updates = newest
        changed = old.processes != new.processes or valid != {rank: rank for rank in range(new.processes)}
        if plan.rebuilt or changed:
            repaired = True
            state.stats.shards_rebuilt += len(plan.rebuilt)
            log.info("resharded %d -> %d processes, rebuilt shards %s", old.processes, new.processes, plan.rebuilt)
    if repaired:
        state.stats.repairs += 1
        state.stats.seconds += time.perf_counter() - started
    return replayed


def peer_info(raw: bytes, rank: int, state: ShardState) -> dict[str, Any]:
    """Process ``rank``'s published state, checked; :class:`CollectiveError` (a failed collective) if malformed."""

    def refuse(why: str) -> CollectiveError:
        return CollectiveError(f"process {rank}'s sharded-state record is malformed: {why}")

    if len(raw) > MAX_PEER_BYTES:
        raise refuse(f"{len(raw)} bytes, over {MAX_PEER_BYTES}")
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise refuse(f"not JSON ({error})") from None
    if not isinstance(info, dict) or set(info) != PEER_FIELDS:
        raise refuse(f"it must be an object with exactly the fields {sorted(PEER_FIELDS)}")
    if not isinstance(info["node"], str) or not 0 < len(info["node"]) <= _MAX_NAME:
        raise refuse(f"node must be a name of 1-{_MAX_NAME} characters")
    for name in ("committed", "parity_valid", "loaded"):
        if not isinstance(info[name], bool):
            raise refuse(f"{name} must be a bool")
    for name, least in (("rank", 0), ("updates", 0), ("rows_before", 1)):
        value = info[name]
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value < 1 << 62:
            raise refuse(f"{name} must be an int >= {least}")
    keys = info["keys"]
    if not isinstance(keys, list) or not all(isinstance(k, str) and 0 < len(k) <= _MAX_NAME for k in keys):
        raise refuse("keys must be a list of state names")
    own = state.keys()
    if own and keys and keys != own:
        raise refuse(f"its optimizer's keys {keys} are not this process's {own}")
    if info["rows_before"] > 1 + len(keys):
        raise refuse(f"rows_before {info['rows_before']} is more than 1 + its {len(keys)} keys")
    scalars = info["scalars"]
    if not isinstance(scalars, dict) or not all(_is_scalar(value) for value in scalars.values()):
        raise refuse("scalars must map names to finite numbers or [number, dtype]")
    if info["layout"] is not None:
        try:
            layout = layout_from(info["layout"]) if isinstance(info["layout"], dict) else None
        except ValueError as error:
            raise refuse(str(error)) from None
        if layout is None or layout.parameters != state.elements or not info["rank"] < layout.processes:
            raise refuse("its layout is not one of this job's state (another element count, or its rank outside it)")
    return info


def _is_scalar(value: Any) -> bool:
    """A finite number, or ``[finite number, dtype name]`` (a 0-d tensor's value and dtype)."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], str) and value[1] in _SCALAR_DTYPES:
        value = value[0]
    if isinstance(value, bool):
        return True
    return isinstance(value, int | float) and math.isfinite(value)


def _new_layout(state: ShardState, nodes: list[str]) -> ShardLayout:
    """The same redundancy over the new world; parity shrinks to fit a small world, nodes yield if they must.

    Parity ``(k, m)`` over ``N < k + m`` processes becomes ``(k', m')`` with
    ``m' = min(m, N - 1)`` and ``k' = min(k, N - m')`` (one process: no
    redundancy); the run's own ``(k, m)`` comes back when the world grows.
    """
    redundancy: Redundancy = state.redundancy
    processes = len(nodes)
    if isinstance(redundancy, Parity) and redundancy.k + redundancy.m > processes:
        if processes == 1:
            redundancy = Overlap(0.0)
        else:
            m = min(redundancy.m, processes - 1)
            redundancy = Parity(min(redundancy.k, processes - m), m)
        log.warning("%s shrinks to %s for %d processes", state.redundancy, redundancy, processes)
    try:
        return make_layout(redundancy, nodes, state.elements)
    except ValueError as error:
        log.warning("%s; placing without regard to nodes", error)
        return make_layout(redundancy, ["any"] * len(nodes), state.elements)


def _rebuild(
    state: ShardState,
    comm: Communicator,
    old: ShardLayout,
    plan: RepairPlan,
    committed: bool,
    rows: int,
    keys: list[str],
) -> dict[Range, torch.Tensor]:
    """Rebuild cells (one all-to-all of their units to the rebuilders): from parity, or from a copy behind.

    Before the update's sync ended anywhere (``committed`` false), a cell
    is rebuilt as it was before the update, from the old parity and the
    other cells' snapshots (or from a copy one update behind), and updated
    again with the kept gradient. Parity rebuilds a cell's state rows; its
    master is the rebuilder's parameters (the plan picks a rebuilder whose
    parameters are current).
    """
    if not plan.rebuilds:
        return {}
    code = None if old.parity is None else ParityCode(old.parity)
    unit_rows = rows if code is None else rows - 1  # parity holds no masters
    me, world = comm.rank, comm.world_size
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    local: dict[tuple[int, int], torch.Tensor] = {}
    receive_sizes = [0] * world
    for number, rebuild in enumerate(plan.rebuilds):
        for unit, sender in rebuild.units:
            if sender == me:
                data = _unit(state, old, rebuild, unit, committed)
                if rebuild.rebuilder == me:
                    local[(number, unit)] = data
                else:
                    send[rebuild.rebuilder].append(data)
            elif rebuild.rebuilder == me:
                receive_sizes[sender] += _unit_bytes(old, rebuild, unit, unit_rows)
    flat = [torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8) for chunks in send]
    received = comm.all_to_all(torch.cat(flat).to(comm.device), [chunk.numel() for chunk in flat], receive_sizes).cpu()
    offsets = [sum(receive_sizes[:rank]) for rank in range(world)]
    rebuilt: dict[Range, torch.Tensor] = {}
    for number, rebuild in enumerate(plan.rebuilds):
        if rebuild.rebuilder != me:
            continue
        units: dict[int, torch.Tensor] = {}
        for unit, sender in rebuild.units:
            if sender == me:
                units[unit] = local[(number, unit)]
            else:
                size = _unit_bytes(old, rebuild, unit, unit_rows)
                units[unit] = received[offsets[sender] : offsets[sender] + size]
                offsets[sender] += size
        length = rebuild.cell[1] - rebuild.cell[0]
        if code is None:
            cell = units[0].view(torch.float32).reshape(rows, length)
        else:
            lengths = [(end - start) * unit_rows * 4 for start, end in old.stripe_cells(rebuild.stripe)]
            state_rows = code.decode(units, lengths)[rebuild.unit].view(torch.float32).reshape(unit_rows, length)
            master = state.flat(state.locals, *rebuild.cell).cpu().reshape(1, length)
            cell = torch.cat([master, state_rows])
        if not committed:
            cell = _replay(state, cell, rebuild.cell, keys)
        rebuilt[rebuild.cell] = cell.to(state.device)
    return rebuilt


def _unit(state: ShardState, old: ShardLayout, rebuild: Rebuild, unit: int, committed: bool) -> torch.Tensor:
    """Unit ``unit`` of a rebuild as this process holds it: a data cell's state rows, a parity unit or a copy; bytes."""
    if old.parity is None:  # a copy held one update behind: this process's rows of that shard as they are
        return byte_view(state.rows(rebuild.stripe)).cpu()
    k = old.parity.k
    if unit >= k:
        parity = state.staged_parity if committed and state.staged_parity is not None else state.parity
        return parity[(rebuild.stripe, unit - k)].cpu()
    start, end = old.stripe_cells(rebuild.stripe)[unit]
    own_start = old.shard_ranges[state.rank][0]
    snapshot = None if committed or state.snapshot is None else state.snapshot.rows
    if snapshot is not None:
        return byte_view(snapshot[:, start - own_start : end - own_start].contiguous()).cpu()
    cell = state.row_buffer(state.rank, end - start, master=False)
    state.copy_columns(state.rank, start - own_start, end - own_start, cell, master=False)
    return byte_view(cell).cpu()


def _replay(state: ShardState, before: torch.Tensor, cell: Range, keys: list[str]) -> torch.Tensor:
    """A rebuilt cell's rows as they were before the update, updated again with the kept gradient.

    The cell is cut at parameter-group boundaries, each piece updated with its
    group's hyper-parameters as they were at the update.
    """
    assert state.snapshot is not None
    master = before[0].clone().to(state.device)
    previous = _snapshot_keys(state)
    pieces = [
        (group, low - cell[0], master[low - cell[0] : high - cell[0]]) for group, low, high in state.runs.pieces(*cell)
    ]
    replay, _ = state.optimizer([(group, view) for group, _, view in pieces], state.snapshot.hyperparameters)
    for _, offset, view in pieces:
        if previous:
            values = {key: before[1 + i][offset : offset + view.numel()].clone() for i, key in enumerate(previous)}
            replay.state[view] = values | clone(state.snapshot.scalars)
        view.grad = state.flat_gradients((cell[0] + offset, cell[0] + offset + view.numel()))
    replay.step()
    per_key = [torch.cat([replay.state[view][key].reshape(-1) for _, _, view in pieces]) for key in keys]
    return torch.stack([master.detach(), *per_key])


def _snapshot_keys(state: ShardState) -> list[str]:
    """The per-element state keys before the update not yet synced: none before the optimizer's first step."""
    assert state.snapshot is not None
    return state.keys() if state.updates > 1 else []


def _move(
    state: ShardState,
    comm: Communicator,
    old: ShardLayout,
    new: ShardLayout,
    plan: RepairPlan,
    rebuilt: dict[Range, torch.Tensor],
    rows: int,
    *,
    masters_move: bool,
) -> dict[int, torch.Tensor]:
    """Every element range to its new holders (one all-to-all); the rows of this process's new shards.

    Each range is copied once on its way: from the held state (or a rebuilt
    cell) straight into the new shard when it stays here, else into its
    place in the send buffer, and from the receive buffer into the new shard.
    Without ``masters_move`` (every process committed the last update, so
    its parameters are the masters) only the state rows travel and each new
    shard's master is read from this process's parameters.
    """
    me, world = comm.rank, comm.world_size
    device = state.device
    first = 0 if masters_move else 1  # the first row that travels
    moved = rows - first
    result = {
        s: torch.empty(rows, end - start, device=device)
        for s in new.held_shards(me)
        for start, end in [new.shard_ranges[s]]
    }
    send_sizes, receive_sizes = [0] * world, [0] * world
    for move in plan.moves:
        size = moved * (move.elements[1] - move.elements[0])
        if move.source == me and move.target != me:
            send_sizes[move.target] += size
        elif move.target == me and move.source != me:
            receive_sizes[move.source] += size
    send = torch.empty(sum(send_sizes), device=device)
    send_offsets = [sum(send_sizes[:rank]) for rank in range(world)]
    for move in plan.moves:
        if move.source != me:
            continue
        length = move.elements[1] - move.elements[0]
        if move.target == me:
            out = _new_columns(result, new, move.elements)[first:]
        else:
            offset = send_offsets[move.target]
            out = send[offset : offset + moved * length].view(moved, length)
            send_offsets[move.target] += moved * length
        _copy_old_range(state, old, move.elements, rebuilt, out, first)
    received = comm.all_to_all(send.to(comm.device), send_sizes, receive_sizes).to(device)
    offsets = [sum(receive_sizes[:rank]) for rank in range(world)]
    for move in plan.moves:
        if move.target != me or move.source == me:
            continue
        length = move.elements[1] - move.elements[0]
        chunk = received[offsets[move.source] : offsets[move.source] + moved * length]
        offsets[move.source] += moved * length
        _new_columns(result, new, move.elements)[first:].copy_(chunk.view(moved, length))
    if not masters_move:
        for shard, held in result.items():
            held[0].copy_(state.flat(state.locals, *new.shard_ranges[shard]))
    return result


def _new_columns(result: dict[int, torch.Tensor], new: ShardLayout, elements: Range) -> torch.Tensor:
    """The columns of ``elements`` in the new shard of ``result`` that holds them (a view)."""
    shard = next(s for s in result if new.shard_ranges[s][0] <= elements[0] < new.shard_ranges[s][1])
    start = elements[0] - new.shard_ranges[shard][0]
    return result[shard][:, start : start + elements[1] - elements[0]]


def _copy_old_range(
    state: ShardState,
    old: ShardLayout,
    elements: Range,
    rebuilt: dict[Range, torch.Tensor],
    out: torch.Tensor,
    first: int,
) -> None:
    """Rows ``first..`` of ``elements`` into ``out``: from a shard held in the old layout, or a cell rebuilt here."""
    for shard in state.masters:
        start, end = old.shard_ranges[shard]
        if start <= elements[0] and elements[1] <= end:
            state.copy_columns(shard, elements[0] - start, elements[1] - start, out, master=first == 0)
            return
    for (start, end), rows in rebuilt.items():
        if start <= elements[0] and elements[1] <= end:
            out.copy_(rows[first:, elements[0] - start : elements[1] - start])
            return
    raise AssertionError(f"elements {elements} are neither held nor rebuilt here")


def _unit_bytes(layout: ShardLayout, rebuild: Rebuild, unit: int, rows: int) -> int:
    """Bytes of a rebuild's unit of ``rows`` rows: a copy or data cell, or parity (its stripe's longest cell's)."""
    if layout.parity is None:
        return rows * (rebuild.cell[1] - rebuild.cell[0]) * 4
    cells = layout.stripe_cells(rebuild.stripe)
    length = cells[unit][1] - cells[unit][0] if unit < len(cells) else layout.unit_length(rebuild.stripe)
    return rows * length * 4


def _encode_scalars(scalars: dict[str, Any]) -> dict[str, Any]:
    """Scalar state as JSON: tensors as ``[value, dtype]``, numbers as they are."""
    return {
        key: [value.item(), str(value.dtype).removeprefix("torch.")] if isinstance(value, torch.Tensor) else value
        for key, value in scalars.items()
    }


def _decode_scalars(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        key: torch.tensor(value[0], dtype=getattr(torch, value[1])) if isinstance(value, list) else value
        for key, value in raw.items()
    }
