"""The liveness rule of :mod:`stalwart.coord.membership`, over random sighting sequences (pure, ``now`` passed).

Silence is a death only when the lighthouse heard another member after the
silent one's deadline; when every member goes silent together the lighthouse
is the one cut off and waits (up to ``outage_timeout``) for them to come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stalwart.coord.membership import Membership
from stalwart.coord.quorum import LighthouseState, RequestError
from stalwart.data.plan import EpochPlan

TIMEOUT = 1.0
OUTAGE = 10.0
TICK = 0.05
MEMBERS = ("a", "b", "c")


@dataclass
class Run:
    """A membership driven by a time-ordered list of events; records every expiry and every sighting."""

    membership: Membership = field(default_factory=lambda: Membership(TIMEOUT, OUTAGE))
    sightings: list[tuple[float, str]] = field(default_factory=list)
    deaths: list[tuple[float, str]] = field(default_factory=list)

    def see(self, member: str, now: float) -> None:
        self.membership.touch(member, now)
        self.sightings.append((now, member))

    def tick(self, now: float) -> list[str]:
        expired = self.membership.expired(now)
        for member in expired:
            self.membership.mark_dead(member)
            self.deaths.append((now, member))
        return expired

    def play(self, events: list[tuple[float, str | None]]) -> None:
        """``(time, member)`` is a sighting, ``(time, None)`` a tick; sorted by time, ticks after sightings."""
        for now, member in sorted(events, key=lambda event: (event[0], event[1] is None)):
            if member is None:
                self.tick(now)
            else:
                self.see(member, now)


def ticks(start: float, end: float) -> list[tuple[float, str | None]]:
    """The lighthouse's periodic ticks from ``start`` to ``end``."""
    count = int((end - start) / TICK) + 1
    return [(start + i * TICK, None) for i in range(count)]


def beats(member: str, start: float, end: float, interval: float, phase: float) -> list[tuple[float, str | None]]:
    """``member``'s heartbeats every ``interval`` from ``start + phase`` while before ``end``."""
    times = []
    now = start + phase
    while now < end:
        times.append((now, member))
        now += interval
    return times


intervals = st.floats(0.05, 0.3 * TIMEOUT)
phases = st.floats(0.0, 0.05)


@settings(max_examples=60, deadline=None)
@given(
    interval=intervals,
    phase=st.tuples(phases, phases, phases),
    outage_start=st.floats(0.5, 3.0),
    outage=st.floats(1.5 * TIMEOUT, OUTAGE - 2 * TIMEOUT),
    comeback=st.tuples(*[st.floats(0.0, 0.9 * TIMEOUT)] * 3),
)
def test_an_outage_of_the_lighthouse_is_no_failure(
    interval: float,
    phase: tuple[float, float, float],
    outage_start: float,
    outage: float,
    comeback: tuple[float, float, float],
) -> None:
    """Every member reports until the lighthouse is cut off, nothing reaches it for longer than the heartbeat
    timeout, then each comes back within a heartbeat timeout of the first: nobody is ever dead."""
    outage_end = outage_start + outage
    first = min(comeback)
    end = outage_end + first + 3 * TIMEOUT
    events = ticks(0.0, end)
    for member, offset, back in zip(MEMBERS, phase, comeback, strict=True):
        events += beats(member, 0.0, outage_start, interval, offset)
        events += beats(member, outage_end + back, end, interval, 0.0)
    run = Run()
    run.play(events)
    assert run.deaths == []
    assert run.membership.live == len(MEMBERS)


@settings(max_examples=60, deadline=None)
@given(
    interval=intervals,
    phase=st.tuples(phases, phases, phases),
    stops=st.floats(0.2, 3.0),
    outage_start=st.one_of(st.none(), st.floats(0.5, 4.0)),
    outage=st.floats(1.5 * TIMEOUT, 4.0),
)
def test_a_member_silent_while_others_report_dies_after_the_first_report_past_its_deadline(
    interval: float,
    phase: tuple[float, float, float],
    stops: float,
    outage_start: float | None,
    outage: float,
) -> None:
    """A hung member (its socket open, nothing sent) is dead at the first tick after another member was heard
    past its deadline, never before its deadline; the others live, across an outage of the lighthouse too."""
    end = 12.0
    events = ticks(0.0, end)
    silent, *talkers = MEMBERS
    events += beats(silent, 0.0, stops, interval, phase[0])
    for member, offset in zip(talkers, phase[1:], strict=True):
        events += beats(member, 0.0, end, interval, offset)
    if outage_start is not None:  # nothing reaches the lighthouse for a while (the silent member is silent anyway)
        events = [e for e in events if e[1] is None or not outage_start <= e[0] < outage_start + outage]
    run = Run()
    run.play(events)
    assert [member for _, member in run.deaths] == [silent]
    died = run.deaths[0][0]
    last_seen = max(t for t, m in run.sightings if m == silent)
    assert died - last_seen > TIMEOUT
    evidence = [t for t, m in run.sightings if m != silent and t > last_seen + TIMEOUT and t <= died]
    assert evidence, "it died though nobody was heard after its deadline"
    if outage_start is None:
        first_evidence = min(t for t, m in run.sightings if m != silent and t > last_seen + TIMEOUT)
        assert died <= first_evidence + TICK + 1e-9, "it must die at the first tick after the evidence"


