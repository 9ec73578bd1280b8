"""A committed step's report keeps the digest of the ledger as committed, however the ledger moves on before it is
read (the heartbeat reads it up to a beat later, on another thread)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.protocol import ledger_digest
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.runtime.session import CommittedReport

MEMBERS = ["a", "b", "c", "d"]


@settings(max_examples=60, deadline=None)
@given(
    epoch_length=st.integers(8, 200),
    global_batch=st.integers(1, 32),
    before=st.integers(0, 12),
    after=st.integers(1, 12),
    failures=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_the_digest_is_the_committed_ledgers(
    epoch_length: int, global_batch: int, before: int, after: int, failures: list[bool]
) -> None:
    ledger = DataLedger(EpochPlan(epoch_length, min(global_batch, epoch_length), seed=1))
    for _ in range(before):
        ledger.begin_step(MEMBERS)
        ledger.commit()
    expected = ledger_digest(ledger.state_dict())
    report = CommittedReport(ledger.step, ledger.copy(), ledger.weights_record())
    for number in range(after):  # the next steps, some losing a member mid-step, before the heartbeat reads it
        ledger.begin_step(MEMBERS)
        if failures[number]:
            ledger.member_failed("d")
            ledger.reassign(["a", "b", "c"])
        ledger.commit()
    assert ledger_digest(ledger.state_dict()) != expected
    assert report.resolved() == (before, expected, None)
    assert report.digest == expected, "computed once, then kept"
