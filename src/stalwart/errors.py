""":class:`StalwartError`, the base of every error stalwart raises, and the errors more than one layer raises.

Every public error class derives from :class:`StalwartError` and from the
builtin exception a caller would expect of it (``ValueError`` for a
configuration that does not fit, ``RuntimeError`` for a job that cannot go
on), so ``except ValueError`` keeps working. An error that one module alone
raises is defined next to what raises it; every one of them is imported from
one place, the ``stalwart`` package (``from stalwart import CollectiveError``;
``tests/unit/test_errors.py`` checks both rules for every module). This
module imports nothing of stalwart, so every layer (data, coord, runtime) raises from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "InsecureLighthouseError",
    "JobFinishedError",
    "JoinError",
    "LighthouseError",
    "LighthouseUnreachable",
    "PlanMismatchError",
    "ShardingMismatchError",
    "StalwartError",
    "StateLostError",
    "StepContractError",
]


class StalwartError(Exception):
    """The base of every error stalwart raises: ``except StalwartError`` catches them all."""


class JoinError(StalwartError, RuntimeError):
    """This member could not get into a working quorum within ``max_join_attempts`` attempts."""


class StateLostError(StalwartError, RuntimeError):
    """No live member holds the job's state and the lighthouse has no checkpoint to resume from."""


class JobFinishedError(StalwartError, RuntimeError):
    """This worker joined after the job had committed its last step, and no checkpoint holds the trained state.

    Raised instead of returning an untrained model, so that a script cannot
    save one by mistake; with a checkpoint directory the late joiner loads the
    final checkpoint instead and ``manager.steps()`` simply yields nothing.
    """


class PlanMismatchError(StalwartError, ValueError):
    """The lighthouse's plan does not fit this worker's data or its own plan (for example another dataset length)."""


class ShardingMismatchError(StalwartError, ValueError):
    """This replica group shards its model differently from the group it must match (FSDP2 groups)."""


class StepContractError(StalwartError, RuntimeError):
    """The loop broke the step's contract: ``optimizer.step()`` outside a reduced step, a step not iterated."""


class InsecureLighthouseError(StalwartError, ValueError):
    """A lighthouse on a non-loopback address without a token: anyone on the network could drive the job."""


class LighthouseError(StalwartError, RuntimeError):
    """The lighthouse refused a request: ``status`` and the JSON ``body`` (``body["error"]`` says why)."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(f"lighthouse answered {status}: {body.get('error', body)}")
        self.status = status
        self.body = dict(body)


class LighthouseUnreachable(StalwartError, ConnectionError):
    """Nothing answered at the lighthouse's address within the time allowed (the message names both)."""