@settings(max_examples=40, deadline=None)
@given(interval=intervals, phase=st.tuples(phases, phases, phases), silent_from=st.floats(0.2, 2.0))
def test_a_lighthouse_that_hears_nobody_waits_outage_timeout_then_counts_the_silent_dead(
    interval: float, phase: tuple[float, float, float], silent_from: float
) -> None:
    """Nobody is heard after ``silent_from``: no member dies before ``outage_timeout`` of silence, each dies at
    the first tick after it."""
    end = silent_from + OUTAGE + 1.0
    events = ticks(0.0, end)
    for member, offset in zip(MEMBERS, phase, strict=True):
        events += beats(member, 0.0, silent_from, interval, offset)
    run = Run()
    run.play(events)
    assert sorted(member for _, member in run.deaths) == sorted(MEMBERS)
    assert run.membership.cut_off_since is not None
    for died, member in run.deaths:
        last_seen = max(t for t, m in run.sightings if m == member)
        assert OUTAGE < died - last_seen <= OUTAGE + TICK + 1e-9


events_anyhow = st.lists(
    st.tuples(st.floats(0.0, 0.8), st.sampled_from((*MEMBERS, None))), min_size=1, max_size=80
).map(
    lambda steps: [
        (sum(gap for gap, _ in steps[: i + 1]), member) for i, (_, member) in enumerate(steps)
    ]  # times: running sums of the gaps
)


@settings(max_examples=200, deadline=None)
@given(events=events_anyhow)
@example(
    events=[
        (0.5, "a"),
        (1.0196078956953796, "a"),
        (1.5196078956953796, "b"),
        (2.01960789569538, "b"),
        (2.01960789569538, None),
    ]
)
def test_whatever_the_sequence_a_death_has_evidence_or_outlasted_the_bound(
    events: list[tuple[float, str | None]],
) -> None:
    """Any sightings and ticks: a member dies only past its deadline, and only if another member was heard after
    it or its silence outlasted ``outage_timeout``; after any tick no live member was silent longer than that."""
    run = Run()
    for now, member in events:
        if member is not None:
            run.see(member, now)
            continue
        for dead in run.tick(now):
            last_seen = max(t for t, m in run.sightings if m == dead)
            assert now - last_seen > TIMEOUT
            # the rule's own arithmetic (a difference, not a sum: 1.0196... + 1.0 may round to a later sighting)
            heard_after = any(m != dead and t - last_seen > TIMEOUT and t <= now for t, m in run.sightings)
            assert heard_after or now - last_seen > OUTAGE
        for name, record in run.membership.records.items():
            if record.alive:
                assert now - record.last_seen <= OUTAGE, f"{name} outlived the outage bound"


def test_a_restarted_lighthouse_gives_expected_members_a_heartbeat_timeout_whatever_it_hears() -> None:
    membership = Membership(TIMEOUT, OUTAGE)
    membership.expect("a", 10.0)
    membership.expect("b", 10.0)
    membership.touch("a", 10.5)
    assert membership.expired(10.0 + TIMEOUT) == []
    assert membership.expired(10.0 + TIMEOUT + 0.1) == ["b"]


def test_the_outage_bound_is_at_least_the_heartbeat_timeout() -> None:
    assert Membership(2.0, 1.0).outage_timeout == 2.0


def test_a_lighthouse_whose_loop_stood_still_reads_the_waiting_heartbeats_before_judging() -> None:
    """A stopped lighthouse (SIGSTOP) resumes: it reads the first members' heartbeats, then its tick excuses the
    time it stood still: the member whose heartbeat it has not read yet is not dead."""
    run = Run()
    run.play(ticks(0.0, 1.0) + [beat for member in MEMBERS for beat in beats(member, 0.0, 1.0, 0.1, 0.0)])
    resumed = 1.0 + 3 * TIMEOUT
    run.see("a", resumed)
    run.see("b", resumed)
    run.membership.excuse(resumed - 1.0, resumed)
    assert run.tick(resumed) == []
    run.see("c", resumed + 0.01)
    assert run.tick(resumed + 2 * TIMEOUT) == [] and run.membership.live == 3


