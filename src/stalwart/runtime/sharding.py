"""FSDP2 inside a replica group: the helpers the runtime needs around ``fully_shard``.

A replica group of G processes may shard its model with
``torch.distributed.fsdp.fully_shard`` over a 1-D DeviceMesh of its own G
processes (fault-tolerant HSDP). Parameters, gradients and optimizer state are
then DTensors whose local shard differs per process; process r of every group
holds the same shard, so a group is healed shard by shard (see
:mod:`stalwart.runtime.heal`) and gradients are reduced across groups per shard.

Nothing here creates a process group or talks to a peer except through FSDP's
own reduce-scatter.

FSDP2 and DTensor are never imported here: no model is sharded and no tensor
is a DTensor before the training script imported them, and importing them
costs about a second of CPU in every process that does not use them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def loaded_class(module: str, name: str) -> Any:
    """``module.name`` if ``module`` has been imported, else ``None`` (then nothing is an instance of it)."""
    loaded = sys.modules.get(module)
    return None if loaded is None else getattr(loaded, name)


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor``."""
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def _fsdp_modules(model: torch.nn.Module) -> Iterator[Any]:
    fsdp_module = loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is not None:
        yield from (module for module in model.modules() if isinstance(module, fsdp_module))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its submodules was ``fully_shard``-ed."""
    return next(_fsdp_modules(model), None) is not None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shaped_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this process's elements of ``param``) as ``param`` holds them: a DTensor of its layout, or a view.

    For the optimizer state a sharded optimizer hands back: a DTensor
    parameter's state must be a DTensor of the same mesh and placements for
    ``torch.distributed.checkpoint`` to save each process's shard.
    """
    if not is_dtensor(param):
        return local.view_as(param)
    view = local.view_as(param.to_local())
    return type(param).from_local(
        view, param.device_mesh, param.placements, run_check=False, shape=param.size(), stride=param.stride()
    )


def sharding_layout(model: torch.nn.Module) -> str:
    """A short digest of how this process holds ``model``'s parameters.

    It covers each parameter's name, global and local shape, dtype, placements
    and mesh size (a plain tensor counts as unsharded on a mesh of one). Process
    r of every group has the same digest exactly when the groups shard the same
    model the same way.
    """
    rows = []
    for name, param in model.named_parameters():
        if is_dtensor(param):
            placements = [repr(placement) for placement in param.placements]
            mesh_size = param.device_mesh.size()
        else:
            placements, mesh_size = [], 1
        local = local_tensor(param)
        rows.append([name, list(param.shape), list(local.shape), str(param.dtype), placements, mesh_size])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def prepare_fsdp(model: torch.nn.Module) -> None:
    """Make FSDP2's gradient reduce-scatter sum over the group instead of averaging.

    Every ``FSDPModule`` gets a gradient divide factor of 1
    (``set_gradient_divide_factor``) and plain SUM collectives
    (``set_force_sum_reduction_for_comms``): with the factor alone FSDP2 uses
    ``ReduceOp.PREMUL_SUM``, which Gloo does not support. Each process's shard
    of a gradient is then that shard of the sum of the processes' full
    gradients, and the runtime normalizes once, across groups.
    """
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Turn FSDP2's gradient reduce-scatter on or off (off: backward passes accumulate unsharded, locally).

    Calls ``set_requires_gradient_sync`` on every ``FSDPModule`` of ``model``
    (each for itself only), which is what calling it on the root with
    ``recurse=True`` does, without needing to know which module is the root.
    """
    for module in _fsdp_modules(model):
        module.set_requires_gradient_sync(enabled, recurse=False)
