"""The lighthouse: membership, heartbeats, quorums and the ledger of record, persisted so a restart loses nothing.

``quorum`` is the pure state machine, ``persist`` its SQLite file, ``server``
the aiohttp server (:class:`Lighthouse`) and ``client`` what each worker runs
(:class:`LighthouseClient`). The wire protocol is ``docs/protocol.md``.
"""

from stalwart.coord.client import (
    HealPlan,
    LighthouseClient,
    LighthouseError,
    LighthouseUnreachable,
    QuorumAnswer,
    StoreAddress,
)
from stalwart.coord.quorum import Formation, LighthouseState, QuorumRequest, RequestError
from stalwart.coord.server import Lighthouse

__all__ = [
    "Formation",
    "HealPlan",
    "Lighthouse",
    "LighthouseClient",
    "LighthouseError",
    "LighthouseState",
    "LighthouseUnreachable",
    "QuorumAnswer",
    "QuorumRequest",
    "RequestError",
    "StoreAddress",
]
