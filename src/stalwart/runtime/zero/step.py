"""The sharded step: update the held shards, re-encode parity, gather the parameters, check the copies.

A step is: the gradients are all-reduced (the Manager's bucketed path: every
process keeps the whole mean gradient), the user's ``optimizer.step()`` hands
them over (:meth:`ShardedOptimizer.take_gradients`) and
:meth:`ShardedOptimizer.update` updates the held shards locally (no
collective), each piece with its parameter group's hyper-parameters as they
are then; :meth:`ShardedOptimizer.sync` re-encodes parity, all-gathers the
updated parameters from the primaries and checks the copies. A failure during
``sync`` leaves every survivor with its updated shards; a parity process
keeps its shard's state rows as they were before the update (the master
then is its parameters; every process keeps the gradients) until ``sync``
ends, so a lost cell is rebuilt from the old parity and updated again
(:mod:`stalwart.runtime.zero.repair`). Parity covers the state rows only:
the masters are the parameters, which every process holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.errors import StalwartError
from stalwart.redundancy.config import Redundancy
from stalwart.redundancy.layout import ShardLayout
from stalwart.redundancy.parity import ParityCode, byte_view
from stalwart.runtime.comm import Communicator
from stalwart.runtime.events import Event, Notify
from stalwart.runtime.sharding import shaped_like
from stalwart.runtime.zero.repair import reshard
from stalwart.runtime.zero.state import RepairStats, ShardState, Snapshot, check_template, clone

log = logging.getLogger(__name__)


class CopyMismatchError(StalwartError, RuntimeError):
    """A copy of a shard differs from its primary after a step: the update is not deterministic."""


class ShardedOptimizer:
    """The state of ``template``'s optimizer over ``params``, sharded over the quorum with ``redundancy``.

    ``template`` is the user's optimizer (SGD, Adam or AdamW whose parameter
    groups hold exactly ``params``, in any number of groups): its class and
    its groups' hyper-parameters (read at every update, so LR schedulers
    work) define the update; its own state stays empty. ``node`` labels this
    process's machine: copies and parity go to other nodes where possible.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], template: torch.optim.Optimizer, redundancy: Redundancy, *, node: str
    ) -> None:
        ordered = check_template(template, params)
        if not isinstance(node, str) or not node:
            raise ValueError(f"node must be a non-empty string, got {node!r}")
        self.redundancy = redundancy
        self.node = node
        self.state = ShardState(ordered, template, redundancy, node)
        self._gather: GatherBuffers | None = None
        self._snapshot_rows: torch.Tensor | None = None
        self._encode_send: torch.Tensor | None = None
        self._encode_received: torch.Tensor | None = None

    @property
    def parameters(self) -> int:
        """Elements of the flat run the shards split."""
        return self.state.elements

    @property
    def layout(self) -> ShardLayout | None:
        return self.state.layout

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def stats(self) -> RepairStats:
        return self.state.stats

    @property
    def updates(self) -> int:
        """Updates the held state has had: after a reshard, the newest of the quorum's."""
        return self.state.updates

    @property
    def state_bytes(self) -> int:
        """Bytes of sharded state this process holds: masters and optimizer state of its shards, parity units."""
        return self.state.state_bytes

    def held_rows(self) -> dict[int, torch.Tensor]:
        """Each held shard's rows (master, then the per-element state in key order), for checks and reports."""
        return {shard: self.state.rows(shard) for shard in self.state.masters}

    # --- the step ------------------------------------------------------------------------------------

    def take_gradients(self) -> None:
        """Take the parameters' reduced gradients for the next :meth:`update` (``param.grad`` becomes None)."""
        self.state.take_gradients()

    def update(self) -> None:
        """Apply the optimizer to the held shards with the taken (reduced, mean) gradients: local."""
        state = self.state
        assert state.inner is not None and state.layout is not None
        hyperparameters = state.hyperparameters()
        state.set_hyperparameters(state.inner, state.inner_groups, hyperparameters)
        rows = None
        if state.layout.parity is not None:  # this shard's state rows before the update: a buffer kept across steps
            own = state.masters[state.rank].numel()
            kept = self._snapshot_rows
            if kept is None or kept.shape != (len(state.keys()), own):
                kept = self._snapshot_rows = state.row_buffer(state.rank, master=False)
            state.copy_columns(state.rank, 0, own, kept, master=False)
            rows = kept
        state.snapshot = Snapshot(clone(state.scalars()), hyperparameters, rows)
        for shard, views in state.views.items():
            start = state.layout.shard_ranges[shard][0]
            for _, offset, view in views:
                view.grad = state.flat_gradients((start + offset, start + offset + view.numel()))
        state.inner.step()
        for views in state.views.values():
            for _, _, view in views:
                view.grad = None
        state.updates += 1
        state.pending, state.committed = True, False

    def sync(
        self,
        comm: Communicator,
        notify: Notify = lambda _event: None,
        *,
        check: bool = True,
        gather: bool = True,
    ) -> None:
        """Re-encode parity, all-gather the parameters from the primaries, check copies, commit (collectives).

        ``notify`` is told (parity) ``parity_started``, then ``gather_started``.
        A process commits only after a collective that every process enters
        after its parity exchange (the gather, else the check's all-gather):
        one that committed shows every survivor's new parity staged.
        ``check``: compare every copy's checksum with its primary's (the
        all-gather that ends ``sync`` runs either way). ``gather``: false when
        every process's parameters are its masters already (after a reshard
        that updated nothing).
        """
        state = self.state
        layout = state.layout
        assert layout is not None
        if layout.parity is not None:
            notify(Event.PARITY_STARTED)
            state.staged_parity = self._encode(comm)
        notify(Event.GATHER_STARTED)
        if gather:
            self._gather_parameters(comm, layout)
        self._check_copies(comm, check=check, barrier=layout.parity is not None and not gather)
        if state.staged_parity is not None:
            state.parity, state.staged_parity = state.staged_parity, None
            state.parity_valid = True
        state.snapshot = None
        state.gradients = None
        state.pending, state.committed = False, True

    def reshard(self, comm: Communicator, applied_step: int) -> None:
        """Give every process of the new quorum its shards: rebuild the dead's, move ranges, sync.

        Every process of the quorum calls it after the quorum's heal, at the
        job's ``applied_step`` (joining processes hold nothing yet). Raises
        :class:`~stalwart.redundancy.layout.ShardsLostError` when more
        processes failed than the redundancy covers.
        """
        replayed = reshard(self.state, comm, applied_step)
        # Copies were just copied from one source each: no checksums. The parameters are the masters already
        # unless some update was applied (again) here, or some process missed the last gather.
        self.sync(comm, check=False, gather=replayed)

    def gather_state(self, comm: Communicator, to_rank: int | None = 0) -> dict[str, Any] | None:
        """The whole optimizer state, as ``template.state_dict()`` would give it, on ``to_rank`` (collective).

        ``to_rank`` None: on every rank. Other ranks get None. See :meth:`gather_moments`.
        """
        by_index = self.gather_moments(comm, to_rank)
        if by_index is None:
            return None
        return {"state": by_index, "param_groups": self.state.template.state_dict()["param_groups"]}

    def gather_moments(self, comm: Communicator, to_rank: int | None = 0) -> dict[int, dict[str, Any]] | None:
        """The whole optimizer state by parameter index (torch's ``state_dict()["state"]``) on ``to_rank`` (collective).

        ``to_rank`` None: on every rank (each primary sends its shard to every
        rank); other ranks get None. One all-to-all; the masters are the
        parameters, so they are not sent. A DTensor parameter's state comes as
        a DTensor of its layout (this process's FSDP2 shard of it), as the
        user's optimizer would hold it. Before the first update: ``{}``.
        """
        state = self.state
        layout = state.layout
        assert layout is not None
        keys, rows = state.keys(), 1 + len(state.keys())
        receives = to_rank is None or comm.rank == to_rank
        own = state.rows(state.rank)[1:].reshape(-1).to(comm.device)
        targets = range(comm.world_size) if to_rank is None else [to_rank]
        send_sizes = [own.numel() if to_rank is None or rank == to_rank else 0 for rank in range(comm.world_size)]
        lengths = [end - start for start, end in layout.shard_ranges]
        receive_sizes = [(rows - 1) * n if receives else 0 for n in lengths]
        send = own.repeat(len(targets)) if len(targets) > 1 else own
        received = comm.all_to_all(send, send_sizes, receive_sizes).to(state.device)
        if not receives:
            return None
        offsets = [sum(receive_sizes[:shard]) for shard in range(len(lengths))]
        whole = torch.cat(
            [received[o : o + (rows - 1) * n].reshape(rows - 1, n) for o, n in zip(offsets, lengths, strict=True)],
            dim=1,
        )
        by_index: dict[int, dict[str, Any]] = {}
        offset = 0
        for index, (param, local) in enumerate(zip(state.params, state.locals, strict=True)):
            if keys:
                values = {
                    key: shaped_like(whole[i, offset : offset + local.numel()].clone(), param)
                    for i, key in enumerate(keys)
                }
                by_index[index] = values | clone(state.scalars())
            offset += local.numel()
        return by_index

    def adopt_loaded(self) -> None:
        """Take this process's shards from a whole state just loaded into the user's optimizer (local).

        Every process loaded the same whole state (``optimizer.load_state_dict``
        of a :meth:`gather_moments`-made or a replicated run's dict): each
        keeps its held shards under the current layout, their masters from the
        parameters, and the user's optimizer is emptied again. Parity is
        re-encoded at the next update's sync.
        """
        state = self.state
        layout = state.layout
        assert layout is not None
        keys, scalars = state.loaded_keys()
        rows = {shard: state.fresh_rows(layout, shard, keys) for shard in layout.held_shards(state.rank)}
        state.template.state.clear()
        state.install(layout, state.rank, rows, keys, scalars)

    # --- collectives of the sync -----------------------------------------------------------------

    def _gather_parameters(self, comm: Communicator, layout: ShardLayout) -> None:
        """Every process's parameters from the primaries' masters (one all-gather into buffers kept per layout)."""
        state = self.state
        if self._gather is None or self._gather.layout is not layout or self._gather.device != comm.device:
            self._gather = GatherBuffers.make(layout, state.locals, comm.device)
        gather = self._gather
        if layout.replicated:  # every process updated every shard itself: nothing to gather
            longest = gather.send.numel()
            for shard, master in state.masters.items():
                gather.received[shard * longest : shard * longest + master.numel()].copy_(master.detach())
        else:
            own = state.masters[state.rank]
            gather.send[: own.numel()].copy_(own.detach())
            comm.all_gather(gather.send, gather.received)
        with torch.no_grad():
            for local, pieces in zip(state.locals, gather.pieces, strict=True):
                if local.is_contiguous():
                    flat, offset = local.view(-1), 0
                    for low, high in pieces:
                        flat[offset : offset + high - low].copy_(gather.received[low:high])
                        offset += high - low
                elif pieces:
                    local.copy_(torch.cat([gather.received[low:high] for low, high in pieces]).view_as(local))

    def _encode(self, comm: Communicator) -> dict[tuple[int, int], torch.Tensor]:
        """Send the data cells to their stripes' parity holders (one all-to-all); encode the units held here.

        A data cell is its per-element state rows, without the master: the
        masters are the parameters, which every process holds once the
        gather is done, so parity protects only what exists nowhere else
        (Adam: two rows of three, a third fewer bytes sent and encoded).
        """
        state = self.state
        layout = state.layout
        assert layout is not None and layout.parity is not None
        rows = len(state.keys())
        me, world = comm.rank, comm.world_size
        stripes = layout.placement.stripes
        sent: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # per holder: own cells' column ranges
        receive_sizes = [0] * world
        own_start = layout.shard_ranges[me][0]
        for stripe in stripes:
            for cell in stripe.cells:
                start, end = layout.cell_ranges[cell.shard][cell.index]
                if cell.shard == me:
                    for holder in stripe.redundant:
                        sent[holder].append((start - own_start, end - own_start))
                elif me in stripe.redundant:
                    receive_sizes[cell.shard] += rows * (end - start)
        send_sizes = [sum(rows * (high - low) for low, high in ranges) for ranges in sent]
        self._encode_send = send = _kept(self._encode_send, sum(send_sizes), comm.device)
        self._encode_received = received = _kept(self._encode_received, sum(receive_sizes), comm.device)
        offset = 0
        for ranges in sent:  # each cell as its rows x columns block, row-major, copied straight from the state
            for low, high in ranges:
                size = rows * (high - low)
                state.copy_columns(me, low, high, send[offset : offset + size].view(rows, high - low), master=False)
                offset += size
        comm.all_to_all(send, send_sizes, receive_sizes, out=received)
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

    def _check_copies(self, comm: Communicator, *, check: bool, barrier: bool) -> None:
        """Every holder of a shard has bitwise the same rows (checksums all-gathered).

        ``barrier``: run the all-gather even when there is nothing to compare
        (with parity and no parameter gather after the parity exchange, so
        that a commit still shows every process past it). Without copies or
        ``check``, and without ``barrier``, nothing runs.
        """
        state = self.state
        layout = state.layout
        assert layout is not None
        world = layout.processes
        copies = any(len(layout.holders(shard)) > 1 for shard in range(world))
        if not barrier and not (check and copies):
            return
        sums = torch.zeros(world, 3, dtype=torch.int64)
        if check and len(state.masters) > 1:
            for shard in state.masters:
                sums[shard] = torch.tensor([1, *_checksum(state.rows(shard))])
        table = comm.all_gather(sums.to(comm.device)).cpu().reshape(world, world, 3)
        for shard in range(world):
            holders = [p for p in range(world) if table[p, shard, 0]]
            differ = [p for p in holders if not torch.equal(table[p, shard], table[shard, shard])]
            if differ:
                raise CopyMismatchError(
                    f"the copies of shard {shard} on processes {differ} differ from its primary's after "
                    f"{state.updates} updates: is the optimizer's update deterministic?"
                )


