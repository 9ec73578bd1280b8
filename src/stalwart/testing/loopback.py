"""Loopback endpoints for tests and benchmarks: a free port, and a rendezvous store without a lighthouse."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def prefix_store(host: str, port: int, prefix: str, timeout: float) -> dist.PrefixStore:
    """Keys under ``prefix`` of the caller's own ``TCPStore`` at ``host:port``: a rendezvous without a lighthouse."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(prefix, store)
