"""What one process holds of the sharded optimizer state, and how its rows are read and written.

The flat run of elements is the optimizer's parameters in parameter-group
order (group 0's parameters, then group 1's, ...), so each group is one
contiguous run and a shard's range meets each group in at most one piece.
A held shard is one flat fp32 master; the inner optimizer (the user's
optimizer class) runs over *views* of the masters, one per piece, in inner
parameter groups that carry the user's groups' hyper-parameters. A shard's
*rows* are its master and then each per-element state tensor (Adam's
``exp_avg``, ...) in key order, its pieces joined: the unit that copies,
parity and moves work on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.redundancy.config import Redundancy
from stalwart.redundancy.layout import Range, ShardLayout
from stalwart.runtime.sharding import local_tensor

PER_ELEMENT_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose state and update are per element, so a shard's update is the whole update's slice."""


@dataclass
class RepairStats:
    """Reshards after a change of the quorum (not the first): how many, their seconds, the shards rebuilt and lost."""

    repairs: int = 0
    seconds: float = 0.0
    shards_rebuilt: int = 0
    shards_lost: int = 0


@dataclass
class Snapshot:
    """The scalar state and hyper-parameters before the update not yet synced; with parity, this shard's state rows.

    ``rows`` (parity) are the per-element state rows without the master: the
    master before the update is the parameters, which the update leaves alone
    until its gather.
    """

    scalars: dict[str, Any]
    hyperparameters: list[dict[str, Any]]
    rows: torch.Tensor | None


@dataclass(frozen=True)
class GroupRuns:
    """Where each parameter group's elements lie in the flat run: group ``g`` spans ``[bounds[g], bounds[g + 1])``."""

    bounds: tuple[int, ...]

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(group, low, high)`` pieces of ``[start, end)``, in order; an empty range gives one empty piece."""
        found = [
            (group, max(start, low), min(end, high))
            for group, (low, high) in enumerate(zip(self.bounds, self.bounds[1:], strict=False))
            if max(start, low) < min(end, high)
        ]
        if found:
            return found
        group = max(0, min(len(self.bounds) - 2, sum(1 for bound in self.bounds[1:-1] if bound <= start)))
        return [(group, start, start)]


def check_template(template: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The template's parameters in group order, checked to be exactly ``params`` (any order), fp32, per element."""
    if type(template) not in PER_ELEMENT_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in PER_ELEMENT_OPTIMIZERS)
        raise TypeError(
            f"optimizer must be one whose state is per element ({names}) to be sharded, got {type(template).__name__}"
        )
    ordered = [param for group in template.param_groups for param in group["params"]]
    if len({id(param) for param in ordered}) != len(ordered) or {id(p) for p in ordered} != {id(p) for p in params}:
        raise ValueError(
            f"the optimizer's parameter groups must hold exactly the model's {len(params)} trainable parameters, each "
            f"once, to be sharded; they hold {len(ordered)}"
        )
    for param in ordered:
        if param.dtype != torch.float32:
            raise TypeError(f"a sharded optimizer needs fp32 parameters, got {param.dtype}")
    return ordered


