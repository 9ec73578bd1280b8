"""The data ledger: which positions of the epoch each member holds, exactly once.

The ledger is the state machine the lighthouse hosts (and that a worker may
replay locally while membership holds). It counts in *positions* of the
epoch's order (see :class:`~stalwart.data.plan.EpochPlan`); ``plan.indices_at``
turns positions into sample indices.

A step goes::

    begin_step(members)  ->  shares: missing_indices first, then fresh ones from base_index
    member_failed(m)     ->  m's in-flight positions become this step's missing positions
    reassign(survivors)  ->  those positions handed to survivors as extra work (same step)
    commit()             ->  positions of live members committed; unreassigned ones re-queued

``reassign`` gives failure-transparent steps: the step still trains on its full
total. Committing without it is the proposal's re-queue mode: the lost
positions go first into the next step (``missing_indices``).

A *balanced* ledger (``balance_every=K``) also records one weight per member
(``reweigh``, between steps; see :mod:`stalwart.data.balance`): shares, and
reassigned work, follow the weights instead of being equal. The weights and
the step they were recorded at are part of the state (and so of its digest);
a ledger with ``balance_every=0`` (the default) has neither, and its shares
and state are those of an unbalanced ledger.

Invariant: whatever the sequence of joins, failures, reassigns and re-queues,
each epoch commits every position of ``[0, plan.epoch_length)`` exactly once,
and replaying the same sequence gives the same shares.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.balance import weighted_split_sizes
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes, step_total

Positions = npt.NDArray[np.int64]
STATE_VERSION = 1
_EMPTY: Positions = np.zeros(0, dtype=np.int64)


class DataLedger:
    """Per-epoch record of fresh, in-flight, missing and committed positions (and, balanced, members' weights).

    ``balance_every``: 0 splits every step equally; ``K > 0`` splits by the
    recorded weights, which the runtime decides every ``K`` steps.
    """

    def __init__(self, plan: EpochPlan, *, balance_every: int = 0) -> None:
        if not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan, got {type(plan).__name__}")
        self.plan = plan
        self.balance_every = check_int("balance_every", balance_every, minimum=0)
        self._weights: dict[str, int] = {}
        self._weights_step = 0
        self.epoch = 0
        self.step = 0
        self.epoch_step = 0
        self.base_index = 0
        self._missing: Positions = _EMPTY
        self._members: list[str] | None = None
        self._in_flight: dict[str, Positions] = {}
        self._step_missing: Positions = _EMPTY
        self._lost_shares: list[Positions] = []
        """Shares lost since ``_step_missing`` was last joined with them (:meth:`_joined_step_missing`)."""
        self._intact_step: Positions | None = None

    @property
    def missing_indices(self) -> Positions:
        """Positions lost by members that died, queued to be handed out before fresh ones."""
        return self._missing.copy()

    @property
    def in_step(self) -> bool:
        """True between ``begin_step`` and ``commit``."""
        return self._members is not None

    @property
    def members(self) -> list[str]:
        """The live members of the current step in rank order (empty between steps)."""
        return [member for member in self._members or [] if member in self._in_flight]

    @property
    def began_with(self) -> list[str]:
        """The members the current step began with, in rank order, dead ones included (empty between steps)."""
        return list(self._members or [])

    @property
    def in_flight(self) -> dict[str, Positions]:
        """Each live member's positions in the current step (copies)."""
        return {member: positions.copy() for member, positions in self._in_flight.items()}

    @property
    def step_missing(self) -> Positions:
        """Positions lost in the current step and not yet reassigned."""
        return self._joined_step_missing().copy()

    @property
    def step_missing_size(self) -> int:
        """How many positions were lost in the current step and not yet reassigned (no copy)."""
        return int(self._step_missing.size) + sum(int(share.size) for share in self._lost_shares)

    def _joined_step_missing(self) -> Positions:
        """This step's missing positions, the shares lost since the last call joined to them in one copy (joined at
        each failure instead, the copies grow with the square of the members failing at once: 3 ms for a quarter of
        4,096, 1 ms joined once)."""
        if self._lost_shares:
            self._step_missing = np.concatenate([self._step_missing, *self._lost_shares])
            self._lost_shares = []
        return self._step_missing

    @property
    def balanced(self) -> bool:
        """Whether shares follow the recorded weights (``balance_every > 0``)."""
        return self.balance_every > 0

    @property
    def weights(self) -> dict[str, int]:
        """The recorded weights (a copy; empty until the first ``reweigh``, and when not balanced)."""
        return dict(self._weights)

    @property
    def weights_step(self) -> int:
        """The step at which the recorded weights were recorded (0 before the first ``reweigh``)."""
        return self._weights_step

    def weights_record(self) -> dict[str, Any] | None:
        """``{"step", "weights"}``: what a member reports with its digest so the lighthouse can replay its shares.

        None when the ledger is not balanced.
        """
        if not self.balanced:
            return None
        return {"step": self._weights_step, "weights": dict(self._weights)}

    def effective_weights(self, members: Sequence[str]) -> list[int]:
        """Each member's weight in a split: its recorded one, else (a newcomer) the mean of those recorded.

        All 1 when no member has a recorded weight (equal shares), and when the
        ledger is not balanced.
        """
        known = [self._weights[member] for member in members if member in self._weights]
        default = max(1, (sum(known) + len(known) // 2) // len(known)) if known else 1
        return [self._weights.get(member, default) for member in members]

    def reweigh(self, weights: Mapping[str, int]) -> None:
        """Record ``weights`` (between steps): the shares of this step on follow them."""
        if not self.balanced:
            raise RuntimeError("reweigh() needs a balanced ledger (balance_every > 0)")
        if self.in_step:
            raise RuntimeError(f"reweigh() must be called between steps, but step {self.step} is in progress")
        self._weights = _check_weights("weights", weights)
        self._weights_step = self.step

    @property
    def epoch_complete(self) -> bool:
        """True once every position of the epoch is committed; the next ``begin_step`` starts a new epoch."""
        return not self.in_step and self.base_index >= self.plan.epoch_length and self._missing.size == 0

    def begin_step(self, members: Sequence[str]) -> dict[str, Positions]:
        """Start a step for ``members`` (rank order) and return each member's share of positions.

        The shares are read-only views of one array (no copies: this is on
        the lighthouse's per-step path).

        The step total is the plan's total for this step (``global_batch_size``,
        adjusted to ``local_batch_multiple``) or what the epoch has left;
        ``missing_indices`` come first, then fresh positions from ``base_index``.
        """
        members = _check_members("members", members)
        if self.in_step:
            raise RuntimeError(f"step {self.step} is already in progress; commit() it before begin_step()")
        if self.epoch_complete:
            self.epoch += 1
            self.epoch_step = 0
            self.base_index = 0
        plan = self.plan
        available = self._missing.size + plan.epoch_length - self.base_index
        total = min(step_total(self.epoch_step, plan.global_batch_size, plan.local_batch_multiple), available)
        from_missing = min(total, self._missing.size)
        fresh = total - from_missing
        step_positions = np.arange(self.base_index, self.base_index + fresh, dtype=np.int64)
        if from_missing:
            step_positions = np.concatenate([self._missing[:from_missing], step_positions])
        step_positions.flags.writeable = False
        self._missing = self._missing[from_missing:]
        self.base_index += fresh
        shares: dict[str, Positions] = {}
        start = 0
        if self.balanced:
            sizes = weighted_split_sizes(total, self.effective_weights(members), plan.local_batch_multiple)
        else:
            sizes = split_sizes(total, len(members), plan.local_batch_multiple)
        for member, size in zip(members, sizes, strict=True):
            shares[member] = step_positions[start : start + size]
            start += size
        self._members = members
        self._in_flight = shares
        self._step_missing = _EMPTY
        self._lost_shares = []
        self._intact_step = step_positions
        return dict(shares)

    def member_failed(self, member: str) -> bool:
        """Record that ``member`` died in this step; its positions become this step's missing ones.

        Returns False (and changes nothing) if the failure was already recorded.
        """
        self._check_in_step("member_failed")
        lost = self._in_flight.pop(member, None)
        if lost is None:
            if member not in (self._members or []):
                raise ValueError(f"member must be one of this step's members {self._members}, got {member!r}")
            return False
        self._intact_step = None
        self._lost_shares.append(lost)
        return True

    def reassign(self, survivors: Sequence[str]) -> dict[str, Positions]:
        """Hand this step's missing positions to ``survivors`` as extra work, balanced, in multiples.

        Chunks of ``local_batch_multiple`` positions go one at a time to the
        survivor that would then hold the fewest positions per unit of weight
        (ties: rank order; unbalanced, every weight is 1, and loads stay within
        one multiple of each other where possible). Returns each survivor's extra
        positions (possibly empty), as read-only views of one array (no copies:
        the lighthouse replays this for thousands of survivors at a failure).

        With equal weights (an unbalanced ledger, or a balanced one whose
        survivors weigh the same) the result is computed without handing the
        chunks out (:func:`greedy_sizes`, O(survivors log total)); unequal
        weights hand them out one by one (:func:`weighted_greedy_sizes`,
        O(chunks log survivors)).
        """
        self._check_in_step("reassign")
        survivors = _check_members("survivors", survivors)
        for member in survivors:
            if member not in self._in_flight:
                raise ValueError(f"survivors must be live members of this step {self.members}, got {member!r}")
        weights = self.effective_weights(survivors)
        loads = [self._in_flight[member].size for member in survivors]
        handed = self._joined_step_missing()  # replaced below, never changed in place: the views stay as handed out
        missing, multiple = handed.size, self.plan.local_batch_multiple
        if len(set(weights)) <= 1:  # equal weights: the order of loads per weight is the order of loads
            sizes = greedy_sizes(np.array(loads, dtype=np.int64), missing, multiple).tolist()
        else:
            sizes = weighted_greedy_sizes(loads, weights, missing, multiple)
        handed.flags.writeable = False
        extra: dict[str, Positions] = {}
        pieces: list[Positions] = []
        start = 0
        for member, size in zip(survivors, sizes, strict=True):
            extra[member] = handed[start : start + size]
            start += size
            pieces += (self._in_flight[member], extra[member])
        # every survivor's grown share in one copy: one concatenation per survivor took 8-9 ms of the
        # lighthouse's loop for 3,072 survivors (a quarter of 4,096 failing), this 3 ms (both under cProfile)
        grown = np.concatenate([_EMPTY, *pieces])
        grown.flags.writeable = False
        end = 0
        for member, size in zip(survivors, sizes, strict=True):
            begin, end = end, end + self._in_flight[member].size + size
            self._in_flight[member] = grown[begin:end]
        self._step_missing = _EMPTY
        return extra

    def commit(self) -> Positions:
        """Commit the step: return the positions live members trained on; re-queue unreassigned ones."""
        self._check_in_step("commit")
        if self._intact_step is not None:
            committed = self._intact_step
        else:
            committed = np.concatenate([_EMPTY, *(self._in_flight[m] for m in self.members)])
        self._missing = np.concatenate([self._missing, self._joined_step_missing()])
        self._members = None
        self._in_flight = {}
        self._step_missing = _EMPTY
        self._intact_step = None
        self.step += 1
        self.epoch_step += 1
        return committed

    def copy(self) -> DataLedger:
        """An independent ledger in the same state; cheap, as the ledger never writes into its position arrays."""
        twin = DataLedger.__new__(DataLedger)
        twin.__dict__.update(self.__dict__)
        twin._members = None if self._members is None else list(self._members)
        twin._in_flight = dict(self._in_flight)
        twin._lost_shares = list(self._lost_shares)
        twin._weights = dict(self._weights)
        return twin

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``DataLedger.from_state_dict`` continues identically.

        A balanced ledger's state also has ``balance``: ``{"every", "step", "weights"}``.
        """
        return {
            **self._scalars(),
            "missing_indices": self._missing.tolist(),
            "in_flight": {member: positions.tolist() for member, positions in self._in_flight.items()},
            "step_missing": self._joined_step_missing().tolist(),
        }

    def _scalars(self) -> dict[str, Any]:
        """The state but its position arrays."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "plan": self.plan.to_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "epoch_step": self.epoch_step,
            "base_index": self.base_index,
            "members": self._members,
        }
        if self.balanced:
            state["balance"] = {"every": self.balance_every, "step": self._weights_step, "weights": dict(self._weights)}
        return state

    def binary_digest(self) -> str:
        """SHA-256 of the state in a canonical binary form, first 16 bytes in hex: equal exactly when two ledgers'
        ``state_dict()`` are.

        What :func:`~stalwart.coord.protocol.ledger_digest` tells of a state,
        without spelling every position out in decimal: the lighthouse digests
        the ledger in a failure's step for each quorum it forms then, and the
        canonical JSON of thousands of members' positions took some 20 ms of
        its event loop at 4,096 members; this hashes the position arrays'
        bytes (little-endian int64) after a canonical JSON header of the rest,
        in-flight members sorted by name, in about 2 ms.
        """
        names = sorted(self._in_flight)
        arrays = [self._missing, self._joined_step_missing(), *(self._in_flight[name] for name in names)]
        header = {
            **self._scalars(),
            "in_flight": names,
            "missing_indices": int(self._missing.size),
            "step_missing": int(self._step_missing.size),
        }
        hasher = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())
        hasher.update(np.array([array.size for array in arrays[2:]], dtype="<i8").tobytes())
        hasher.update(np.concatenate(arrays).astype("<i8", copy=False).tobytes())
        return hasher.hexdigest()[:32]

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DataLedger:
        """Rebuild a ledger from ``state_dict()`` output, checking that it is well formed."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state must be a ledger state_dict of version {STATE_VERSION}")
        balance = state.get("balance")
        if balance is not None and (not isinstance(balance, Mapping) or set(balance) != {"every", "step", "weights"}):
            raise ValueError(f"state['balance'] must be a mapping with keys every, step and weights, got {balance!r}")
        every = 0 if balance is None else check_int("state['balance']['every']", balance["every"], minimum=1)
        ledger = cls(EpochPlan(**state["plan"]), balance_every=every)
        length = ledger.plan.epoch_length
        ledger.epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        ledger.step = check_int("state['step']", state["step"], minimum=0)
        ledger.epoch_step = check_int("state['epoch_step']", state["epoch_step"], minimum=0)
        ledger.base_index = check_int("state['base_index']", state["base_index"], minimum=0, maximum=length)
        ledger._missing = _positions("state['missing_indices']", state["missing_indices"], length)
        ledger._step_missing = _positions("state['step_missing']", state["step_missing"], length)
        if state["members"] is not None:
            ledger._members = _check_members("state['members']", state["members"])
            ledger._in_flight = {
                member: _positions(f"state['in_flight'][{member!r}]", positions, length)
                for member, positions in state["in_flight"].items()
                if member in ledger._members
            }
        if balance is not None:
            ledger._weights_step = check_int(
                "state['balance']['step']", balance["step"], minimum=0, maximum=ledger.step
            )
            ledger._weights = _check_weights("state['balance']['weights']", balance["weights"])
        return ledger

    def _check_in_step(self, operation: str) -> None:
        if not self.in_step:
            raise RuntimeError(
                f"{operation}() needs a step in progress, but step {self.step} is committed; call begin_step() first"
            )


def greedy_sizes(loads: npt.NDArray[np.int64], total: int, multiple: int) -> npt.NDArray[np.int64]:
    """What each holder gets when ``total`` positions go in chunks of ``multiple`` (the last one smaller), one at a
    time, to the holder with the least load (``loads``), ties to the lowest index.

    Computed without handing out the chunks one by one: holder ``i`` is
    offered its chunks at loads ``loads[i] + k * multiple``, and the greedy
    takes the ``C`` smallest offers (``C`` chunks, offers ordered by load then
    index), the last of them the smaller chunk. A binary search finds the
    load of the ``C``-th offer; O(holders * log(total)) instead of
    O(chunks * log(holders)) (32,768 chunks when 1,024 of 4,096 members fail).
    """
    sizes = np.zeros(loads.size, dtype=np.int64)
    if total == 0:
        return sizes
    chunks = -(-total // multiple)

    def offers_upto(load: int) -> npt.NDArray[np.int64]:
        return np.where(load >= loads, (load - loads) // multiple + 1, 0)

    low, high = int(loads.min()) - 1, int(loads.max()) + chunks * multiple  # fewer / at least chunks offers
    while high - low > 1:
        middle = (low + high) // 2
        if int(offers_upto(middle).sum()) >= chunks:
            high = middle
        else:
            low = middle
    counts = offers_upto(high - 1)
    tied = np.flatnonzero((high >= loads) & ((high - loads) % multiple == 0))
    rest = chunks - int(counts.sum())
    counts[tied[:rest]] += 1
    sizes = counts * multiple
    sizes[tied[rest - 1]] -= chunks * multiple - total
    return sizes


def weighted_greedy_sizes(loads: Sequence[int], weights: Sequence[int], total: int, multiple: int) -> list[int]:
    """What each holder gets when ``total`` positions go in chunks of ``multiple`` (the last one smaller), one at a
    time, to the holder whose load per unit of weight would then be the least, ties to the lowest index."""
    heap = [
        (_after(load, multiple, weight), index) for index, (load, weight) in enumerate(zip(loads, weights, strict=True))
    ]
    heapq.heapify(heap)
    held = list(loads)
    sizes = [0] * len(held)
    remaining = total
    while remaining:
        _, index = heapq.heappop(heap)
        take = min(multiple, remaining)
        sizes[index] += take
        held[index] += take
        remaining -= take
        heapq.heappush(heap, (_after(held[index], multiple, weights[index]), index))
    return sizes


def _check_members(name: str, members: Sequence[str]) -> list[str]:
    if isinstance(members, str) or not isinstance(members, Sequence):
        raise TypeError(f"{name} must be a sequence of member names, got {members!r}")
    members = list(members)
    if not members:
        raise ValueError(f"{name} must name at least one member, got []")
    for member in members:
        if not isinstance(member, str) or not member:
            raise ValueError(f"{name} must hold non-empty strings, got {member!r}")
    if len(set(members)) != len(members):
        raise ValueError(f"{name} must not repeat a member, got {members}")
    return members


def _after(load: int, chunk: int, weight: int) -> Fraction:
    """A survivor's load per unit of weight once it took one more chunk (the order ``reassign`` deals in)."""
    return Fraction(load + chunk, weight)


def _check_weights(name: str, weights: Any) -> dict[str, int]:
    if not isinstance(weights, Mapping):
        raise TypeError(f"{name} must map member names to ints >= 1, got {weights!r}")
    checked = {}
    for member, weight in weights.items():
        if not isinstance(member, str) or not member:
            raise ValueError(f"{name} must have non-empty member names as keys, got {member!r}")
        checked[member] = check_int(f"{name}[{member!r}]", weight, minimum=1)
    return checked


def _positions(name: str, values: Any, length: int) -> Positions:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= length):
        raise ValueError(f"{name} must hold positions in [0, {length - 1}]")
    return array
