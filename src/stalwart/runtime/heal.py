"""Healing: copy a live member's whole state and step to members that are behind.

A member's state is a list of named stateful objects (the model, the
optimizer, what the user registered, the RNG states: see
:mod:`stalwart.runtime.state`). The source's tensors travel by broadcast over
the quorum's process group; the non-tensor structure (hyper-parameters,
counters, which state each parameter holds, the tensors' names, shapes and
dtypes) travels as JSON through the quorum's store. Nothing is pickled, so a
peer cannot make another run code.

A DTensor (FSDP2 inside a replica group, :mod:`stalwart.runtime.sharding`)
travels as its local shard: process r of a joining group heals from process r
of a live group, over a communicator with one process per group. Its metadata
also records the whole tensor's shape, its placements, the mesh's shape and the
sender's coordinate in it, and the receiver loads the shard back as a DTensor
on its own mesh, with its own placements.

Nothing a peer claims is allocated unchecked: every member that receives
validates the metadata against its own state first (:func:`check_heal_meta`):
the same state names, the same tensor names in the same order with the same
shapes, dtypes and sharding (optimizer state this member has not created yet
is allowed when it has its parameter's shape and sharding), and a total within
a byte budget. A mismatch raises :class:`HealError` naming the first offending
tensor. The non-tensor values are checked too before anything is loaded
(:func:`check_heal_values`): an optimizer's parameter groups must be this
member's (the same groups, keys and parameters; each hyper-parameter of the
same kind, numbers finite where this member's are), and every value must
decode to what a ``state_dict`` holds; a ``load_state_dict`` that still
refuses what it is given is a :class:`HealError` too. A :class:`HealError` is
a failed collective: the quorum is asked again (never a crash), and a member
whose peer trains another model ends with ``JoinError`` after its attempts.

Every member of the quorum takes part (a broadcast is collective); only the
targets load what they received.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.sharding import local_tensor
from stalwart.runtime.state import Stateful

META_KEY = "heal/meta"
BUDGET_FACTOR = 4
"""Default byte budget: this many times the receiver's own state bytes, plus ``BUDGET_SLACK``.