@dataclass
class ShardState:
    """The shards this process holds under ``layout`` as process ``rank``, with their inner optimizer."""

    params: list[torch.Tensor]
    """The optimizer's parameters in group order (the flat run's order)."""
    template: torch.optim.Optimizer
    redundancy: Redundancy
    node: str
    locals: list[torch.Tensor] = field(init=False)
    """What this process holds of each parameter: the parameter, or an FSDP2 DTensor's local shard."""
    runs: GroupRuns = field(init=False)
    layout: ShardLayout | None = None
    rank: int = 0
    masters: dict[int, torch.Tensor] = field(default_factory=dict)
    views: dict[int, list[tuple[int, int, torch.Tensor]]] = field(default_factory=dict)
    """Per held shard: ``(group, offset in the shard, view of its master)`` per piece."""
    inner: torch.optim.Optimizer | None = None
    inner_groups: list[int] = field(default_factory=list)
    """The user's group of each inner parameter group."""
    parity: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    staged_parity: dict[tuple[int, int], torch.Tensor] | None = None
    parity_valid: bool = False
    snapshot: Snapshot | None = None
    gradients: list[torch.Tensor | None] | None = None
    """The reduced gradients taken from the parameters for the update not yet synced (kept for a replay)."""
    updates: int = 0
    pending: bool = False
    committed: bool = True
    stats: RepairStats = field(default_factory=RepairStats)

    def __post_init__(self) -> None:
        self.locals = [local_tensor(param) for param in self.params]
        bounds = [0]
        for group in self.template.param_groups:
            bounds.append(bounds[-1] + sum(local_tensor(param).numel() for param in group["params"]))
        self.runs = GroupRuns(tuple(bounds))

    @property
    def elements(self) -> int:
        """Elements of the flat run (this process's local shards of the parameters)."""
        return self.runs.bounds[-1]

    @property
    def device(self) -> torch.device:
        return self.locals[0].device

    # --- rows ------------------------------------------------------------------------------------

    def rows(self, shard: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Shard ``shard``'s rows: the master, then each per-element state tensor in key order (a copy).

        Each element is copied once, straight into the result (``out`` when
        given, rows x elements).
        """
        master = self.masters[shard]
        rows = self.row_buffer(shard) if out is None else out
        self.copy_columns(shard, 0, master.numel(), rows)
        return rows

    def row_buffer(self, shard: int, columns: int | None = None, *, master: bool = True) -> torch.Tensor:
        """An uninitialised rows x ``columns`` tensor (default: the shard's elements) for shard ``shard``'s rows.

        ``master=False``: the state rows only (what parity protects).
        """
        held = self.masters[shard]
        width = held.numel() if columns is None else columns
        return torch.empty(int(master) + len(self.keys()), width, dtype=held.dtype, device=held.device)

    def copy_columns(self, shard: int, low: int, high: int, out: torch.Tensor, *, master: bool = True) -> None:
        """Columns ``[low, high)`` of shard ``shard``'s rows into ``out`` (rows x ``high - low``, any strides).

        ``master=False``: the state rows only, from ``out``'s first row.
        """
        if master:
            out[0].copy_(self.masters[shard].detach()[low:high])
        state = self.inner.state if self.inner is not None else {}
        for row, key in enumerate(self.keys(), start=int(master)):
            for _, offset, view in self.views[shard]:
                first, last = max(low, offset), min(high, offset + view.numel())
                if first < last:
                    values = state[view][key].reshape(-1)[first - offset : last - offset]
                    out[row, first - low : last - low].copy_(values)

    def rows_numel(self, shard: int) -> int:
        return (1 + len(self.keys())) * self.masters[shard].numel()

    def keys(self) -> list[str]:
        """The optimizer's per-element state keys (none before the first update)."""
        state = self._first_state()
        view = self._first_view()
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and view is not None and _per(v, view))

    def scalars(self) -> dict[str, Any]:
        """The optimizer's other state (Adam's step count), the same for every piece."""
        keys = set(self.keys())
        return {k: v for k, v in self._first_state().items() if k not in keys}

    def _first_view(self) -> torch.Tensor | None:
        if not self.masters:
            return None
        return self.views[next(iter(self.masters))][0][2]

    def _first_state(self) -> dict[str, Any]:
        view = self._first_view()
        if self.inner is None or view is None:
            return {}
        return dict(self.inner.state.get(view, {}))

    # --- holding shards --------------------------------------------------------------------------

    def install(
        self, layout: ShardLayout, rank: int, rows: dict[int, torch.Tensor], keys: list[str], scalars: dict[str, Any]
    ) -> None:
        """Hold ``rows`` (per shard: master, then state ``keys``) under ``layout`` as process ``rank``.

        The masters and the optimizer's state are views of ``rows``, which
        the caller made for this and does not keep (no second copy of the
        state: overlap 1 re-slices all of it at every reshard).
        """
        self.layout, self.rank = layout, rank
        self.masters = {shard: rows[shard][0] for shard in layout.held_shards(rank)}
        self.views = {}
        for shard, master in self.masters.items():
            start, end = layout.shard_ranges[shard]
            self.views[shard] = [
                (group, low - start, master[low - start : high - start])
                for group, low, high in self.runs.pieces(start, end)
            ]
        pieces = [(group, view) for shard in self.masters for group, _, view in self.views[shard]]
        self.inner, self.inner_groups = self.optimizer(pieces, self.hyperparameters())
        for shard in self.masters:
            for _, offset, view in self.views[shard]:
                if keys:
                    state = {key: rows[shard][1 + i][offset : offset + view.numel()] for i, key in enumerate(keys)}
                    self.inner.state[view] = state | clone(scalars)
        self.parity, self.staged_parity, self.parity_valid = {}, None, False
        self.snapshot = None

    def optimizer(
        self, pieces: list[tuple[int, torch.Tensor]], hyperparameters: list[dict[str, Any]]
    ) -> tuple[torch.optim.Optimizer, list[int]]:
        """The template's optimizer class over ``pieces`` (``(group, tensor)``), one inner group per user group met."""
        groups = sorted({group for group, _ in pieces})
        param_groups = [
            {**hyperparameters[group], "params": [tensor for g, tensor in pieces if g == group]} for group in groups
        ]
        optimizer: torch.optim.Optimizer = type(self.template)(param_groups, lr=self.template.defaults["lr"])  # type: ignore[call-arg]
        return optimizer, groups

    def hyperparameters(self) -> list[dict[str, Any]]:
        """The user's groups' hyper-parameters as they are now (an LR scheduler changes them)."""
        return [{key: value for key, value in group.items() if key != "params"} for group in self.template.param_groups]

    def set_hyperparameters(self, optimizer: torch.optim.Optimizer, groups: list[int], values: list[dict]) -> None:
        """Give each inner group of ``optimizer`` its user group's ``values``."""
        for inner, group in zip(optimizer.param_groups, groups, strict=True):
            inner.update(values[group])

    def fresh_rows(self, layout: ShardLayout, shard: int, keys: list[str]) -> torch.Tensor:
        """A shard from the parameters (its master) and the state loaded into the user's optimizer (``keys``)."""
        start, end = layout.shard_ranges[shard]
        state = self.template.state
        tensors = [self.locals, *([local_tensor(state[p][key]) for p in self.params] for key in keys)]
        return torch.stack([self.flat(row, start, end).detach().clone() for row in tensors])

    def loaded_keys(self) -> tuple[list[str], dict[str, Any]]:
        """The per-element keys and the scalar state of a whole state loaded into the user's optimizer (none: fresh)."""
        state = self.template.state.get(self.params[0], {})
        keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == self.params[0].shape)
        return keys, {k: v for k, v in state.items() if k not in keys}

    # --- gradients -------------------------------------------------------------------------------

    def take_gradients(self) -> None:
        """Take the parameters' reduced gradients for the update (``param.grad`` becomes None).

        They are kept until the update is synced, so that a cell rebuilt after
        a failure in between can be updated again with them.
        """
        self.gradients = [param.grad for param in self.params]
        for param in self.params:
            param.grad = None

    def flat_gradients(self, elements: Range) -> torch.Tensor:
        """Elements ``elements`` of the taken gradients (zeros where a parameter had none)."""
        taken = self.gradients or [None] * len(self.params)
        grads = [
            torch.zeros_like(local) if grad is None else local_tensor(grad)
            for grad, local in zip(taken, self.locals, strict=True)
        ]
        return self.flat(grads, *elements)

    def flat(self, tensors: Sequence[torch.Tensor], start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the tensors read as one flat run."""
        pieces, offset = [], 0
        for tensor in tensors:
            low, high = max(start, offset), min(end, offset + tensor.numel())
            if low < high:
                pieces.append(tensor.detach().reshape(-1)[low - offset : high - offset])
            offset += tensor.numel()
        return torch.cat(pieces) if pieces else torch.zeros(0, device=self.device)

    @property
    def state_bytes(self) -> int:
        """Bytes of sharded state this process holds: masters and optimizer state of its shards, parity units."""
        held = sum(self.rows_numel(shard) for shard in self.masters) * 4
        return held + sum(unit.numel() for unit in self.parity.values())


def _per(value: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``value`` is per-element state of ``view`` (its shape), not a scalar such as Adam's step."""
    return value.shape == view.shape and (value.dim() > 0 or view.dim() == 0)


def clone(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
