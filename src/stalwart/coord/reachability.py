"""Which members reach which: the cuts members report, and the largest set of candidates that all reach one another.

Pure: no I/O; time is passed as ``now``. The rules are ``docs/protocol.md``'s
("Reachability").

Reports
    A quorum request may name the members of the sender's last quorum that it
    could not reach (a failed rendezvous or collective, then a probe). Each
    named peer *cuts* the pair. A report is one *observation*: its quorum id
    and its peers. The same observation sent again (a retried long poll, a
    join repeating what the last probe found) renews nothing; a newer one
    replaces the older: the peers it no longer names are withdrawn by this
    reporter (the pair stays cut while the other end still reports it), the
    peers it names anew (or all of them, for another quorum id) are cut again
    as of ``now``.

Expiry
    A cut lasts while a report of either end holds it, and each report holds
    it for a time to live: ``ttl`` for the pair's first cut, doubled for each
    further cut of the same pair that follows within ``max_ttl`` of the last
    one ending, up to ``max_ttl``. It counts from the report, and again from
    the formation of a quorum that leaves a member out for the cut
    (:meth:`Reachability.renew`; the lighthouse expires nothing while a
    quorum waits for its members). So a member left out because it is cut off
    is tried again ``ttl``, ``2 ttl``, ``4 ttl``... and then every ``max_ttl``
    after it was left out: the members that reach one another pay at most one
    failed rendezvous per try, however long the partition lasts. A member
    that comes back from the dead (its heartbeat reconnects after it died:
    its link was down and is up) clears every cut it is part of at once; what
    it observed about the quorums formed before (while its link was down)
    cuts nothing, and neither do the other ends' observations sent again:
    only an observation about a later quorum cuts it again.

The choice (:func:`choose`)
    Among the candidates, the largest set that all reach one another is a
    maximum independent set of the *cut* graph (cuts among candidates as
    edges). Members that no cut touches are in it whatever happens, so the
    work is on the members cuts touch only, component by component: exact
    (memoised branching, on components of at most ``EXACT_LIMIT`` members),
    else greedy (holders first, those cut from fewest holders first, then
    the rest by fewest cuts, then priority),
    which is still a clique, still maximal and still keeps a holder.
    "Largest" counts the members that hold the job's state first, then all;
    ties go to the set whose best-priority member ranks first. The answer
    depends on the cuts and the priorities only, never on the order the
    reports came in.

At most ``MAX_CUTS`` pairs are cut at once; a report past that asserts the
cuts that fit (a total partition of thousands of members is a lost job
anyway; the bound keeps the lighthouse's memory bounded).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.coord.wire import check_seconds

EXACT_LIMIT = 12
"""Largest component of the cut graph searched exactly (at most ``2**EXACT_LIMIT`` memoised sub-problems: a few
milliseconds at worst; 14 members already took 40 ms on a sparse component)."""
MAX_CUTS = 1 << 16
"""Most pairs cut at once."""
_MAX_STRIKES = 32
"""Strikes stop counting here (the time to live is capped long before)."""

Pair = tuple[str, str]


def pair(a: str, b: str) -> Pair:
    """The unordered pair ``{a, b}`` as a sorted tuple."""
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class Report:
    """A member's latest observation: the quorum it is about, the peers it could not reach, when it came."""

    quorum_id: int | None
    peers: frozenset[str]
    time: float


@dataclass
class Cut:
    """A pair that cannot reach each other: who reports it, since when, until when, and how often it was cut."""

    members: Pair
    by: dict[str, float] = field(default_factory=dict)
    """Each reporting end, and until when its report holds the cut."""
    since: float = 0.0
    strikes: int = 1
    probes_end_it: bool = True
    """Whether a member's probe reaching the other end ends it (not right after a cut a probe ended, see the module
    doc)."""

    @property
    def expires(self) -> float:
        """When the last report holding the cut lapses."""
        return max(self.by.values())

    def to_json(self, now: float | None) -> dict[str, Any]:
        """The cut as ``/v1/status`` shows it (``expires_in`` seconds from ``now``, None without it)."""
        return {
            "members": list(self.members),
            "reported_by": sorted(self.by),
            "since": self.since,
            "expires_in": None if now is None else max(0.0, self.expires - now),
            "strikes": self.strikes,
        }


