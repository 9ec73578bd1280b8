"""A job of ShardedOptimizer processes over real Gloo groups, for test_zero.py (each process runs :func:`run`).

Process ``p`` of ``--world`` trains a small linear model with the same
per-step gradients everywhere (as after an all-reduce); ``--kill STEP:POINT:P``
makes process ``P`` SIGKILL itself at ``POINT`` of ``STEP``, through the
instrumented loop's :class:`~stalwart.launch.loop.Faults` and its point names
(``step_started``: the top of the step, after the previous one's sync;
``during_update``; ``during_gather`` and ``during_parity``, which the
ShardedOptimizer's ``notify`` reaches as the Manager's ``on_event`` does),
after saying so on the store (as the lighthouse's push would tell the others);
the survivors form a new group (a new store prefix, ranks in order) and
reshard; ``--join STEP``
adds a new process at ``STEP`` (its parameters copied from the survivors, as
a heal would). Each process writes its final parameters, optimizer rows and
state bytes to ``OUT/rank-P.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.launch.loop import Faults
from stalwart.redundancy.config import Overlap, parse_parity
from stalwart.redundancy.layout import ShardsLostError
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.zero import CopyMismatchError, ShardedOptimizer
from stalwart.testing.forked import run_forked

FEATURES = 13


def model_and_optimizer(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    if kind == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if kind == "adamw-groups":  # biases first, then weights: the flat run follows the groups, not the model
        biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
        weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
        groups = [{"params": biases, "lr": 0.02, "weight_decay": 0.0}, {"params": weights, "weight_decay": 0.1}]
        return model, torch.optim.AdamW(groups, lr=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def parameters() -> int:
    """Elements of the model's parameters (the flat state's length)."""
    return sum(p.numel() for p in model_and_optimizer("adam")[0].parameters())


def gradients(model: torch.nn.Module, step: int) -> None:
    """The step's mean gradient, the same on every process: a loss on a batch seeded by the step."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(16, FEATURES, generator=generator)
    targets = torch.randn(16, 3, generator=generator)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def reference(kind: str, steps: int) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """One process, no sharding: the final parameters and the optimizer's state (by parameter index)."""
    model, optimizer = model_and_optimizer(kind)
    for step in range(steps):
        gradients(model, step)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, optimizer.state_dict()["state"]


