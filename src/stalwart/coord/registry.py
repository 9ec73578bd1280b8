"""Who may register as which member: the identities, the rules a registration must pass, and their rate.

The lighthouse's identity part (``LighthouseState.registry``). A registration
is refused, and nothing changes, when the member trains with another plan
than the lighthouse's (409 ``plan_mismatch``, or ``no_plan`` when neither
side has one), when ``max_members`` live members are registered (429), when
it would replace a live incarnation without that incarnation's secret (409
``member_alive``, with ``retry_after``: the time until the live one is dead
by heartbeat if it stays silent), or when registrations come faster than
their rate (429 ``rate_limited``). The identities themselves (secrets as
hashes, replaced and departed incarnations) are :mod:`~stalwart.coord.identity`.
Pure: no I/O; time is passed as ``now``.
"""

from __future__ import annotations

from stalwart.coord.identity import Identities, RegistrationRate
from stalwart.coord.membership import Membership
from stalwart.coord.wire import RequestError, plan_differences
from stalwart.data.plan import EpochPlan

NO_PLAN = (
    "the lighthouse has no plan and the member offered none: start the lighthouse with --dataset-size and "
    "--global-batch, or give the Manager the plan (LighthouseClient(plan=...))"
)


class Registry:
    """The identities of every member and the rules (and rate) new registrations must pass."""

    def __init__(self, max_members: int, heartbeat_timeout: float) -> None:
        self.max_members = max_members
        self.heartbeat_timeout = heartbeat_timeout
        self.identities = Identities()
        self.rate = RegistrationRate(max(64, max_members), max(16.0, max_members / 10))
        """At most ``max(64, max_members)`` registrations at once, then a tenth of that a second (at least 16)."""

    def admit(
        self,
        member: str,
        incarnation: str,
        now: float,
        membership: Membership,
        plans: tuple[EpochPlan | None, EpochPlan | None],
        current: tuple[object, object] | None,
    ) -> None:
        """Refuse (``RequestError``) a registration of ``incarnation`` of ``member`` that breaks a rule; ``plans``
        is the lighthouse's and the member's, ``current`` the live incarnation's identity if the caller gave it."""
        check_plan(member, *plans)
        if member not in self.identities and not membership.alive(member) and membership.live >= self.max_members:
            raise RequestError(
                429,
                f"max_members={self.max_members} live members are registered: member {member!r} is refused",
                field="member",
                cap="max_members",
            )
        self._check_replacement(member, incarnation, now, membership, current)
        self.rate.take(now)

    def incarnation(self, member: str) -> str | None:
        """The registered incarnation of ``member`` (None if none)."""
        identity = self.identities.current.get(member)
        return None if identity is None else identity.incarnation

    def _check_replacement(
        self, member: str, incarnation: str, now: float, membership: Membership, current: tuple[object, object] | None
    ) -> None:
        """409 ``member_alive`` for a new incarnation of a live member that does not prove the live one's secret."""
        identity = self.identities.current.get(member)
        if identity is None or identity.left or identity.incarnation == incarnation or not membership.alive(member):
            return
        if incarnation in self.identities.retired.get(member, ()):
            return  # a replaced process: refused as superseded by the identities
        if current is not None:
            self.identities.check(member, *current)
            return
        record = membership[member]
        raise RequestError(
            409,
            f"member {member!r} is alive as incarnation {identity.incarnation}: a new process may register once it "
            "is dead by heartbeat (or with the live incarnation's headers)",
            code="member_alive",
            member=member,
            retry_after=round(max(0.0, record.last_seen + self.heartbeat_timeout - now), 3),
        )


def check_plan(member: str, ours: EpochPlan | None, plan: EpochPlan | None) -> None:
    """Refuse (409) a plan that differs from the lighthouse's, or a registration when neither side has one."""
    if ours is None and plan is None:
        raise RequestError(409, NO_PLAN, code="no_plan", member=member)
    if ours is None or plan is None or plan == ours:
        return
    differences = plan_differences(ours, plan)
    listed = "; ".join(
        f"{name}: lighthouse {values['lighthouse']!r}, member {values['member']!r}"
        for name, values in differences.items()
    )
    raise RequestError(
        409,
        f"member {member!r} trains with another plan than the lighthouse's ({listed}): every member and "
        "the lighthouse must use the same plan",
        code="plan_mismatch",
        member=member,
        differences=differences,
    )
