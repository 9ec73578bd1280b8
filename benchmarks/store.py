"""What the authenticated quorum store costs, against the open TCPStore the lighthouse used to host.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.store                         # 2 and 4 workers, 4 rounds each, a 100 MB heal
    python -m benchmarks.store --workers 2 --rounds 2  # a quick look

A lighthouse (with a token) runs in this process and ``--workers`` worker
processes, each a real ``LighthouseClient`` holding a 100 MB model. Each round
every worker asks for the next quorum (one ``reconfigure`` each: a boundary
quorum forms), then, on the round's store, writes its ``group_size``,
``layout`` and ``data`` keys and reads every member's ``group_size`` (what a
session's connect does), builds the quorum's Gloo group and all-reduces once
(quorum formation), and heals: rank 0 broadcasts its whole state, the JSON
metadata through the store and 100 MB of tensors over the group, to every
other rank (``transfer_state``). The round's store is, in turn, the quorum's
authenticated store on the lighthouse (``quorum_store``: every request a
``POST /v1/store/{quorum_id}`` with the bearer token and the quorum's key) and
a ``TCPStore`` under a fresh prefix, what the lighthouse hosted before and
what a user would pick instead. Each round runs both, in an order that
alternates (interleaved, so the machine's load falls on both alike); the table shows the median over the
rounds of the slowest worker, the spread (min-max), and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import time
from multiprocessing.queues import Queue
from typing import Any

from benchmarks._measure import make_console, print_table
from benchmarks._rounds import fixed, interleaved_rounds, median_span

HOST = "127.0.0.1"
TOKEN = "store-benchmark-token"
TIMEOUT = 120.0
KINDS = ("lighthouse", "tcpstore")
FEATURES = 5000
"""A Linear(5000, 5000): 25 M float32 parameters, 100 MB."""


def _worker(rank: int, url: str, tcp_port: int, commands: Queue[Any], results: Queue[Any]) -> None:
    """One worker: on each command, ask for a quorum, rendezvous on the command's store and heal."""
    import torch
    import torch.distributed as dist

    from stalwart.coord.client import LighthouseClient
    from stalwart.runtime.comm import Communicator, quorum_store
    from stalwart.runtime.heal import transfer_state

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    model = torch.nn.Linear(FEATURES, FEATURES)
    client = LighthouseClient(url, f"w{rank}", token=TOKEN, heartbeat_interval=0.05)
    client.start_heartbeat(lambda: 0)
    answer = None
    try:
        while (command := commands.get(timeout=TIMEOUT * 4)) is not None:
            number, kind = command
            started = time.perf_counter()
            quorum_id = None if answer is None else answer.quorum_id
            answer = client.quorum(0, quorum_id, "join" if answer is None else "reconfigure", TIMEOUT)
            asked = time.perf_counter()
            if kind == "lighthouse":
                store = quorum_store(answer.store, TIMEOUT, token=TOKEN)
            else:
                tcp = dist.TCPStore(HOST, tcp_port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))
                store = dist.PrefixStore(f"round-{number}/", tcp)
            member = answer.members[answer.rank]
            for key in ("group_size", "layout", "data"):
                store.set(f"{key}/{member}", "1")
            for other in answer.members:
                store.get(f"group_size/{other}")
            comm = Communicator(store, answer.rank, answer.world_size, timeout=TIMEOUT, device=torch.device("cpu"))
            comm.start_all_reduce_sum(torch.zeros(1))()
            formed = time.perf_counter()
            transfer_state(comm, 0, {"model": model}, 0, is_target=answer.rank != 0, key=f"heal/{number}")
            healed = time.perf_counter()
            comm.abort()
            results.put((rank, number, kind, asked - started, formed - asked, healed - formed))
    finally:
        client.close()


def run(workers: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per store kind, per phase (``ask``, ``rendezvous``, ``heal``), the slowest worker's seconds of each round."""
    import torch.distributed as dist

    from stalwart.coord.server import Lighthouse
    from stalwart.data.plan import EpochPlan

    context = multiprocessing.get_context("spawn")
    tcp = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    times: dict[str, dict[str, list[float]]] = {kind: {"ask": [], "rendezvous": [], "heal": []} for kind in KINDS}
    with Lighthouse(EpochPlan(1024, 64), min_replicas=workers, token=TOKEN, join_timeout=30.0) as lighthouse:
        commands = [context.Queue() for _ in range(workers)]
        results: Queue[Any] = context.Queue()
        processes = [
            context.Process(target=_worker, args=(rank, lighthouse.url, tcp.port, commands[rank], results))
            for rank in range(workers)
        ]
        for process in processes:
            process.start()
        try:

            def measure(kind: str, number: int) -> list[tuple[Any, ...]]:
                for queue in commands:
                    queue.put((number, kind))
                return [results.get(timeout=TIMEOUT * 4) for _ in range(workers)]

            # the warm-up round: the first join, imports, allocations
            for kind, rounds_of_kind in interleaved_rounds(KINDS, rounds, measure, warmup=1).items():
                for per_worker in rounds_of_kind:
                    for phase, column in (("ask", 3), ("rendezvous", 4), ("heal", 5)):
                        times[kind][phase].append(max(result[column] for result in per_worker))
        finally:
            for queue in commands:
                queue.put(None)
            for process in processes:
                process.join(60)
                if process.is_alive():
                    process.kill()
    return times


def _cell(values: list[float]) -> str:
    return median_span(values, fixed(1, 1e3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of both stores per worker count")
    args = parser.parse_args()
    console = make_console()
    rows = []
    for workers in args.workers:
        times = run(workers, args.rounds)
        ours, theirs = times["lighthouse"], times["tcpstore"]
        for phase, label in (
            ("ask", "quorum request answered"),
            ("rendezvous", "store keys + Gloo group + all-reduce"),
            ("heal", "heal of 100 MB (metadata + broadcast)"),
        ):
            ratio = statistics.median(ours[phase]) / statistics.median(theirs[phase])
            rows.append([str(workers), label, _cell(ours[phase]), _cell(theirs[phase]), f"{ratio:.2f}"])
        formation = [a + r for a, r in zip(ours["ask"], ours["rendezvous"], strict=True)]
        baseline = [a + r for a, r in zip(theirs["ask"], theirs["rendezvous"], strict=True)]
        ratio = statistics.median(formation) / statistics.median(baseline)
        rows.append([str(workers), "quorum formation (request + rendezvous)", _cell(formation), _cell(baseline),
                     f"{ratio:.2f}"])  # fmt: skip
    print_table(
        console,
        "The authenticated quorum store against an open TCPStore (ms: median of the slowest worker, min-max)",
        ["workers", "phase", "authenticated store", "TCPStore", "ratio"],
        rows,
        caption=f"{args.rounds} rounds of both stores per worker count, interleaved; the quorum request itself "
        "does not touch the store (both columns measure the same thing there).",
    )


if __name__ == "__main__":
    main()