def run(argv: list[str]) -> None:
    """A process's entry (forked by the test): :func:`main`, then an exit that skips the interpreter's teardown."""
    run_forked(lambda: main(argv))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--overlap", type=float, default=None)
    parser.add_argument("--parity", type=parse_parity, default=None)
    parser.add_argument("--nodes", default="", help="comma-separated node labels, one per process")
    parser.add_argument("--kill", action="append", default=[], help="STEP:POINT:PROCESS")
    parser.add_argument("--join-at", type=int, default=None)
    parser.add_argument("--flip-at", type=int, default=None, help="STEP at which process 0 flips a bit of a copy")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    redundancy = args.parity if args.parity is not None else Overlap(args.overlap)
    kills: dict[tuple[int, str], set[int]] = {}
    for text in args.kill:
        step, point, process = text.split(":")
        kills[(int(step), point)] = kills.get((int(step), point), set()) | {int(process)}
    me = args.rank
    mine = [at for at, processes in kills.items() if me in processes]
    nodes = args.nodes.split(",") if args.nodes else [f"node{p}" for p in range(args.world + 1)]
    model, template = model_and_optimizer(args.optimizer)
    sharded = ShardedOptimizer(list(model.parameters()), template, redundancy, node=nodes[args.rank])
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=120))

    def announce_death() -> None:
        store.set(f"dead/{me}", "1")

    faults = Faults(kill_at=mine[0] if mine else None, before_kill=announce_death)
    joiner = args.join_at is not None and me == args.world
    alive = list(range(args.world))
    quorum = 0
    start = 0
    if joiner:  # wait for the survivors to reach the join, then take their parameters as a heal would
        members = json.loads(store.get(f"join/{args.join_at}"))
        alive, quorum, start = members["alive"], members["quorum"], args.join_at
        for name, value in torch.load(args.out / "heal.pt").items():
            dict(model.named_parameters())[name].data.copy_(value)

    def comm_for(quorum: int, alive: list[int]) -> Communicator:
        """The group of ``alive``; a collective is abandoned once a peer announced its death (as the lighthouse's
        push would)."""
        peers = [f"dead/{peer}" for peer in alive if peer != me]
        prefix = dist.PrefixStore(f"q{quorum}/", store)
        return Communicator(
            prefix,
            alive.index(me),
            len(alive),
            timeout=120.0,
            device=torch.device("cpu"),
            abandon=lambda: any(store.check([key]) for key in peers),
        )

    def repair(failed: int, comm: Communicator, quorum: int, alive: list[int]) -> tuple[Communicator, int, list[int]]:
        """A new group of the survivors of step ``failed``'s failure, resharded.

        The processes agree on the group as the lighthouse would make them:
        each waits for the deaths its step's kills announce.
        """
        # Dead by now: those killed in this step or an earlier one, and one killed at the top of the next,
        # after this step's sync, if it said so (its sync ended before this process's failed).
        victims = {
            p
            for (at, name), ps in kills.items()
            for p in ps
            if at <= failed or (at == failed + 1 and name == "step_started" and store.check([f"dead/{p}"]))
        }
        if me in victims:  # its step failed before it reached its own kill point: it dies all the same
            faults.kill()
        store.wait([f"dead/{p}" for p in victims & set(alive)], datetime.timedelta(seconds=120))
        alive = [p for p in alive if p not in victims]
        comm.abort()
        comm = comm_for(quorum + 1, alive)
        try:
            sharded.reshard(comm, applied_step=step)
        except ShardsLostError as error:
            lost = {"shards": list(error.shards), "message": str(error)}
            (args.out / f"lost-{me}.json").write_text(json.dumps(lost))
            sys.exit(3)
        return comm, quorum + 1, alive

    comm = comm_for(quorum, alive)
    try:
        sharded.reshard(comm, applied_step=start)
    except ValueError as error:
        (args.out / f"refused-{me}.txt").write_text(str(error))
        sys.exit(5)
    step = start
    while step < args.steps:
        faults.kill_if("step_started", step)
        if args.join_at == step and not joiner:
            alive = [*alive, args.world]
            quorum += 1
            if alive.index(me) == 0:
                torch.save({n: p.detach() for n, p in model.named_parameters()}, args.out / "heal.pt")
                store.set(f"join/{step}", json.dumps({"alive": alive, "quorum": quorum}))
            comm.abort()
            comm = comm_for(quorum, alive)
            sharded.reshard(comm, applied_step=step)
        gradients(model, step)
        try:
            comm.all_gather(torch.zeros(1))  # stands for the gradient all-reduce: a step's first collective
        except CollectiveError:
            comm, quorum, alive = repair(step, comm, quorum, alive)
            step = sharded.updates  # a process behind the others (it missed the end of a step) catches up
            continue
        faults.kill_if("during_update", step)
        sharded.take_gradients()  # what the user's optimizer.step() does under the Manager
        sharded.update()
        if args.flip_at == step and me == 0:
            copy = next(rows for shard, rows in sharded.state.masters.items() if shard != sharded.rank)
            copy.view(torch.int32)[0] ^= 1  # one bit of a copy's master
        step += 1
        try:
            sharded.sync(comm, notify=lambda event, at=step - 1: faults.manager_event(event, at))
        except CopyMismatchError as error:
            (args.out / f"mismatch-{me}.txt").write_text(str(error))
            sys.exit(4)
        except CollectiveError:
            comm, quorum, alive = repair(step - 1, comm, quorum, alive)
            step = sharded.updates
    whole = sharded.gather_state(comm)  # the whole optimizer state, on the group's rank 0
    everywhere = sharded.gather_moments(comm, to_rank=None)  # and on every rank (the user's state_dict())
    result = {
        "optimizer": None if whole is None else whole["state"],
        "optimizer_everywhere": everywhere,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "rows": sharded.held_rows(),
        "layout_processes": sharded.layout.processes if sharded.layout else 0,
        "layout": sharded.layout.describe() if sharded.layout else None,
        "state_bytes": sharded.state_bytes,
        "repairs": sharded.stats.repairs,
        "rank": sharded.rank,
        "nodes": list(sharded.layout.placement.nodes) if sharded.layout else [],
    }
    torch.save(result, args.out / f"rank-{me}.pt")
    comm.abort()
