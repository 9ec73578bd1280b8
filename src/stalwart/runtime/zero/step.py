"""Sharded optimizer state with partial redundancy (ZeRO stage 1), kept current by computation, repaired in memory.

The model's parameters and gradients stay whole on every process (or, for a
replica group that shards with FSDP2, each process's local shard is the
"whole" that the processes holding the same shard in the other groups split
among themselves: HSDP's replicate dimension becomes a partial one). The
optimizer's state and an fp32 master of the parameters are one flat run of
elements, cut into one shard per process of the quorum
(:mod:`stalwart.redundancy.layout`); each process runs the user's optimizer
(its class and hyper-parameters) on the shards it holds:

- **overlap**: a process holds its own shard and the shards it copies; every
  holder applies the same deterministic update to the same reduced gradient,
  so copies stay bitwise equal to their primary without sending state (the
  check after every step compares checksums);
- **parity** ``(k, m)``: a process holds its own shard and parity units; after
  each update the data cells go to their stripe's parity holders, which
  re-encode (XOR for ``m = 1``, Reed-Solomon for ``m >= 2``).

A step is: the gradients are all-reduced (the Manager's bucketed path: every
process keeps the whole mean gradient), :meth:`ShardedOptimizer.update`
updates the held shards locally (no collective), the Manager commits the
step, and :meth:`ShardedOptimizer.sync` all-gathers the updated parameters
from the primaries, re-encodes parity and checks the copies. A failure during
``sync`` leaves every survivor with its updated shards; a parity process
keeps its shard as it was before the update (and the gradient) until ``sync``
ends, so a lost cell is rebuilt from the old parity and updated again.

Whenever the quorum changes, :meth:`ShardedOptimizer.reshard` rebuilds the
shards of the dead from copies or parity, moves every element range to its
holder in the new world (one all-to-all), and syncs; a joining process gets
its shards the same way, with no disk round-trip. More failures than the
redundancy covers raise :class:`~stalwart.redundancy.layout.ShardsLostError`
naming the shards.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from stalwart.runtime.comm import Communicator
from stalwart.runtime.sharding import local_tensor

log = logging.getLogger(__name__)

PER_ELEMENT_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose state and update are per element, so a shard's update is the whole update's slice."""


class CopyMismatchError(RuntimeError):
    """A copy of a shard differs from its primary after a step: the update is not deterministic."""


@dataclass
class RepairStats:
    """Reshards after a change of the quorum (not the first): how many, their seconds, the shards rebuilt and lost."""

    repairs: int = 0
    seconds: float = 0.0
    shards_rebuilt: int = 0
    shards_lost: int = 0


@dataclass
class _Snapshot:
    """The scalar state and hyper-parameters before the update not yet synced; with parity, this shard's rows too."""

    scalars: dict[str, Any]
    hyperparameters: dict[str, Any]
    rows: torch.Tensor | None


