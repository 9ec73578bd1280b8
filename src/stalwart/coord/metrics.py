"""The lighthouse's Prometheus metrics: one ``CollectorRegistry`` per lighthouse, and the hooks that feed it.

Gauges (steps committed, members by state, quorum size, samples committed)
are set from the status when ``/metrics`` is scraped; counters and histograms
are fed as things happen: history events (failures by kind, recoveries,
quorums, departures), failure quorums (samples reassigned), heartbeats
(heal totals, see :mod:`~stalwart.coord.heal_report`) and state saves
(persistence latency). Counters start at zero when a lighthouse starts, as
Prometheus counters do; ``/v1/status`` keeps the all-time counts. No I/O:
the server serves :meth:`LighthouseMetrics.exposition`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stalwart.coord.figures import MEMBER_STATES, summary
from stalwart.coord.heal_report import HEAL_FIELD, HealTotals, heal_growth, parse_heal_totals
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.wire import take_field

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("socket_closed", "heartbeat_timeout", "hung", "excluded", "restarted")
"""The ``kind`` label of ``stalwart_failures_total``: a failure's reason with ``_`` for spaces."""
QUORUM_REASONS = ("start-up", "boundary", "failure")
_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_SAVE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_HEALS_PER_REPORT = 64
"""Most heals one heartbeat's totals may add (each is one histogram observation: the work per message is bounded)."""
_REASSIGN_MEMORY = 4
"""How many steps back the record of counted reassigns reaches (a rollback goes back one)."""


def failure_kind(reason: str) -> str:
    """The ``kind`` label of a failure ``reason`` (``socket closed`` -> ``socket_closed``)."""
    return reason.replace(" ", "_")


