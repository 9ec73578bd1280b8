"""Simulated members' heartbeat reports against a real lighthouse: the step and the digest a Manager would send."""

from __future__ import annotations

from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.protocol import QuorumAnswer

_ANSWERS: dict[str, QuorumAnswer] = {}


def remember(answer: QuorumAnswer) -> QuorumAnswer:
    """Keep ``answer`` as its member's latest, for :func:`report`; returns it."""
    _ANSWERS[answer.member] = answer
    return answer


def report(member: str, step: int) -> tuple[int, str | None]:
    """A simulated member's heartbeat report: ``step`` and the digest of its ledger after running up to it.

    The member adopted its latest remembered answer's ledger and ran every
    step since with that quorum, as the Manager does; no digest at or below
    the answer's step (nothing to commit).
    """
    answer = _ANSWERS.get(member)
    if answer is None or step <= answer.applied_step:
        return step, None
    ledger = answer.data_ledger()
    while ledger.step < step:
        if not ledger.in_step:
            ledger.begin_step(list(answer.members))
        ledger.commit()
    return step, ledger_digest(ledger.state_dict())