class ShardedOptimizer:
    """The state of ``template``'s optimizer over ``params``, sharded over the quorum with ``redundancy``.

    ``template`` is the user's optimizer (SGD, Adam or AdamW over exactly
    ``params``, one parameter group): its class and its group's
    hyper-parameters (read at every update, so LR schedulers work) define
    the update; its own state stays empty. ``node`` labels this process's
    machine: copies and parity go to other nodes where possible.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], template: torch.optim.Optimizer, redundancy: Redundancy, *, node: str
    ) -> None:
        if type(template) not in PER_ELEMENT_OPTIMIZERS:
            names = ", ".join(cls.__name__ for cls in PER_ELEMENT_OPTIMIZERS)
            raise TypeError(
                f"optimizer must be one whose state is per element ({names}) to be sharded, got "
                f"{type(template).__name__}"
            )
        if len(template.param_groups) != 1:
            raise ValueError(
                f"a sharded optimizer takes one parameter group, got {len(template.param_groups)}: build the optimizer "
                "over model.parameters()"
            )
        if [id(p) for p in template.param_groups[0]["params"]] != [id(p) for p in params]:
            raise ValueError(
                "the optimizer must hold exactly the model's trainable parameters, in order, to be sharded"
            )
        for param in params:
            if param.dtype != torch.float32:
                raise TypeError(f"a sharded optimizer needs fp32 parameters, got {param.dtype}")
        self._locals = [local_tensor(param) for param in params]
        """What this process holds of each parameter: the parameter, or an FSDP2 DTensor's local shard."""
        if not isinstance(node, str) or not node:
            raise ValueError(f"node must be a non-empty string, got {node!r}")
        self._params = list(params)
        self._template = template
        self.redundancy = redundancy
        self.node = node
        self.parameters = sum(local.numel() for local in self._locals)
        self.layout: ShardLayout | None = None
        self.rank = 0
        self.stats = RepairStats()
        self._masters: dict[int, torch.Tensor] = {}
        self._inner: torch.optim.Optimizer | None = None
        self._parity: dict[tuple[int, int], torch.Tensor] = {}
        self._staged_parity: dict[tuple[int, int], torch.Tensor] | None = None
        self._parity_valid = False
        self._snapshot: _Snapshot | None = None
        self._updates = 0
        self._pending = False
        self._committed = True

    # --- the step ------------------------------------------------------------------------------------

    def update(self) -> None:
        """Apply the optimizer to the held shards with the parameters' (reduced, mean) gradients: local."""
        assert self._inner is not None and self.layout is not None
        hyperparameters = self._hyperparameters()
        self._inner.param_groups[0].update(hyperparameters)
        rows = self._rows(self.rank).clone() if self.layout.parity is not None else None
        self._snapshot = _Snapshot(_clone(self._scalars()), hyperparameters, rows)
        for shard, master in self._masters.items():
            master.grad = self._flat_grads(self.layout.shard_ranges[shard])
        self._inner.step()
        for master in self._masters.values():
            master.grad = None
        self._updates += 1
        self._pending, self._committed = True, False

    def sync(
        self,
        comm: Communicator,
        notify: Callable[[str], None] = lambda _event: None,
        *,
        check: bool = True,
        gather: bool = True,
    ) -> None:
        """All-gather the parameters from the primaries, re-encode parity, check copies, commit (collectives).

        ``notify`` is told ``gather_started`` and (parity) ``parity_started``.
        ``check``: compare every copy's checksum with its primary's (the
        all-gather that ends ``sync`` runs either way). ``gather``: false when
        every process's parameters are its masters already (after a reshard
        that updated nothing).
        """
        layout = self.layout
        assert layout is not None
        notify("gather_started")
        if gather:
            self._gather_parameters(comm, layout)
        if layout.parity is not None:
            notify("parity_started")
            self._staged_parity = self._encode(comm)
        self._check_copies(comm, check=check)
        if self._staged_parity is not None:
            self._parity, self._staged_parity = self._staged_parity, None
            self._parity_valid = True
        self._snapshot = None
        if self._pending:
            for param in self._params:
                param.grad = None
        self._pending, self._committed = False, True

    def _gather_parameters(self, comm: Communicator, layout: ShardLayout) -> None:
        """Every process's parameters from the primaries' masters (one all-gather)."""
        longest = max(end - start for start, end in layout.shard_ranges)
        mine = torch.zeros(longest, device=comm.device)
        own = self._masters[self.rank]
        mine[: own.numel()] = own.detach()
        gathered = comm.all_gather(mine).to(self._locals[0].device)
        pieces = [
            gathered[s * longest : s * longest + end - start] for s, (start, end) in enumerate(layout.shard_ranges)
        ]
        flat = torch.cat(pieces)
        with torch.no_grad():
            offset = 0
            for local in self._locals:
                local.copy_(flat[offset : offset + local.numel()].view_as(local))
                offset += local.numel()

    @property
    def updates(self) -> int:
        """Updates the held state has had: after a reshard, the newest of the quorum's."""
        return self._updates

    @property
    def state_bytes(self) -> int:
        """Bytes of sharded state this process holds: masters and optimizer state of its shards, parity units."""
        held = sum(self._rows_numel(shard) for shard in self._masters) * 4
        return held + sum(unit.numel() for unit in self._parity.values())

    def held_rows(self) -> dict[int, torch.Tensor]:
        """Each held shard's rows (master, then the per-element state in key order), for checks and reports."""
        return {shard: self._rows(shard) for shard in self._masters}

    def gather_state(self, comm: Communicator, to_rank: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state, as ``template.state_dict()`` would give it, on ``to_rank`` (collective).

        Every primary sends its shard to ``to_rank`` (one all-to-all); other
        ranks get None. The masters are the parameters, so they are not sent.
        """
        layout = self.layout
        assert layout is not None
        keys, rows = self._keys(), 1 + len(self._keys())
        own = self._rows(self.rank)[1:].reshape(-1)
        send_sizes = [own.numel() if rank == to_rank else 0 for rank in range(comm.world_size)]
        lengths = [end - start for start, end in layout.shard_ranges]
        receive_sizes = [(rows - 1) * n if comm.rank == to_rank else 0 for n in lengths]
        received = comm.all_to_all(own.to(comm.device), send_sizes, receive_sizes).to(self._locals[0].device)
        if comm.rank != to_rank:
            return None
        offsets = [sum(receive_sizes[:shard]) for shard in range(len(lengths))]
        whole = torch.cat(
            [received[o : o + (rows - 1) * n].reshape(rows - 1, n) for o, n in zip(offsets, lengths, strict=True)],
            dim=1,
        )
        state: dict[int, dict[str, Any]] = {}
        offset = 0
        for index, param in enumerate(self._params):
            if keys:
                values = {
                    key: whole[i, offset : offset + param.numel()].view_as(param).clone() for i, key in enumerate(keys)
                }
                state[index] = values | _clone(self._scalars())
            offset += param.numel()
        return {"state": state, "param_groups": self._template.state_dict()["param_groups"]}

    # --- repair and reshard --------------------------------------------------------------------------

    def reshard(self, comm: Communicator, applied_step: int) -> None:
        """Give every process of the new quorum its shards: rebuild the dead's, move ranges, sync.

        Every process of the quorum calls it after the quorum's heal, at the
        job's ``applied_step`` (joining processes hold nothing yet). Raises
        :class:`~stalwart.redundancy.layout.ShardsLostError` when more
        processes failed than the redundancy covers.
        """
        started = time.perf_counter()
        repaired = False
        replayed = True
        info = {
            "node": self.node,
            "layout": None if self.layout is None else self.layout.describe(),
            "rank": self.rank,
            "updates": self._updates,
            "committed": self._committed,
            "parity_valid": self._parity_valid,
            "keys": self._keys(),
            "scalars": _encode_scalars(self._scalars()),
            "rows_before": len(self._keys()) + 1 if self._snapshot is None else len(self._snapshot_keys()) + 1,
            "loaded": bool(self._template.state),
        }
        comm.publish(f"zero/{comm.rank}", json.dumps(info))
        infos = [json.loads(comm.read(f"zero/{rank}")) for rank in range(comm.world_size)]
        nodes = [str(peer["node"]) for peer in infos]
        holding = [peer for peer in infos if peer["layout"] is not None]
        # The job's first layout must fit as configured (a bad choice is an error before training); later ones adapt.
        first = not holding and applied_step == 0
        new = make_layout(self.redundancy, nodes, self.parameters) if first else self._new_layout(nodes)
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
            keys, scalars = self._loaded_keys()
            rows = {s: self._fresh_rows(new, s, keys) for s in new.held_shards(comm.rank)}
            self._template.state.clear()  # a checkpoint's whole state, loaded into the user's optimizer: sharded now
            self._install(new, comm.rank, rows, keys, scalars)
            self._updates = applied_step
        else:
            old = layout_from(reference["layout"])
            parity_valid = {int(peer["rank"]) for peer in infos if peer["parity_valid"]} & set(valid)
            committed = any(infos[rank]["committed"] for rank in valid.values())
            # Before the update's sync ended anywhere, a process that missed the update (it did not see the
            # gradient's reduction end) holds the state as it was before it: usable, once updated again.
            behind = {} if committed else {int(p["rank"]): rank for rank, p in same if int(p["updates"]) == newest - 1}
            stale = [
                rank for rank, peer in enumerate(infos) if peer["layout"] is not None and rank not in valid.values()
            ]
            replayed = bool(behind or stale) or not all(peer["committed"] for peer in infos)
            try:
                plan = plan_repair(old, valid, new, parity_valid=parity_valid, behind=behind)
            except ShardsLostError as error:
                self.stats.shards_lost += len(error.shards)
                raise
            keys = [str(key) for key in reference["keys"]]
            scalars = _decode_scalars(reference["scalars"])
            unit_rows = 1 + len(keys) if committed else int(reference["rows_before"])
            rebuilt = self._rebuild(comm, old, plan, committed, unit_rows, keys)
            rows = self._move(comm, old, new, plan, rebuilt, 1 + len(keys))
            self._install(new, comm.rank, rows, keys, scalars)
            self._updates = newest
            changed = old.processes != new.processes or valid != {rank: rank for rank in range(new.processes)}
            if plan.rebuilt or changed:
                repaired = True
                self.stats.shards_rebuilt += len(plan.rebuilt)
                log.info("resharded %d -> %d processes, rebuilt shards %s", old.processes, new.processes, plan.rebuilt)
        # Copies were just copied from one source each: no checksums. The parameters are the masters already
        # unless some update was applied (again) here, or some process missed the last gather.
        self.sync(comm, check=False, gather=replayed)
        if repaired:
            self.stats.repairs += 1
            self.stats.seconds += time.perf_counter() - started

    def _new_layout(self, nodes: list[str]) -> ShardLayout:
        """The same redundancy over the new world; parity shrinks to fit a small world, nodes yield if they must.

        Parity ``(k, m)`` over ``N < k + m`` processes becomes ``(k', m')`` with
        ``m' = min(m, N - 1)`` and ``k' = min(k, N - m')`` (one process: no
        redundancy); the run's own ``(k, m)`` comes back when the world grows.
        """
        redundancy: Redundancy = self.redundancy
        processes = len(nodes)
        if isinstance(redundancy, Parity) and redundancy.k + redundancy.m > processes:
            if processes == 1:
                redundancy = Overlap(0.0)
            else:
                m = min(redundancy.m, processes - 1)
                redundancy = Parity(min(redundancy.k, processes - m), m)
            log.warning("%s shrinks to %s for %d processes", self.redundancy, redundancy, processes)
        try:
            return make_layout(redundancy, nodes, self.parameters)
        except ValueError as error:
            log.warning("%s; placing without regard to nodes", error)
            return make_layout(redundancy, ["any"] * len(nodes), self.parameters)

    def _rebuild(
        self, comm: Communicator, old: ShardLayout, plan: RepairPlan, committed: bool, rows: int, keys: list[str]
    ) -> dict[Range, torch.Tensor]:
        """Rebuild cells (one all-to-all of their units to the rebuilders): from parity, or from a copy behind.

        Before the update's sync ended anywhere (``committed`` false), a cell
        is rebuilt as it was before the update, from the old parity and the
        other cells' snapshots (or from a copy one update behind), and updated
        again with the kept gradient.
        """
        if not plan.rebuilds:
            return {}
        code = None if old.parity is None else ParityCode(old.parity)
        me, world = comm.rank, comm.world_size
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        local: dict[tuple[int, int], torch.Tensor] = {}
        receive_sizes = [0] * world
        for number, rebuild in enumerate(plan.rebuilds):
            for unit, sender in rebuild.units:
                if sender == me:
                    data = self._unit(old, rebuild, unit, committed)
                    if rebuild.rebuilder == me:
                        local[(number, unit)] = data
                    else:
                        send[rebuild.rebuilder].append(data)
                elif rebuild.rebuilder == me:
                    receive_sizes[sender] += _unit_bytes(old, rebuild, unit, rows)
        flat = [torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8) for chunks in send]
        received = comm.all_to_all(
            torch.cat(flat).to(comm.device), [chunk.numel() for chunk in flat], receive_sizes
        ).cpu()
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
                    size = _unit_bytes(old, rebuild, unit, rows)
                    units[unit] = received[offsets[sender] : offsets[sender] + size]
                    offsets[sender] += size
            if code is None:
                data = units[0]
            else:
                lengths = [(end - start) * rows * 4 for start, end in old.stripe_cells(rebuild.stripe)]
                data = code.decode(units, lengths)[rebuild.unit]
            cell = data.view(torch.float32).reshape(rows, rebuild.cell[1] - rebuild.cell[0])
            if not committed:
                cell = self._replay(cell, rebuild.cell, keys)
            rebuilt[rebuild.cell] = cell.to(self._locals[0].device)
        return rebuilt

    def _unit(self, old: ShardLayout, rebuild: Rebuild, unit: int, committed: bool) -> torch.Tensor:
        """Unit ``unit`` of a rebuild as this process holds it: a data cell's rows, a parity unit or a copy; bytes."""
        if old.parity is None:  # a copy held one update behind: this process's rows of that shard as they are
            return byte_view(self._rows(rebuild.stripe)).cpu()
        k = old.parity.k
        if unit >= k:
            parity = self._staged_parity if committed and self._staged_parity is not None else self._parity
            return parity[(rebuild.stripe, unit - k)].cpu()
        start, end = old.stripe_cells(rebuild.stripe)[unit]
        own_start = old.shard_ranges[self.rank][0]
        snapshot = None if committed or self._snapshot is None else self._snapshot.rows
        source = self._rows(self.rank) if snapshot is None else snapshot
        return byte_view(source[:, start - own_start : end - own_start].contiguous()).cpu()

    def _replay(self, before: torch.Tensor, cell: Range, keys: list[str]) -> torch.Tensor:
        """A rebuilt cell's rows as they were before the update, updated again with the kept gradient."""
        assert self._snapshot is not None
        master = before[0].clone().to(self._locals[0].device)
        replay = self._optimizer([master], self._snapshot.hyperparameters)
        previous = [key for key in self._snapshot_keys()]
        if previous:
            replay.state[master] = {key: before[1 + i].clone() for i, key in enumerate(previous)} | _clone(
                self._snapshot.scalars
            )
        master.grad = self._flat_grads(cell)
        replay.step()
        state = replay.state[master]
        return torch.stack([master.detach(), *(state[key] for key in keys)])

    def _snapshot_keys(self) -> list[str]:
        """The per-element state keys before the update not yet synced: none before the optimizer's first step."""
        assert self._snapshot is not None
        return self._keys() if self._updates > 1 else []

    def _move(
        self,
        comm: Communicator,
        old: ShardLayout,
        new: ShardLayout,
        plan: RepairPlan,
        rebuilt: dict[Range, torch.Tensor],
        rows: int,
    ) -> dict[int, torch.Tensor]:
        """Every element range to its new holders (one all-to-all); the rows of this process's new shards."""
        me, world = comm.rank, comm.world_size
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        receive_sizes = [0] * world
        local: list[torch.Tensor] = []
        for move in plan.moves:
            length = move.elements[1] - move.elements[0]
            if move.source == me:
                chunk = self._old_range(old, move.elements, rebuilt).reshape(-1)
                (local if move.target == me else send[move.target]).append(chunk)
            elif move.target == me:
                receive_sizes[move.source] += rows * length
        device = self._locals[0].device
        flat = [torch.cat(chunks) if chunks else torch.zeros(0, device=device) for chunks in send]
        received = comm.all_to_all(torch.cat(flat).to(comm.device), [c.numel() for c in flat], receive_sizes)
        received = received.to(device)
        offsets = [sum(receive_sizes[:rank]) for rank in range(world)]
        result = {
            s: torch.empty(rows, end - start, device=device)
            for s in new.held_shards(me)
            for start, end in [new.shard_ranges[s]]
        }
        own = iter(local)
        for move in plan.moves:
            if move.target != me:
                continue
            length = move.elements[1] - move.elements[0]
            if move.source == me:
                chunk = next(own)
            else:
                chunk = received[offsets[move.source] : offsets[move.source] + rows * length]
                offsets[move.source] += rows * length
            shard = next(s for s in result if new.shard_ranges[s][0] <= move.elements[0] < new.shard_ranges[s][1])
            start = move.elements[0] - new.shard_ranges[shard][0]
            result[shard][:, start : start + length] = chunk.reshape(rows, length)
        return result

    def _old_range(self, old: ShardLayout, elements: Range, rebuilt: dict[Range, torch.Tensor]) -> torch.Tensor:
        """Rows of ``elements`` from a shard this process holds in the old layout, or from a cell it rebuilt."""
        for shard in self._masters:
            start, end = old.shard_ranges[shard]
            if start <= elements[0] and elements[1] <= end:
                return self._rows(shard)[:, elements[0] - start : elements[1] - start]
        for (start, end), rows in rebuilt.items():
            if start <= elements[0] and elements[1] <= end:
                return rows[:, elements[0] - start : elements[1] - start]
        raise AssertionError(f"elements {elements} are neither held nor rebuilt here")

    def _install(
        self, layout: ShardLayout, rank: int, rows: dict[int, torch.Tensor], keys: list[str], scalars: dict[str, Any]
    ) -> None:
        """Hold ``rows`` (per shard: master, then state ``keys``) under ``layout`` as process ``rank``."""
        self.layout, self.rank = layout, rank
        self._masters = {shard: rows[shard][0].clone() for shard in layout.held_shards(rank)}
        self._inner = self._optimizer(list(self._masters.values()), self._hyperparameters())
        for shard, master in self._masters.items():
            if keys:
                state = {key: rows[shard][1 + i].clone() for i, key in enumerate(keys)}
                self._inner.state[master] = state | _clone(scalars)
        self._parity, self._staged_parity, self._parity_valid = {}, None, False
        self._snapshot = None

    def _fresh_rows(self, layout: ShardLayout, shard: int, keys: list[str]) -> torch.Tensor:
        """A shard from the parameters (its master) and the state loaded into the user's optimizer (``keys``)."""
        start, end = layout.shard_ranges[shard]
        state = self._template.state
        tensors = [self._locals, *([local_tensor(state[p][key]) for p in self._params] for key in keys)]
        return torch.stack([self._flat(row, start, end).detach().clone() for row in tensors])

    def _loaded_keys(self) -> tuple[list[str], dict[str, Any]]:
        """The per-element keys and the scalar state of a whole state loaded into the user's optimizer (none: fresh)."""
        state = self._template.state.get(self._params[0], {})
        keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == self._params[0].shape)
        return keys, {k: v for k, v in state.items() if k not in keys}

    # --- parity and checks ---------------------------------------------------------------------------

    def _encode(self, comm: Communicator) -> dict[tuple[int, int], torch.Tensor]:
        """Send the data cells to their stripes' parity holders (one all-to-all); encode the units held here."""
        layout = self.layout
        assert layout is not None and layout.parity is not None
        rows = 1 + len(self._keys())
        me, world = comm.rank, comm.world_size
        stripes = layout.placement.stripes
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        receive_sizes = [0] * world
        own_start = layout.shard_ranges[me][0]
        own_rows = self._rows(me)
        for stripe in stripes:
            for cell in stripe.cells:
                start, end = layout.cell_ranges[cell.shard][cell.index]
                if cell.shard == me:
                    data = own_rows[:, start - own_start : end - own_start].reshape(-1)
                    for holder in stripe.redundant:
                        send[holder].append(data)
                elif me in stripe.redundant:
                    receive_sizes[cell.shard] += rows * (end - start)
        device = self._locals[0].device
        flat = [torch.cat(chunks) if chunks else torch.zeros(0, device=device) for chunks in send]
        received = comm.all_to_all(torch.cat(flat).to(comm.device), [c.numel() for c in flat], receive_sizes)
        offsets = [sum(receive_sizes[:rank]) for rank in range(world)]
        code = ParityCode(layout.parity)
        units: dict[tuple[int, int], torch.Tensor] = {}
        for number, stripe in enumerate(stripes):
            if me not in stripe.redundant:
                continue
            cells = []
            for cell in stripe.cells:
                start, end = layout.cell_ranges[cell.shard][cell.index]
                size = rows * (end - start)
                cells.append(byte_view(received[offsets[cell.shard] : offsets[cell.shard] + size].contiguous()))
                offsets[cell.shard] += size
            parity = code.encode(cells)
            units[(number, stripe.redundant.index(me))] = parity[stripe.redundant.index(me)]
        return units

    def _check_copies(self, comm: Communicator, *, check: bool) -> None:
        """Every holder of a shard has bitwise the same rows (checksums all-gathered; the gather also ends ``sync``).

        Without copies (parity, overlap 0) or without ``check``, only the
        all-gather runs: after it, every process has passed the parity
        exchange, which is what a reshard relies on.
        """
        layout = self.layout
        assert layout is not None
        world = layout.processes
        sums = torch.zeros(world, 3, dtype=torch.int64)
        if check and len(self._masters) > 1:
            for shard in self._masters:
                sums[shard] = torch.tensor([1, *_checksum(self._rows(shard))])
        table = comm.all_gather(sums.to(comm.device)).cpu().reshape(world, world, 3)
        for shard in range(world):
            holders = [p for p in range(world) if table[p, shard, 0]]
            differ = [p for p in holders if not torch.equal(table[p, shard], table[shard, shard])]
            if differ:
                raise CopyMismatchError(
                    f"the copies of shard {shard} on processes {differ} differ from its primary's after "
                    f"{self._updates} updates: is the optimizer's update deterministic?"
                )

    # --- rows of the state ---------------------------------------------------------------------------

    def _rows(self, shard: int) -> torch.Tensor:
        """Shard ``shard``'s rows: the master, then each per-element state tensor in key order (a copy)."""
        master = self._masters[shard]
        state = self._inner.state.get(master, {}) if self._inner is not None else {}
        return torch.stack([master.detach(), *(state[key] for key in self._keys())])

    def _rows_numel(self, shard: int) -> int:
        return (1 + len(self._keys())) * self._masters[shard].numel()

    def _keys(self) -> list[str]:
        """The optimizer's per-element state keys (none before the first update)."""
        if self._inner is None or not self._masters:
            return []
        master = next(iter(self._masters.values()))
        state = self._inner.state.get(master, {})
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape)

    def _scalars(self) -> dict[str, Any]:
        """The optimizer's other state (Adam's step count), the same for every shard."""
        if self._inner is None or not self._masters:
            return {}
        master = next(iter(self._masters.values()))
        keys = set(self._keys())
        return {k: v for k, v in self._inner.state.get(master, {}).items() if k not in keys}

    def _optimizer(self, masters: list[torch.Tensor], hyperparameters: dict[str, Any]) -> torch.optim.Optimizer:
        """The template's optimizer class over ``masters``, its group set to ``hyperparameters``."""
        optimizer: torch.optim.Optimizer = type(self._template)(masters, lr=self._template.defaults["lr"])  # type: ignore[call-arg]
        optimizer.param_groups[0].update(hyperparameters)
        return optimizer

    def _hyperparameters(self) -> dict[str, Any]:
        return {key: value for key, value in self._template.param_groups[0].items() if key != "params"}

    def _flat_grads(self, elements: Range) -> torch.Tensor:
        grads = [
            torch.zeros_like(local) if param.grad is None else local_tensor(param.grad)
            for param, local in zip(self._params, self._locals, strict=True)
        ]
        return self._flat(grads, *elements)

    def _flat(self, tensors: Sequence[torch.Tensor], start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the tensors read as one flat run."""
        pieces, offset = [], 0
        for tensor in tensors:
            low, high = max(start, offset), min(end, offset + tensor.numel())
            if low < high:
                pieces.append(tensor.detach().reshape(-1)[low - offset : high - offset])
            offset += tensor.numel()
        return torch.cat(pieces) if pieces else torch.zeros(0, device=self._locals[0].device)


def _unit_bytes(layout: ShardLayout, rebuild: Rebuild, unit: int, rows: int) -> int:
    """Bytes of a rebuild's unit: a copy's or data cell's rows, or a parity unit (its stripe's longest cell's)."""
    if layout.parity is None:
        return rows * (rebuild.cell[1] - rebuild.cell[0]) * 4
    cells = layout.stripe_cells(rebuild.stripe)
    length = cells[unit][1] - cells[unit][0] if unit < len(cells) else layout.unit_length(rebuild.stripe)
    return rows * length * 4


def _checksum(rows: torch.Tensor) -> tuple[int, int]:
    """Two integer sums of the rows' bit patterns: equal rows give equal sums; one flipped bit changes them."""
    bits = rows.detach().reshape(-1).view(torch.int32).cpu()
    total = square = 0
    for chunk in bits.split(1 << 20):
        wide = chunk.to(torch.int64)
        total += int(wide.sum())
        square += int((wide * wide).sum())
    return total % (1 << 62), square % (1 << 62)


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


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