def test_a_new_process_registering_is_heard_so_the_hung_old_one_dies_by_heartbeat() -> None:
    """The job's only member hangs (its socket open): the lighthouse hears nobody and waits; a new process of the
    member registering is heard (the lighthouse's network works), so the old one is dead a heartbeat timeout later
    and the new one registers, well before ``outage_timeout``."""
    state = LighthouseState(EpochPlan(64, 8), heartbeat_timeout=TIMEOUT, outage_timeout=OUTAGE)
    old, new = "1" * 32, "2" * 32
    state.register("a", old, 0.0)
    now = 0.0
    for now in (t for t, _ in ticks(0.0, 3.0)):
        state.tick(now)
    assert state.membership.alive("a") and state.membership.cut_off_since is not None
    registered = None
    while registered is None and now < OUTAGE / 2:
        now += TICK
        state.tick(now)
        try:
            registered = state.register("a", new, now)
        except RequestError as refused:
            assert refused.details["code"] == "member_alive"
    assert registered is not None and now <= 3.0 + 2 * TIMEOUT + 2 * TICK
    assert [(f["member"], f["reason"]) for f in state.failures] == [("a", "heartbeat timeout")]


def test_a_member_one_step_behind_when_the_lighthouse_is_cut_off_is_not_hung() -> None:
    """Heartbeats lag fast steps, so at any moment a member may look one step behind; an outage longer than the
    patience must not make it hung, nor must the first reports after it (the others' are on their way)."""
    run = Run()
    run.play(ticks(0.0, 1.0) + [beat for member in MEMBERS for beat in beats(member, 0.0, 1.0, 0.1, 0.0)])
    membership = run.membership
    for member, step in zip(MEMBERS, (5, 4, 5), strict=True):
        membership[member].report(step)

    def hung(now: float) -> list[str]:
        return membership.hung(MEMBERS, lambda m: True, lambda m: False, now, patience=1.0)

    for now, _ in ticks(1.0, 1.0 + 4 * TIMEOUT):
        assert run.tick(now) == [] and hung(now) == []
    back = 1.0 + 4 * TIMEOUT
    run.see("a", back)
    membership["a"].report(9)
    for now, _ in ticks(back, back + 0.5):
        assert run.tick(now) == [] and hung(now) == []
    for member in ("b", "c"):
        run.see(member, back + 0.5)
        membership[member].report(9)
    assert hung(back + 3.0) == [] and membership.live == len(MEMBERS)


def test_a_socket_closed_to_reconnect_is_no_death_a_socket_closed_otherwise_is() -> None:
    state = LighthouseState(EpochPlan(64, 8), heartbeat_timeout=TIMEOUT, outage_timeout=OUTAGE)
    state.register("a", "1" * 32, 0.0)
    state.register("b", "2" * 32, 0.0)
    state.connected("a", 0.1)
    state.connected("b", 0.1)
    state.disconnected("a", 0.2, reconnecting=True)
    state.disconnected("b", 0.2)
    assert state.membership.alive("a") and not state.membership["a"].connected
    assert [(f["member"], f["reason"]) for f in state.failures] == [("b", "socket closed")]


def test_a_stale_socket_closing_after_an_outage_is_no_death_a_fresh_one_closing_is() -> None:
    """After the lighthouse's link was down, the reset of a socket its member gave up meanwhile arrives when the link
    returns: its member was silent past the heartbeat timeout, so the close is judged by the silence rules, which
    count no failure while the lighthouse heard nobody. A socket closing right after a heartbeat (a killed
    process) is a death at once."""
    state = LighthouseState(EpochPlan(64, 8), heartbeat_timeout=TIMEOUT, outage_timeout=OUTAGE)
    for member, incarnation in (("a", "1" * 32), ("b", "2" * 32)):
        state.register(member, incarnation, 0.0)
        state.connected(member, 0.1)
    back = 0.1 + 3 * TIMEOUT  # nobody was heard meanwhile: the lighthouse was cut off
    state.tick(back)
    state.disconnected("a", back)
    assert state.membership.alive("a") and state.failures == []
    state.connected("b", back)
    state.disconnected("b", back + TIMEOUT / 4)
    assert [(f["member"], f["reason"]) for f in state.failures] == [("b", "socket closed")]
