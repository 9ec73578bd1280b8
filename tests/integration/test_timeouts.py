"""Timeouts resolve argument > environment > default, bad values name themselves, and joining gives up."""

from __future__ import annotations

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.errors import JoinError
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.config import Transport
from stalwart.runtime.heal import heal_deadline
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.session import QuorumSession
from stalwart.runtime.timeouts import DEFAULTS, ENVIRONMENT, Timeouts

PLAN = EpochPlan(1797, 48, seed=0)


def test_defaults_apply_without_arguments_or_environment() -> None:
    timeouts = Timeouts.resolve(environ={})
    assert (timeouts.rendezvous_timeout, timeouts.collective_timeout) == (10.0, 2.0)
    assert (timeouts.heal_timeout, timeouts.heal_min_bandwidth) == (DEFAULTS["heal_timeout"], 50e6)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_argument_wins_over_the_environment_which_wins_over_the_default(name: str) -> None:
    environ = {ENVIRONMENT[name]: "7.5"}
    assert getattr(Timeouts.resolve(environ=environ), name) == 7.5
    assert getattr(Timeouts.resolve(environ=environ, **{name: 3}), name) == 3.0
    assert getattr(Timeouts.resolve(environ={ENVIRONMENT[name]: "  "}), name) == DEFAULTS[name]
    others = set(DEFAULTS) - {name}
    resolved = Timeouts.resolve(environ=environ)
    assert all(getattr(resolved, other) == DEFAULTS[other] for other in others)


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_environment_value_names_the_variable_and_the_value(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"STALWART_HEAL_TIMEOUT='{raw}' must be a positive finite number"):
        Timeouts.resolve(environ={"STALWART_HEAL_TIMEOUT": raw})


@pytest.mark.parametrize("value", [0, -2.0, float("inf"), "3", True])
def test_a_bad_argument_names_the_parameter_and_the_value(value: object) -> None:
    with pytest.raises(ValueError, match=r"collective_timeout must be a positive finite number, got"):
        Timeouts.resolve(environ={}, collective_timeout=value)  # type: ignore[arg-type]


def test_a_heal_deadline_grows_with_its_bytes() -> None:
    assert heal_deadline(0, 30.0, 50e6) == 30.0
    assert heal_deadline(10**9, 30.0, 50e6) == 50.0


def test_the_manager_reads_the_environment_and_gives_up_joining_after_its_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STALWART_RENDEZVOUS_TIMEOUT", "4")
    monkeypatch.setenv("STALWART_COLLECTIVE_TIMEOUT", "bad")
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = digits_model(0)
        with pytest.raises(ValueError, match=r"STALWART_COLLECTIVE_TIMEOUT='bad'"):
            Manager(model, digits_optimizer(model), lighthouse=server.url, member="m", max_microbatch=8)
        monkeypatch.delenv("STALWART_COLLECTIVE_TIMEOUT")
        with pytest.raises(ValueError, match=r"Transport.max_join_attempts must be in \[1, inf\], got 0"):
            Transport(max_join_attempts=0)
        manager = Manager(
            model,
            digits_optimizer(model),
            lighthouse=server.url,
            member="m",
            max_microbatch=8,
            timeouts=Timeouts.resolve(heal_timeout=5.0),
            transport=Transport(max_join_attempts=3),
        )
        expected = {**DEFAULTS, "rendezvous_timeout": 4.0, "collective_timeout": 2.0, "heal_timeout": 5.0}
        assert manager.timeouts == Timeouts(**expected)
        attempts = []

        def no_group(session: QuorumSession, answer: object) -> None:
            attempts.append(answer)
            raise CollectiveError("rendezvous failed (test)")

        # On purpose a private seam: a rendezvous that fails on every attempt, which no real peer does reliably.
        monkeypatch.setattr(QuorumSession, "connect", no_group)
        loader = ElasticLoader(digits_dataset())
        try:
            with pytest.raises(JoinError, match=r"m: no working quorum after 3 attempts.*rendezvous failed \(test\)"):
                next(iter(manager.steps(loader, max_steps=2)))
        finally:
            manager.close()
            loader.close()
        assert len(attempts) == 3


def test_on_event_is_told_only_the_kinds_events_names_and_an_unknown_kind_is_refused() -> None:
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = digits_model(0)
        optimizer = digits_optimizer(model)
        with pytest.raises(ValueError, match=r"events names unknown kinds \['commited'\]; the kinds are \["):
            Manager(
                model, optimizer, lighthouse=server.url, member="m", max_microbatch=48, events={"joined", "commited"}
            )
        told: list[tuple[str, int]] = []
        manager = Manager(
            model,
            optimizer,
            lighthouse=server.url,
            member="m",
            max_microbatch=48,
            on_event=lambda event, step: told.append((event, step)),
            events=("joined", "reduce_finished"),
            redundancy=None,
        )
        loader = ElasticLoader(digits_dataset())
        try:
            for step in manager.steps(loader, max_steps=2):
                for inputs, targets in step:
                    step.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                optimizer.zero_grad()
        finally:
            manager.close()
            loader.close()
        assert told == [("joined", 0), ("reduce_finished", 0), ("reduce_finished", 1)]