A fresh Adam target holds only its parameters; the source also holds two
moment buffers per parameter (3x), hence 4.
"""
BUDGET_SLACK = 1 << 20
DEFAULT_HEAL_TIMEOUT = 30.0
"""Seconds a heal may take on top of moving its bytes at ``DEFAULT_MIN_BANDWIDTH``."""
DEFAULT_MIN_BANDWIDTH = 50e6
"""Bytes per second a heal is assumed to move at least (a slow shared network)."""
_MAX_DIMS = 64
_MAX_DEPTH = 64
_MAX_PLACEMENT_CHARS = 200
_SCALAR_DTYPES = frozenset({torch.float32, torch.float64, torch.int64})
_OPTIMIZER_STATE = re.compile(r"^(?P<state>.+)/state/(?P<index>\d+)/[^/]+$")


class HealError(CollectiveError):
    """The heal metadata does not fit this member's state (or its byte budget), or its values do not load: a failed
    collective (the quorum is asked again)."""


@dataclass(frozen=True)
class ShardSpec:
    """What a DTensor's local shard is part of: the whole tensor's shape, its placements, the mesh and where in it."""

    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    coordinate: tuple[int, ...]

    @classmethod
    def of(cls, tensor: DTensor) -> ShardSpec:
        """The layout of this process's shard of ``tensor``."""
        mesh = tensor.device_mesh
        return cls(
            tuple(tensor.shape),
            tuple(repr(placement) for placement in tensor.placements),
            tuple(mesh.shape),
            tuple(mesh.get_coordinate() or ()),
        )

    def to_json(self) -> dict[str, Any]:
        """The layout as it travels in the metadata."""
        return {
            "shape": list(self.shape),
            "placements": list(self.placements),
            "mesh": list(self.mesh),
            "coordinate": list(self.coordinate),
        }


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's place in a state: its path name, shape and dtype; a DTensor's local shard's, with its layout."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: ShardSpec | None = None

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor`` (of its local shard if it is a DTensor)."""
        shard = ShardSpec.of(tensor) if isinstance(tensor, DTensor) else None
        return cls(name, tuple(local_tensor(tensor).shape), tensor.dtype, shard)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor (or local shard) holds (exact python ints: a claimed shape cannot overflow)."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def describe(self) -> str:
        """Shape and dtype, and for a shard where it lies, as error messages show them."""
        text = f"{list(self.shape)} {self.dtype}"
        if self.shard is None:
            return text
        placements = ", ".join(self.shard.placements)
        return (
            f"{text}, the shard at {list(self.shard.coordinate)} of {list(self.shard.shape)} "
            f"({placements} over a mesh of {list(self.shard.mesh)})"
        )

    def to_json(self) -> dict[str, Any]:
        """The spec as it travels in the metadata."""
        raw: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        if self.shard is not None:
            raw["dtensor"] = self.shard.to_json()
        return raw


def transfer_state(
    comm: Communicator,
    source_rank: int,
    states: Mapping[str, Stateful],
    applied_step: int,
    *,
    is_target: bool,
    key: str = META_KEY,
    max_bytes: int | None = None,
    timeout: float = DEFAULT_HEAL_TIMEOUT,
    min_bandwidth: float = DEFAULT_MIN_BANDWIDTH,
) -> int:
    """Broadcast the source's ``states``; targets load them. Returns the source's ``applied_step``.

    ``states`` maps names to stateful objects, in the same order on every
    member. ``key`` names the metadata in the quorum's store (a fresh key per
    heal within one quorum). Receivers check the metadata with
    :func:`check_heal_meta` (``max_bytes``: the byte budget, default
    ``BUDGET_FACTOR`` times their own state bytes) before allocating; the
    broadcast must end within ``timeout + bytes / min_bandwidth`` seconds.
    DTensors move as their local shards (see the module's docstring).
    """
    if comm.rank == source_rank:
        meta, tensors = flatten_states(states, applied_step)
        comm.publish(key, json.dumps(meta))
        total = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        tensors = [tensor.to(comm.device) for tensor in tensors]
    else:
        meta = _decode_json(comm.read(key))
        specs = check_heal_meta(meta, states, max_bytes=max_bytes)
        check_heal_values(meta, states)
        total = sum(spec.nbytes for spec in specs)
        tensors = _allocate(specs, comm.device)
    comm.broadcast(tensors, source_rank, timeout=heal_deadline(total, timeout, min_bandwidth))
    if is_target and comm.rank != source_rank:
        _load(states, meta, _as_own_dtensors(states, specs, tensors))
    return int(meta["applied_step"])


def flatten_states(states: Mapping[str, Stateful], applied_step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The JSON metadata of ``states`` (tensors replaced by their index) and the tensors (local shards), in order."""
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    encoded = [_encode(obj.state_dict(), name, tensors, names) for name, obj in states.items()]
    specs = [TensorSpec.of(name, tensor).to_json() for name, tensor in zip(names, tensors, strict=True)]
    meta = {"applied_step": applied_step, "names": list(states), "states": encoded, "tensors": specs}
    return meta, [local_tensor(tensor).contiguous() for tensor in tensors]


def state_specs(states: Mapping[str, Stateful]) -> list[TensorSpec]:
    """The tensors of this member's own ``states``: what heal metadata must match."""
    return [TensorSpec.of(name, tensor) for name, tensor in _own_tensors(states)]


def _own_tensors(states: Mapping[str, Stateful]) -> list[tuple[str, torch.Tensor]]:
    """This member's state tensors with their path names, in order (DTensors as they are)."""
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    for name, obj in states.items():
        _encode(obj.state_dict(), name, tensors, names)
    return list(zip(names, tensors, strict=True))


def check_heal_meta(meta: Any, states: Mapping[str, Stateful], *, max_bytes: int | None = None) -> list[TensorSpec]:
    """The tensor specs of ``meta`` once checked against this member's ``states``; :class:`HealError` if not.

    Checked, in the metadata's order: every tensor is well formed, has a name
    this member's state has (in the same order as this member's), with the same
    shape and dtype, and is a DTensor's shard exactly when this member's is,
    laid out the same (whole shape, placements, mesh, coordinate); a tensor of a
    registered optimizer's per-parameter state (``NAME/state/I/KEY``) that this
    member has not created yet is allowed when it has parameter ``I``'s shape,
    dtype and layout (or is an unsharded scalar step count). Every
    tensor this member has, except its optimizers' per-parameter state, must be
    present, and the total must fit ``max_bytes`` (default: ``BUDGET_FACTOR``
    times this member's own state bytes plus ``BUDGET_SLACK``).
    """
    if not isinstance(meta, dict) or not {"applied_step", "names", "states", "tensors"} <= set(meta):
        raise HealError("heal metadata is not an object with applied_step, names, states and tensors")
    if meta["names"] != list(states):
        raise HealError(f"the source's states {meta['names']!r} differ from this member's {list(states)!r}")
    if isinstance(meta["applied_step"], bool) or not isinstance(meta["applied_step"], int):
        raise HealError(f"heal metadata's applied_step must be an int, got {meta['applied_step']!r}")
    if not isinstance(meta["tensors"], list):
        raise HealError("heal metadata's tensors must be a list")
    own = state_specs(states)
    own_by_name = {spec.name: spec for spec in own}
    optional = _optimizer_parameters(states)
    budget = max_bytes if max_bytes is not None else BUDGET_FACTOR * sum(spec.nbytes for spec in own) + BUDGET_SLACK
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    next_own = 0
    total = 0
    for number, raw in enumerate(meta["tensors"]):
        spec = _parse_spec(raw, number)
        if spec.name in seen:
            raise HealError(f"heal metadata tensor #{number} {spec.name!r} appears twice")
        seen.add(spec.name)
        expected = own_by_name.get(spec.name) or _optional_spec(spec, optional)
        if expected is None:
            raise HealError(f"heal metadata tensor #{number} {spec.name!r} is not part of this member's state")
        if (spec.shape, spec.dtype, spec.shard) != (expected.shape, expected.dtype, expected.shard):
            raise HealError(
                f"heal metadata tensor #{number} {spec.name!r} is {spec.describe()}; "
                f"this member's is {expected.describe()}"
            )
        if spec.name in own_by_name:
            while (
                next_own < len(own)
                and own[next_own].name != spec.name
                and _optional_spec(own[next_own], optional) is not None
            ):
                next_own += 1  # optimizer state this member has and the source does not: skipped
            if next_own >= len(own) or own[next_own].name != spec.name:
                here = "nothing more" if next_own >= len(own) else repr(own[next_own].name)
                raise HealError(
                    f"heal metadata tensor #{number} {spec.name!r} is out of order: this member expects "
                    f"{here} here (are tensors permuted?)"
                )
            next_own += 1
        total += spec.nbytes
        if total > budget:
            raise HealError(
                f"heal metadata tensor #{number} {spec.name!r} brings the heal to {total} bytes, over the budget of "
                f"{budget} bytes (max_heal_bytes)"
            )
        specs.append(spec)
    for spec in own:
        if spec.name not in seen and _optional_spec(spec, optional) is None:
            raise HealError(f"heal metadata lacks tensor {spec.name!r} of this member's state")
    return specs


def check_heal_values(meta: dict[str, Any], states: Mapping[str, Stateful]) -> None:
    """The non-tensor values of checked ``meta`` against this member's ``states``; :class:`HealError` if not.

    Every state's values must be well formed (what :func:`_encode` writes);
    an optimizer's ``param_groups`` must have this member's groups, keys and
    parameters, each hyper-parameter of the same kind as this member's (a
    number, finite where this member's is; a bool; a string; None; a tuple or
    list of as many of them), and its per-parameter state only this member's
    parameters and numbers.
    """
    encoded = meta["states"]
    if not isinstance(encoded, list) or len(encoded) != len(states):
        raise HealError(f"heal metadata's states must be a list of {len(states)} encoded states")
    for (name, obj), theirs in zip(states.items(), encoded, strict=True):
        _check_encoded(theirs, f"{name}", depth=0)
        if isinstance(obj, torch.optim.Optimizer):
            _check_optimizer(name, theirs, obj)


def _check_encoded(value: Any, path: str, depth: int) -> None:
    """Well formed as :func:`_encode` writes: tensor references, dicts as key-value pairs, tuples, lists, scalars."""
    if depth > _MAX_DEPTH:
        raise HealError(f"heal metadata's {path} nests deeper than {_MAX_DEPTH}")
    if isinstance(value, list):
        for number, item in enumerate(value):
            _check_encoded(item, f"{path}/{number}", depth + 1)
    elif isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return  # checked against the tensors when decoded
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            _check_encoded(value["__tuple__"], path, depth + 1)
            return
        if set(value) != {"__dict__"} or not isinstance(value["__dict__"], list):
            raise HealError(f"heal metadata's {path} is an object with unexpected keys {sorted(value)[:5]}")
        for pair in value["__dict__"]:
            if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], list | dict):
                raise HealError(f"heal metadata's {path} holds a malformed key-value pair {str(pair)[:100]}")
            _check_encoded(pair[1], f"{path}/{pair[0]}", depth + 1)


