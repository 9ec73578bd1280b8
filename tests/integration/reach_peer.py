"""One rank of test_reach_netns's group, run inside a network namespace; prints one JSON line of what happened.

``reach_peer.py RANK WORLD HOST STORE_HOST STORE_PORT RENDEZVOUS_TIMEOUT``: a
probe listener on HOST, a Gloo rendezvous over the TCPStore at
STORE_HOST:STORE_PORT, and after a failure the probe of every peer that came.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from stalwart.runtime.comm import CollectiveError, Communicator, arrivals
from stalwart.runtime.probe import ProbeListener, probe


def main(rank: int, world: int, host: str, store_host: str, store_port: int, rendezvous_timeout: float) -> None:
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    listener = ProbeListener(host)
    started = time.monotonic()
    report: dict[str, object] = {"rank": rank}
    try:
        Communicator(
            store,
            rank,
            world,
            timeout=60.0,
            device=torch.device("cpu"),
            host=host,
            rendezvous_timeout=rendezvous_timeout,
            reach=listener.address,
        )
        report["connected"] = True
    except CollectiveError as error:
        seconds = time.monotonic() - started
        report.update(connected=False, seconds=seconds, error=str(error), failure=error.failure.value)
        came = arrivals(store, world) or {}
        found = probe({peer: address for peer, address in came.items() if peer != rank})
        report["probes"] = {str(peer): reach.value for peer, reach in found.items()}
    print(json.dumps(report), flush=True)
    time.sleep(2)  # its listener stays up while the peers probe it
    listener.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
