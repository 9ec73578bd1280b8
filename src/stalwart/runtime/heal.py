"""Healing: copy a live member's model, optimizer state and step to members that are behind.

The source's tensors travel by broadcast over the quorum's process group; the
non-tensor structure of the optimizer state (hyper-parameters, which state
each parameter holds, shapes and dtypes) travels as JSON through the quorum's
store. Nothing is pickled, so a peer cannot make another run code.
Every member of the quorum takes part (a broadcast is collective); only the
targets load what they received.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from stalwart.runtime.comm import Communicator

_META_KEY = "heal/meta"


def transfer_state(
    comm: Communicator,
    source_rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    applied_step: int,
    *,
    is_target: bool,
) -> int:
    """Broadcast the source's state; targets load it. Returns the source's ``applied_step``."""
    if comm.rank == source_rank:
        meta, tensors = _flatten(model, optimizer, applied_step, comm.device)
        comm.store.set(_META_KEY, json.dumps(meta))
    else:
        meta = json.loads(comm.store.get(_META_KEY))
        tensors = [
            torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]), device=comm.device) for spec in meta["tensors"]
        ]
    comm.broadcast(tensors, source_rank)
    if is_target and comm.rank != source_rank:
        _load(model, optimizer, meta, tensors)
    return int(meta["applied_step"])


def _flatten(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, applied_step: int, device: torch.device
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def placeholder(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().contiguous())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(value, dict):
            return {str(key): placeholder(item) for key, item in value.items()}
        if isinstance(value, tuple):
            return {"__tuple__": [placeholder(item) for item in value]}
        if isinstance(value, list):
            return [placeholder(item) for item in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"optimizer state holds a {type(value).__name__}, which cannot be sent as JSON: {value!r}")

    model_state = {name: placeholder(tensor) for name, tensor in model.state_dict().items()}
    optimizer_state = placeholder(optimizer.state_dict())
    specs = [{"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")} for tensor in tensors]
    meta = {"applied_step": applied_step, "model": model_state, "optimizer": optimizer_state, "tensors": specs}
    return meta, [tensor.to(device) for tensor in tensors]


def _load(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: list[torch.Tensor]
) -> None:
    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"__tensor__"}:
                return tensors[int(value["__tensor__"])]
            if set(value) == {"__tuple__"}:
                return tuple(restore(item) for item in value["__tuple__"])
            return {key: restore(item) for key, item in value.items()}
        if isinstance(value, list):
            return [restore(item) for item in value]
        return value

    model.load_state_dict(restore(meta["model"]))
    optimizer_state = restore(meta["optimizer"])
    optimizer_state["state"] = {int(key): value for key, value in optimizer_state["state"].items()}
    optimizer.load_state_dict(optimizer_state)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"heal metadata names an unknown dtype {name!r}")
    return dtype