class LighthouseMetrics:
    """The metrics of one lighthouse, in a registry of their own (several lighthouses may share a process)."""

    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry()
        self.steps_committed = Gauge("stalwart_steps_committed", "Steps the ledger has committed.", registry=registry)
        self.epoch = Gauge("stalwart_epoch", "The ledger's epoch.", registry=registry)
        self.members = Gauge("stalwart_members", "Members known, by state.", ["state"], registry=registry)
        self.quorum_size = Gauge("stalwart_quorum_size", "Members of the current quorum.", registry=registry)
        self.quorum_id = Gauge("stalwart_quorum_id", "The current quorum (0 before the first).", registry=registry)
        self.samples_committed = Gauge(
            "stalwart_samples_committed", "Samples in committed steps since the job began.", registry=registry
        )
        self.failures = Counter("stalwart_failures", "Member failures, by kind.", ["kind"], registry=registry)
        self.quorums = Counter("stalwart_quorums", "Quorums formed, by reason.", ["reason"], registry=registry)
        self.departures = Counter("stalwart_departures", "Members that left cleanly.", registry=registry)
        self.checkpoint_resumes = Counter(
            "stalwart_checkpoint_resumes", "Rollbacks of the ledger to a checkpoint.", registry=registry
        )
        self.recovery_seconds = Histogram(
            "stalwart_recovery_seconds",
            "Seconds from a quorum member's failure to the next quorum.",
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.samples_reassigned = Counter(
            "stalwart_samples_reassigned", "Samples of failed members handed to survivors in the same step.",
            registry=registry,
        )  # fmt: skip
        self.heals = Counter("stalwart_heals", "Heals that members loaded (their reports).", registry=registry)
        self.heal_bytes = Counter("stalwart_heal_bytes", "Bytes of state loaded by healed members.", registry=registry)
        self.heal_seconds = Histogram(
            "stalwart_heal_seconds", "Seconds a heal took, as its target measured it.", buckets=_SECONDS_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.persist_seconds = Histogram(
            "stalwart_persist_seconds", "Seconds a save of the lighthouse's state took (SQLite, on its thread).",
            buckets=_SAVE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.quorum_requests = Counter(
            "stalwart_quorum_requests", "Quorum requests answered, by how they came: heartbeat socket or POST.",
            ["via"], registry=registry,
        )  # fmt: skip
        for via in ("socket", "post"):
            self.quorum_requests.labels(via=via)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        for reason in QUORUM_REASONS:
            self.quorums.labels(reason=reason)
        self._heal_totals: dict[str, tuple[str | None, HealTotals]] = {}
        """Each member's last heal totals, with the incarnation that sent them."""
        self._reassigns_counted: set[tuple[int, int]] = set()

    # --- hooks ------------------------------------------------------------------------------------

    def on_history_event(self, kind: str, event: Mapping[str, Any]) -> None:
        """A history event was recorded (``History.listener``)."""
        if kind == "failures":
            self.failures.labels(kind=failure_kind(str(event["reason"]))).inc()
        elif kind == "recoveries":
            self.recovery_seconds.observe(max(0.0, float(event["seconds"])))
        elif kind == "quorums":
            self.quorums.labels(reason=str(event["reason"])).inc()
        elif kind == "departures":
            self.departures.inc()
        elif kind == "checkpoint_resumes":
            self.checkpoint_resumes.inc()

    def on_formation(self, reason: str, hosted: HostedLedger) -> None:
        """A quorum formed; a failure quorum's reassigned samples are counted once per failure of a step.

        ``hosted`` is the ledger of record right after it formed; a failure quorum's counts are read from it
        (:meth:`~stalwart.coord.hosted_ledger.HostedLedger.lost_per_failure`), no other quorum's.
        """
        if reason != "failure":
            return
        step, lost = hosted.lost_per_failure()
        for number, count in enumerate(lost):
            if (step, number) not in self._reassigns_counted:
                self._reassigns_counted.add((step, number))
                self.samples_reassigned.inc(count)
        self._reassigns_counted = {key for key in self._reassigns_counted if key[0] > step - _REASSIGN_MEMORY}

    def take_heal_report(self, member: str, incarnation: str | None, report: Any) -> str | None:
        """Remove a heartbeat's ``heal`` field from ``report`` and count what it adds; the error text if malformed.

        A malformed field is dropped (the heartbeat itself still counts) and logged.
        """
        totals, error = take_field(report, HEAL_FIELD, parse_heal_totals, member, logger)
        if totals is None:
            return error
        previous = self._heal_totals.get(member)
        growth = heal_growth(previous[1] if previous is not None and previous[0] == incarnation else None, totals)
        if growth is None:
            return None
        self._heal_totals[member] = (incarnation, totals)
        if growth.heals > MAX_HEALS_PER_REPORT:
            # not believable (a member loads one heal per quorum it joins): the totals become the new baseline
            message = (
                f"heal['heals'] grew by {growth.heals} since the last heartbeat; at most {MAX_HEALS_PER_REPORT} "
                "are counted between two heartbeats: this report is not"
            )
            logger.warning("member %s: %s", member, message)
            return message
        self.heals.inc(growth.heals)
        self.heal_bytes.inc(growth.bytes)
        for _ in range(growth.heals):
            self.heal_seconds.observe(growth.seconds / growth.heals)
        return None

    def on_save(self, seconds: float) -> None:
        """A state save took ``seconds``."""
        self.persist_seconds.observe(seconds)

    # --- scrape -----------------------------------------------------------------------------------

    def exposition(self, status: Mapping[str, Any]) -> bytes:
        """The Prometheus text exposition, its gauges set from ``status`` (``/v1/status``'s JSON)."""
        figures = summary(status)
        self.steps_committed.set(figures["steps_committed"])
        self.epoch.set(figures["epoch"])
        for state in MEMBER_STATES:
            self.members.labels(state=state).set(figures["members"].get(state, 0))
        self.quorum_size.set(figures["quorum_size"])
        self.quorum_id.set(figures["quorum_id"] or 0)
        self.samples_committed.set(figures["samples_committed"])
        return generate_latest(self.registry)
