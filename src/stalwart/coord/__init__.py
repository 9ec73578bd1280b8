"""The lighthouse: membership, heartbeats, quorums and the ledger of record, persisted so a restart loses nothing.

``quorum`` is the pure state machine (its parts in modules of their own),
``persist`` its SQLite file, ``server`` the aiohttp server (:class:`Lighthouse`,
configured by a :class:`LighthouseSettings` of ``settings``),
``store`` the quorum store it serves, and ``client`` what each worker runs
(:class:`LighthouseClient`). ``protocol`` types the wire, which
``docs/protocol.md`` describes.

The public names below are imported on first use (PEP 562): a worker, which
needs the client, does not pay for importing the server (aiohttp's web
framework, SQLite).
"""

from __future__ import annotations

from stalwart._exports import lazy_exports

_LOCATIONS: dict[str, str] = {
    "Formation": "stalwart.coord.quorum",
    "HealPlan": "stalwart.coord.client",
    "Lighthouse": "stalwart.coord.server",
    "LighthouseClient": "stalwart.coord.client",
    "LighthouseError": "stalwart.errors",
    "LighthouseSettings": "stalwart.coord.settings",
    "LighthouseState": "stalwart.coord.quorum",
    "LighthouseUnreachable": "stalwart.errors",
    "QuorumAnswer": "stalwart.coord.client",
    "QuorumRequest": "stalwart.coord.quorum",
    "RequestError": "stalwart.coord.quorum",
    "StoreAddress": "stalwart.coord.client",
}
"""Public name -> the module of this package that defines it."""

__all__ = sorted(_LOCATIONS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LOCATIONS)