class Reachability:
    """The reports, the cuts they hold, and each member's cut peers (the cut graph's adjacency)."""

    def __init__(self, ttl: float, max_ttl: float) -> None:
        self.ttl = check_seconds("ttl", ttl)
        self.max_ttl = check_seconds("max_ttl", max_ttl)
        if self.max_ttl < self.ttl:
            raise ValueError(f"max_ttl must be >= ttl ({self.ttl:g}), got {max_ttl!r}")
        self.reports: dict[str, Report] = {}
        self.cuts: dict[Pair, Cut] = {}
        self.peers: dict[str, set[str]] = {}
        """The cut graph: each member some cut touches, and the members it is cut from."""
        self.version = 0
        """Grows whenever the set of cut pairs changes."""
        self._ended: dict[Pair, tuple[int, float, bool]] = {}
        """Pairs whose cut ended: its strikes, when it ended, and whether a probe ended it (forgotten ``max_ttl``
        later)."""
        self._deadlines: list[tuple[float, Pair]] = []
        """``(expiry, pair)`` for every report holding a cut (a heap; stale entries skipped)."""
        self._back: dict[str, int | None] = {}
        """Members back from the dead, and the last quorum formed before: their observations up to it are stale."""

    def __len__(self) -> int:
        return len(self.cuts)

    def cut(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are cut now."""
        return pair(a, b) in self.cuts

    def time_to_live(self, strikes: int) -> float:
        """How long a report holds a cut of a pair cut for the ``strikes``-th time in a row."""
        return min(self.ttl * 2.0 ** (min(strikes, _MAX_STRIKES) - 1), self.max_ttl)

    def report(self, member: str, quorum_id: int | None, peers: Iterable[str], now: float) -> None:
        """``member``'s observation about quorum ``quorum_id``: it could not reach ``peers`` (see the module doc)."""
        named = frozenset(peers) - {member}
        old = self.reports.get(member)
        if old is not None and old.quorum_id == quorum_id and old.peers == named:
            return  # the same observation sent again
        renewed = named if old is None or old.quorum_id != quorum_id else named - old.peers
        if member in self._back:
            back = self._back[member]
            if quorum_id is None or (back is not None and quorum_id <= back):
                renewed = frozenset()  # made while its link was down
            else:
                del self._back[member]
        if named:
            self.reports[member] = Report(quorum_id, named, now)
        else:
            self.reports.pop(member, None)
        for peer in () if old is None else old.peers - named:
            self._withdraw(pair(member, peer), member, now)
        for peer in sorted(renewed):
            self._assert(member, peer, now)

    def reconnected(self, member: str, quorum_id: int | None, now: float) -> None:
        """``member`` came back from the dead (its link is up again): every cut it is part of ends now, and what it
        observed about quorum ``quorum_id`` (the last formed) and earlier ones cuts nothing."""
        self._back[member] = quorum_id
        for peer in sorted(self.peers.get(member, ())):
            self._end(pair(member, peer), now)

    def reached(self, member: str, peers: Iterable[str], now: float) -> list[Pair]:
        """``member``'s probe got through to ``peers``: the cuts between them that a probe may end, end now (see the
        module doc, "Reached"); the pairs ended."""
        ended = []
        for peer in sorted(set(peers) - {member}):
            members = pair(member, peer)
            cut = self.cuts.get(members)
            if cut is not None and cut.probes_end_it:
                self._end(members, now, by_probe=True)
                ended.append(members)
        return ended

    def renew(self, member: str, now: float) -> None:
        """A quorum formed without ``member`` because of its cuts: each report holding one holds it a time to live
        from ``now`` at least."""
        for peer in sorted(self.peers.get(member, ())):
            members = pair(member, peer)
            cut = self.cuts[members]
            until = now + self.time_to_live(cut.strikes)
            for end, held in cut.by.items():
                if held < until:
                    cut.by[end] = until
                    heapq.heappush(self._deadlines, (until, members))

    def expire(self, now: float) -> None:
        """End the reports (and the cuts) whose time ran out by ``now``; costs what expired."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, members = heapq.heappop(deadlines)
            cut = self.cuts.get(members)
            if cut is None:
                continue
            for end, until in list(cut.by.items()):
                if until == deadline:
                    self._withdraw(members, end, now)

    def prune(self, known: Callable[[str], bool], now: float) -> None:
        """Forget the reports of members no longer ``known``, and strikes of cuts that ended over ``max_ttl`` ago.

        Linear in the reports and the remembered cuts (run when a quorum forms).
        """
        for member in [m for m in self.reports if not known(m)]:
            del self.reports[member]
        for member in [m for m in self._back if not known(m)]:
            del self._back[member]
        for members in [p for p, (_, ended, _) in self._ended.items() if now - ended > self.max_ttl]:
            del self._ended[members]

    def to_status(self, now: float | None) -> list[dict[str, Any]]:
        """Every cut, as ``/v1/status`` shows them (sorted by pair)."""
        return [self.cuts[members].to_json(now) for members in sorted(self.cuts)]

    def _assert(self, member: str, peer: str, now: float) -> None:
        members = pair(member, peer)
        cut = self.cuts.get(members)
        if cut is None:
            if len(self.cuts) >= MAX_CUTS:
                return
            strikes, ended, by_probe = self._ended.pop(members, (0, float("-inf"), False))
            again = now - ended <= self.max_ttl
            cut = self.cuts[members] = Cut(
                members, since=now, strikes=strikes + 1 if again else 1, probes_end_it=not (again and by_probe)
            )
            self.peers.setdefault(members[0], set()).add(members[1])
            self.peers.setdefault(members[1], set()).add(members[0])
            self.version += 1
        until = now + self.time_to_live(cut.strikes)
        cut.by[member] = until
        heapq.heappush(self._deadlines, (until, members))

    def _withdraw(self, members: Pair, end: str, now: float) -> None:
        cut = self.cuts.get(members)
        if cut is not None and cut.by.pop(end, None) is not None and not cut.by:
            self._end(members, now)

    def _end(self, members: Pair, now: float, *, by_probe: bool = False) -> None:
        cut = self.cuts.pop(members)
        self._ended[members] = (cut.strikes, now, by_probe)
        a, b = members
        for one, other in ((a, b), (b, a)):
            peers = self.peers[one]
            peers.discard(other)
            if not peers:
                del self.peers[one]
        self.version += 1


@dataclass(frozen=True)
class Choice:
    """Who :func:`choose` leaves out, and how it chose."""

    left_out: frozenset[str]
    touched: int
    """Candidates some cut among candidates touches (the members the work depends on)."""
    exact: bool
    """Whether every component was searched exactly (else some was chosen greedily, see ``EXACT_LIMIT``)."""


def choose(
    peers: Mapping[str, Collection[str]],
    candidate: Callable[[str], bool],
    holder: Callable[[str], bool],
    priority: Callable[[str], Any],
    *,
    exact_limit: int = EXACT_LIMIT,
) -> Choice:
    """The candidates to leave out so that those left all reach one another (see the module doc).

    ``peers`` is the cut graph (:attr:`Reachability.peers`); ``candidate``
    says who may be chosen, ``holder`` who holds the job's state, and
    ``priority`` gives a total order (smaller first: rank in the current
    quorum, then member id) that breaks ties. Costs what the cuts among
    candidates touch, not the number of candidates.
    """
    touched = {m for m in peers if candidate(m)}
    graph = {m: [p for p in peers[m] if p in touched] for m in touched}  # any order: components are sorted
    order = sorted((m for m in touched if graph[m]), key=priority)
    seen: set[str] = set()
    left_out: set[str] = set()
    exact = True
    for start in order:
        if start in seen:
            continue
        component = _component(start, graph, seen)
        component.sort(key=priority)
        if len(component) <= exact_limit:
            kept = _exact(component, graph, holder)
        else:
            kept = _greedy(component, graph, holder, priority)
            exact = False
        left_out.update(m for m in component if m not in kept)
    return Choice(frozenset(left_out), len(order), exact)


def _component(start: str, graph: Mapping[str, list[str]], seen: set[str]) -> list[str]:
    seen.add(start)
    component, frontier = [start], [start]
    while frontier:
        for peer in graph[frontier.pop()]:
            if peer not in seen:
                seen.add(peer)
                component.append(peer)
                frontier.append(peer)
    return component


def _exact(component: list[str], graph: Mapping[str, list[str]], holder: Callable[[str], bool]) -> set[str]:
    """The best independent set of one component: most holders, then most members, then the best-ranked first.

    Branches on the best-ranked member left: taking it first and keeping the
    other branch only when strictly better makes ties go to the set whose
    best-ranked member ranks first.
    """
    index = {member: i for i, member in enumerate(component)}
    masks = [sum(1 << index[p] for p in graph[m]) for m in component]
    holders = sum(1 << i for i, m in enumerate(component) if holder(m))
    memo: dict[int, tuple[int, int, int]] = {0: (0, 0, 0)}

    def best(remaining: int) -> tuple[int, int, int]:
        found = memo.get(remaining)
        if found is not None:
            return found
        low = remaining & -remaining
        v = low.bit_length() - 1
        rest = remaining & ~low
        h, size, kept = best(rest & ~masks[v])
        result = (h + ((holders >> v) & 1), size + 1, kept | low)
        if masks[v] & rest:
            without = best(rest)
            if without[:2] > result[:2]:
                result = without
        memo[remaining] = result
        return result

    kept = best((1 << len(component)) - 1)[2]
    return {m for i, m in enumerate(component) if kept >> i & 1}


def _greedy(
    component: list[str], graph: Mapping[str, list[str]], holder: Callable[[str], bool], priority: Callable[[str], Any]
) -> set[str]:
    """A maximal independent set: holders first, those cut from the fewest holders first (then non-holders, those
    with the fewest cuts first), then by priority. A majority of holders that reach one another, each of the
    others cut from all of them, is cut from fewer holders than any of the others: it is kept."""

    def rank(member: str) -> tuple[bool, int, Any]:
        if holder(member):
            return False, sum(1 for p in graph[member] if holder(p)), priority(member)
        return True, len(graph[member]), priority(member)

    kept: set[str] = set()
    for member in sorted(component, key=rank):
        if not any(p in kept for p in graph[member]):
            kept.add(member)
    return kept
