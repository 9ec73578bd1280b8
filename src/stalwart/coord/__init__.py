"""The lighthouse: membership, heartbeats, quorums and the ledger of record, persisted so a restart loses nothing.

``quorum`` is the pure state machine (its parts in modules of their own),
``persist`` its SQLite file, ``server`` the aiohttp server (:class:`Lighthouse`,
configured by a :class:`LighthouseSettings` of ``settings``),
``store`` the quorum store it serves, and ``client`` what each worker runs
(:class:`LighthouseClient`). ``protocol`` types the wire, which
``docs/protocol.md`` describes.
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
from stalwart.coord.settings import LighthouseSettings

__all__ = [
    "Formation",
    "HealPlan",
    "Lighthouse",
    "LighthouseClient",
    "LighthouseError",
    "LighthouseSettings",
    "LighthouseState",
    "LighthouseUnreachable",
    "QuorumAnswer",
    "QuorumRequest",
    "RequestError",
    "StoreAddress",
]
