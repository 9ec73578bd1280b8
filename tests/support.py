"""Helpers shared by the tests: bounded waiting, simulated members' reports, a plain TCPStore view."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 20 ms until it is truthy; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.02)):
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


_ANSWERS: dict[str, Any] = {}


def remember(answer: Any) -> Any:
    """Keep ``answer`` (a ``QuorumAnswer``) as its member's latest, for :func:`report`; returns it."""
    _ANSWERS[answer.member] = answer
    return answer


def report(member: str, step: int) -> tuple[int, str | None]:
    """A simulated member's heartbeat report: ``step`` and the digest of its ledger after running up to it.

    The member adopted its latest remembered answer's ledger and ran every
    step since with that quorum, as the Manager does; no digest at or below
    the answer's step (nothing to commit).
    """
    from stalwart.coord.hosted_ledger import ledger_digest

    answer = _ANSWERS.get(member)
    if answer is None or step <= answer.applied_step:
        return step, None
    ledger = answer.data_ledger()
    while ledger.step < step:
        if not ledger.in_step:
            ledger.begin_step(list(answer.members))
        ledger.commit()
    return step, ledger_digest(ledger.state_dict())


def prefix_store(host: str, port: int, prefix: str, timeout: float) -> Any:
    """Keys under ``prefix`` of the test's own ``TCPStore`` at ``port``: a rendezvous without a lighthouse."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(prefix, store)