@dataclass(frozen=True)
class GatherBuffers:
    """What one layout's parameter all-gather sends and receives, and where each parameter's elements arrive.

    Every shard is padded to the longest in ``received``; ``pieces[i]`` are
    the ``[low, high)`` ranges of ``received`` that hold local ``i``'s
    elements in order (one, unless it straddles shards).
    """

    layout: ShardLayout
    device: torch.device
    send: torch.Tensor
    received: torch.Tensor
    pieces: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def make(cls, layout: ShardLayout, locals_: Sequence[torch.Tensor], device: torch.device) -> GatherBuffers:
        longest = max(end - start for start, end in layout.shard_ranges)
        pieces, offset = [], 0
        for local in locals_:
            low, high = offset, offset + local.numel()
            pieces.append(
                tuple(
                    (shard * longest + max(low, start) - start, shard * longest + min(high, end) - start)
                    for shard, (start, end) in enumerate(layout.shard_ranges)
                    if max(low, start) < min(high, end)
                )
            )
            offset = high
        return cls(
            layout,
            device,
            torch.zeros(longest, device=device),
            torch.empty(longest * layout.processes, device=device),
            tuple(pieces),
        )


def _kept(buffer: torch.Tensor | None, size: int, device: torch.device) -> torch.Tensor:
    """``buffer`` when it has ``size`` fp32 elements on ``device``, else a new one (a step's sizes repeat)."""
    if buffer is None or buffer.numel() != size or buffer.device != device:
        return torch.empty(size, device=device)
    return buffer


def _checksum(rows: torch.Tensor) -> tuple[int, int]:
    """Two integer sums of the rows' bit patterns: equal rows give equal sums; one flipped bit changes them."""
    bits = rows.detach().reshape(-1).view(torch.int32).cpu()
    total = square = 0
    for chunk in bits.split(1 << 20):
        wide = chunk.to(torch.int64)
        total += int(wide.sum())
        square += int((wide * wide).sum())
    return total % (1 << 62), square % (1 << 62)
