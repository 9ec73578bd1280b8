"""Helpers for tests of FSDP2 inside replica groups: spawned Gloo groups on CPU, a small sharded MLP, bounded runs.

Each spawned process joins its replica group as the *default* process group
(a process can have only one), on the test's TCPStore under the group's own
prefix, and shards over a 1-D DeviceMesh of that group. Anything across groups
uses an explicit group (a :class:`~stalwart.runtime.comm.Communicator`).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from stalwart.launch.processes import preloaded_context

HOST = "127.0.0.1"
TIMEOUT = 60.0  # a bound on a busy machine, not an expectation
"""Seconds any rendezvous or collective in these tests may take."""
CONTEXT = preloaded_context()  # forked from one interpreter that imported torch once


def client(port: int, prefix: str) -> dist.Store:
    """The test's TCPStore at ``port``, every key under ``prefix``."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    return dist.PrefixStore(prefix, store)


def join_group(port: int, prefix: str, rank: int, world_size: int) -> DeviceMesh:
    """Become ``rank`` of a Gloo default process group on the store under ``prefix``; its 1-D mesh."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=client(port, prefix),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    return init_device_mesh("cpu", (world_size,))


def mlp(seed: int, hidden: int = 6) -> torch.nn.Sequential:
    """Linear(4, hidden), ReLU, Linear(hidden, 1).

    Over two processes the first layer's shards are even for an even
    ``hidden``; the last layer's are uneven (one row, then none).
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def shard(model: torch.nn.Sequential, mesh: DeviceMesh) -> torch.nn.Sequential:
    """``fully_shard`` each Linear, then the root (the usual per-layer wrapping)."""
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, micro: int) -> torch.Tensor:
    """The inputs of process ``rank``'s micro-batch ``micro`` (the same in every group)."""
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 * rank + micro))


def loss(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs).pow(2).sum()


def run_processes(target: Callable[..., None], args: list[tuple[Any, ...]], timeout: float) -> None:
    """Run ``target(*a)`` for each ``a`` in its own spawned process; fail if one fails or all take over ``timeout``.

    When a process fails the others are killed at once rather than waited for
    (they may be stuck in a collective with it).
    """
    processes = [CONTEXT.Process(target=target, args=a) for a in args]
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.start()
        while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
            if any(process.exitcode not in (None, 0) for process in processes):
                break
            time.sleep(0.05)
        codes = [process.exitcode for process in processes]
        assert codes == [0] * len(processes), f"exit codes {codes} (None: still running when the test gave up)"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=TIMEOUT)