def _pairs(value: Any) -> dict[Any, Any]:
    """An encoded dict's items (checked well formed already)."""
    return {key: item for key, item in value["__dict__"]} if isinstance(value, dict) and "__dict__" in value else {}


def _check_optimizer(name: str, theirs: Any, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer's groups and per-parameter state against this member's (see :func:`check_heal_values`)."""
    own = optimizer.state_dict()
    values = _pairs(theirs)
    if set(values) != {"state", "param_groups"}:
        raise HealError(f"heal metadata's {name} is not an optimizer state (state and param_groups)")
    groups = values["param_groups"]
    own_groups = own["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own_groups):
        raise HealError(f"heal metadata's {name} has another number of parameter groups than this member's")
    for number, (group, mine) in enumerate(zip(groups, own_groups, strict=True)):
        items = _pairs(group)
        if set(items) != set(mine):
            raise HealError(
                f"heal metadata's {name} group {number} has keys {sorted(map(str, items))}, this member's "
                f"{sorted(mine)}"
            )
        for key, value in items.items():
            where = f"{name} group {number} {key!r}"
            if key == "params":
                if value != list(mine["params"]):
                    raise HealError(f"heal metadata's {where} names other parameters than this member's")
            else:
                _check_same_kind(value, mine[key], where)
    parameters = {index for group in own_groups for index in group["params"]}
    for index, state in _pairs(values["state"]).items():
        if index not in parameters:
            raise HealError(f"heal metadata's {name} holds state for parameter {index!r}, which this member lacks")
        for key, value in _pairs(state).items():
            if not (isinstance(value, dict) and set(value) == {"__tensor__"}) and not _is_number(value):
                raise HealError(f"heal metadata's {name} state {index} {key!r} must be a tensor or a number")


def _check_same_kind(theirs: Any, mine: Any, where: str) -> None:
    """A hyper-parameter of the same kind as this member's (see :func:`check_heal_values`)."""
    if isinstance(mine, torch.Tensor):
        if not (isinstance(theirs, dict) and set(theirs) == {"__tensor__"}):
            raise HealError(f"heal metadata's {where} must be a tensor, as this member's is")
        return
    if isinstance(mine, tuple | list):
        items = theirs.get("__tuple__") if isinstance(theirs, dict) and isinstance(mine, tuple) else theirs
        if not isinstance(items, list) or len(items) != len(mine):
            raise HealError(f"heal metadata's {where} must be a sequence of {len(mine)}, as this member's is")
        for number, (item, own_item) in enumerate(zip(items, mine, strict=True)):
            _check_same_kind(item, own_item, f"{where}[{number}]")
        return
    if isinstance(mine, bool) or mine is None or isinstance(mine, str):
        if type(theirs) is not type(mine):
            raise HealError(f"heal metadata's {where} is {theirs!r:.60}; this member's is a {type(mine).__name__}")
        return
    if isinstance(mine, int | float):
        if not _is_number(theirs) or (math.isfinite(mine) and not math.isfinite(theirs)):
            raise HealError(f"heal metadata's {where} is {theirs!r:.60}; this member's is the number {mine!r}")
        return
    raise HealError(f"this member's {where} is a {type(mine).__name__}, which a heal cannot check")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optimizer_parameters(states: Mapping[str, Stateful]) -> dict[str, list[torch.Tensor]]:
    """For each registered optimizer, its parameters in ``state_dict()`` index order."""
    return {
        name: [param for group in obj.param_groups for param in group["params"]]
        for name, obj in states.items()
        if isinstance(obj, torch.optim.Optimizer)
    }


def _optional_param(name: str, optional: dict[str, list[torch.Tensor]]) -> torch.Tensor | None:
    """The parameter whose optimizer state a tensor path ``name`` is, or None if it is no such tensor."""
    match = _OPTIMIZER_STATE.match(name)
    if match is None or match["state"] not in optional:
        return None
    params = optional[match["state"]]
    index = int(match["index"])
    return params[index] if index < len(params) else None


def _optional_spec(spec: TensorSpec, optional: dict[str, list[torch.Tensor]]) -> TensorSpec | None:
    """What an optimizer's per-parameter state tensor named like ``spec`` may be, or None if it is no such tensor."""
    param = _optional_param(spec.name, optional)
    if param is None:
        return None
    if spec.shape == () and spec.dtype in _SCALAR_DTYPES and spec.shard is None:
        return spec
    return TensorSpec.of(spec.name, param)


def _parse_spec(raw: Any, number: int) -> TensorSpec:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise HealError(f"heal metadata tensor #{number} is not an object with a name: {str(raw)[:200]}")
    name, dtype_name = raw["name"], raw.get("dtype")
    where = f"heal metadata tensor #{number} {name!r}"
    shape = _parse_sizes(raw.get("shape"), f"{where} has a malformed shape")
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise HealError(f"{where} names an unknown dtype {dtype_name!r}")
    return TensorSpec(name, shape, dtype, None if "dtensor" not in raw else _parse_shard(raw["dtensor"], where))


def _parse_shard(raw: Any, where: str) -> ShardSpec:
    if not isinstance(raw, dict):
        raise HealError(f"{where} has a malformed DTensor layout {str(raw)[:200]}")
    placements = raw.get("placements")
    if (
        not isinstance(placements, list)
        or len(placements) > _MAX_DIMS
        or any(not isinstance(item, str) or len(item) > _MAX_PLACEMENT_CHARS for item in placements)
    ):
        raise HealError(f"{where} has malformed DTensor placements {str(placements)[:200]}")
    return ShardSpec(
        _parse_sizes(raw.get("shape"), f"{where} has a malformed DTensor shape"),
        tuple(placements),
        _parse_sizes(raw.get("mesh"), f"{where} has a malformed DTensor mesh"),
        _parse_sizes(raw.get("coordinate"), f"{where} has a malformed DTensor coordinate"),
    )


def _parse_sizes(value: Any, error: str) -> tuple[int, ...]:
    """A list of at most ``_MAX_DIMS`` non-negative ints as a tuple; :class:`HealError` with ``error`` if not."""
    if (
        not isinstance(value, list)
        or len(value) > _MAX_DIMS
        or any(isinstance(size, bool) or not isinstance(size, int) or size < 0 for size in value)
    ):
        raise HealError(f"{error} {str(value)[:200]}")
    return tuple(value)


def _allocate(specs: list[TensorSpec], device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for checked specs (the only place a heal allocates)."""
    return [torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in specs]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _encode(value: Any, path: str, tensors: list[torch.Tensor], names: list[str]) -> Any:
    """JSON for ``value``: tensors become ``{"__tensor__": i}``, dicts keep their keys' types, tuples stay tuples."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        names.append(path)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if key is not None and not isinstance(key, (bool, int, float, str)):
                raise TypeError(f"state {path!r} has a {type(key).__name__} key, which cannot be sent as JSON: {key!r}")
            items.append([key, _encode(item, f"{path}/{key}", tensors, names)])
        return {"__dict__": items}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(item, f"{path}/{i}", tensors, names) for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, f"{path}/{i}", tensors, names) for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"state {path!r} holds a {type(value).__name__}, which cannot be sent as JSON: {value!r}")


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            index = value["__tensor__"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
                raise HealError(f"heal metadata refers to tensor {index!r} of {len(tensors)}")
            return tensors[index]
        if set(value) == {"__tuple__"}:
            return tuple(_decode(item, tensors) for item in value["__tuple__"])
        if set(value) == {"__dict__"}:
            return {key: _decode(item, tensors) for key, item in value["__dict__"]}
        raise HealError(f"heal metadata holds an object with unexpected keys {sorted(value)[:5]}")
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    return value


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as error:
        raise HealError(f"heal metadata is not JSON: {error}") from error


def _as_own_dtensors(
    states: Mapping[str, Stateful], specs: list[TensorSpec], tensors: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The received tensors, each received shard made a DTensor like this member's own (or its parameter's).

    The checked layout equals the template's, so the shard is wrapped with the
    template's mesh, placements, shape and stride without communication. The
    objects' own ``load_state_dict`` then gets what their ``state_dict`` gives:
    an FSDP2 module copies DTensor into DTensor shard-locally, an optimizer keeps
    DTensor state for DTensor parameters.
    """
    own = dict(_own_tensors(states))
    optional = _optimizer_parameters(states)
    loaded = []
    for spec, tensor in zip(specs, tensors, strict=True):
        template = own.get(spec.name)
        if template is None:
            template = _optional_param(spec.name, optional)
        if spec.shard is not None and isinstance(template, DTensor):
            tensor = DTensor.from_local(
                tensor,
                template.device_mesh,
                template.placements,
                run_check=False,
                shape=template.shape,
                stride=template.stride(),
            )
        loaded.append(tensor)
    return loaded


def _load(states: Mapping[str, Stateful], meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    decoded = [_decode(encoded, tensors) for encoded in meta["states"]]  # every value decoded before any is loaded
    for name, value in zip(meta["names"], decoded, strict=True):
        try:
            states[name].load_state_dict(value)
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError, AttributeError) as error:
            raise HealError(f"state {name!r} refused the values the heal brought: {error}") from None


def heal_deadline(total_bytes: int, timeout: float, min_bandwidth: float) -> float:
    """Seconds a heal of ``total_bytes`` may take: ``timeout + total_bytes / min_bandwidth``."""
    return timeout + total_bytes / min_bandwidth
