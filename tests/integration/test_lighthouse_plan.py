"""The plan from the training script: a lighthouse without one adopts the first member's, keeps it across a
restart, and refuses another plan naming each differing field; bad plans get a 4xx, never a 5xx."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from stalwart.coord.client import LighthouseClient, LighthouseError
from stalwart.coord.quorum import LighthouseState
from stalwart.coord.server import Lighthouse
from stalwart.coord.wire import MAX_PLAN_INT, PLAN_FIELDS, RequestError, parse_plan
from stalwart.data.plan import EpochPlan
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(240, 24, seed=5, local_batch_multiple=4, block_size=8, window=2)
OTHER_VALUES: dict[str, Any] = {
    "dataset_size": 241,
    "global_batch_size": 16,
    "seed": 6,
    "shuffle": False,
    "drop_last": True,
    "local_batch_multiple": 2,
    "block_size": 4,
    "window": 3,
}
"""For each field, another value that makes a valid plan with the rest of ``PLAN`` (shuffle=False needs no blocks)."""


def other_plan(field: str) -> EpochPlan:
    changes: dict[str, Any] = {field: OTHER_VALUES[field]}
    if field == "shuffle":
        changes.update(block_size=1, window=1)
    return dataclasses.replace(PLAN, **changes)


def register(lighthouse: Lighthouse, body: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/register with ``body`` as JSON; returns (status, JSON answer)."""
    request = urllib.request.Request(
        lighthouse.url + "/v1/register", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_every_plan_field_travels_and_the_wire_fields_are_the_dataclass_fields() -> None:
    assert tuple(PLAN.to_dict()) == PLAN_FIELDS
    assert set(OTHER_VALUES) == set(PLAN_FIELDS)
    assert parse_plan(PLAN.to_dict()) == PLAN and parse_plan(None) is None


def test_a_lighthouse_without_a_plan_adopts_the_first_members_and_trains_with_it() -> None:
    with Lighthouse(None, min_replicas=1, join_timeout=1.0) as lighthouse:
        status = lighthouse.status()
        assert status["plan"] is None and status["ledger"]["step"] == 0
        with (
            LighthouseClient(lighthouse.url, "a", plan=PLAN, heartbeat_interval=0.05) as first,
            LighthouseClient(lighthouse.url, "b", heartbeat_interval=0.05) as planless,
        ):
            first.start_heartbeat(lambda: 0)
            answer = first.quorum(0, None, "join", 30)
            assert lighthouse.status()["plan"] == PLAN.to_dict()
            assert answer.data_ledger().plan == PLAN, "the quorum's ledger follows the adopted plan"
            planless.start_heartbeat(lambda: 0)
            wait_until(planless.heartbeat_connected.is_set, what="a member without a plan to register")


def test_the_same_plan_is_accepted_and_each_differing_field_is_named_with_both_values() -> None:
    with Lighthouse(PLAN, min_replicas=1) as lighthouse:
        with LighthouseClient(lighthouse.url, "same", plan=EpochPlan(**PLAN.to_dict())) as same:
            same.identity_headers()
        for number, field in enumerate(PLAN_FIELDS):
            offered = other_plan(field)
            with LighthouseClient(lighthouse.url, f"m{number}", plan=offered, heartbeat_interval=0.05) as client:
                client.start_heartbeat(lambda: 0)
                with pytest.raises(LighthouseError) as refused:
                    client.quorum(0, None, "join", 30)
                body = refused.value.body
                assert refused.value.status == 409 and body["code"] == "plan_mismatch"
                expected = {
                    name: {"lighthouse": PLAN.to_dict()[name], "member": offered.to_dict()[name]}
                    for name in PLAN_FIELDS
                    if PLAN.to_dict()[name] != offered.to_dict()[name]
                }
                assert field in expected and body["differences"] == expected
                assert f"{field}: lighthouse {PLAN.to_dict()[field]!r}" in body["error"]
                with pytest.raises(LighthouseError) as again:
                    client.quorum(0, None, "join", 30)
                assert again.value.body == body, "the refusal is final: the same error at once"
        status = lighthouse.status()
        assert [m["member"] for m in status["members"]] == ["same"], "a refused member changes nothing"
        assert status["plan"] == PLAN.to_dict()


def test_a_member_without_a_plan_against_a_lighthouse_without_one_is_told_how_to_give_one() -> None:
    with Lighthouse(None, min_replicas=1) as lighthouse:
        with LighthouseClient(lighthouse.url, "a") as client, pytest.raises(LighthouseError) as refused:
            client.quorum(0, None, "join", 30)
        assert refused.value.status == 409 and refused.value.body["code"] == "no_plan"
        message = refused.value.body["error"]
        assert "--dataset-size" in message and "--global-batch" in message and "plan=" in message
        assert lighthouse.status()["plan"] is None and lighthouse.status()["members"] == []


GARBAGE: list[Any] = [
    "a plan",
    [PLAN.to_dict()],
    {},
    {**PLAN.to_dict(), "colour": "blue"},
    {name: value for name, value in PLAN.to_dict().items() if name != "seed"},
    {**PLAN.to_dict(), "dataset_size": "240"},
    {**PLAN.to_dict(), "dataset_size": 240.0},
    {**PLAN.to_dict(), "dataset_size": True},
    {**PLAN.to_dict(), "dataset_size": 0},
    {**PLAN.to_dict(), "global_batch_size": -24},
    {**PLAN.to_dict(), "global_batch_size": MAX_PLAN_INT + 1},
    {**PLAN.to_dict(), "seed": 2**200},
    {**PLAN.to_dict(), "shuffle": 1},
    {**PLAN.to_dict(), "local_batch_multiple": 25},
    {**PLAN.to_dict(), "window": 99},
    {**PLAN.to_dict(), "shuffle": False},
    {**PLAN.to_dict(), "drop_last": None},
]


@pytest.mark.parametrize("configured", [None, PLAN], ids=["adopting", "configured"])
def test_garbage_plans_get_a_400_naming_the_plan_and_change_nothing(configured: EpochPlan | None) -> None:
    with Lighthouse(configured, min_replicas=1) as lighthouse:
        before = lighthouse.status()
        for garbage in GARBAGE:
            status, answer = register(lighthouse, {"member": "m", "incarnation": uuid.uuid4().hex, "plan": garbage})
            assert status == 400 and answer["field"] == "plan" and "plan" in answer["error"], (garbage, answer)
        assert lighthouse.status() == before
        status, answer = register(lighthouse, {"member": "m", "incarnation": uuid.uuid4().hex, "plan": PLAN.to_dict()})
        assert status == 200, answer


def test_the_pure_state_refuses_before_anything_changes() -> None:
    state = LighthouseState(None)
    with pytest.raises(RequestError) as no_plan:
        state.register("a", "0" * 32, 0.0)
    assert no_plan.value.status == 409 and no_plan.value.details["code"] == "no_plan"
    assert state.revision == 0 and state.plan is None and state.to_status()["ledger"]["epoch_length"] == 0
    state.register("a", "0" * 32, 0.0, PLAN)
    assert state.plan == PLAN
    revision = state.revision
    with pytest.raises(RequestError) as mismatch:
        state.register("b", "1" * 32, 0.0, other_plan("seed"))
    assert mismatch.value.details["differences"] == {"seed": {"lighthouse": 5, "member": 6}}
    assert state.revision == revision and "b" not in state.members


def test_a_restarted_lighthouse_keeps_the_adopted_plan(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with (
        Lighthouse(None, min_replicas=1, state_path=path) as lighthouse,
        LighthouseClient(lighthouse.url, "a", plan=PLAN) as client,
    ):
        client.identity_headers()
    with Lighthouse(None, min_replicas=1, state_path=path) as restarted:
        assert restarted.status()["plan"] == PLAN.to_dict()
        mismatched = LighthouseClient(restarted.url, "b", plan=other_plan("global_batch_size"))
        with mismatched, pytest.raises(LighthouseError) as refused:
            mismatched.identity_headers()
        assert refused.value.body["differences"] == {"global_batch_size": {"lighthouse": 24, "member": 16}}
    with pytest.raises(ValueError, match=r"global_batch_size=16 \(persisted 24\)"):
        Lighthouse(other_plan("global_batch_size"), state_path=path)


def test_the_lighthouse_command_without_a_plan_adopts_one_and_keeps_it_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    for member, plan in (("a", PLAN), ("b", None)):
        process = subprocess.Popen(
            [sys.executable, "-m", "stalwart", "lighthouse", "--min-replicas", "1", "--state", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert process.stdout is not None
            banner = process.stdout.readline()
            assert banner.startswith("lighthouse listening on "), banner
            url = banner.removeprefix("lighthouse listening on ").strip()
            if plan is not None:
                assert "no plan given" in process.stdout.readline()
            with LighthouseClient(url, member, plan=plan) as client:
                client.identity_headers()
                assert client.status()["plan"] == PLAN.to_dict()
        finally:
            process.terminate()
            process.wait(timeout=60)
