"""The lighthouse's settings name a bad value, its field and what is allowed, before it binds anything."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest

from stalwart.coord.server import Lighthouse
from stalwart.coord.settings import LighthouseSettings
from stalwart.data.plan import EpochPlan

PLAN = EpochPlan(64, 8, seed=0)


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError), ("10", TypeError), (True, TypeError)],
)
def test_a_bad_header_timeout_is_refused_naming_it(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"header_timeout must be a (finite )?number of seconds"):
        Lighthouse(PLAN, header_timeout=value)  # type: ignore[arg-type]


def test_the_header_timeout_given_is_the_one_kept() -> None:
    assert Lighthouse(PLAN, header_timeout=2.5).header_timeout == 2.5


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"min_replicas": 0}, ValueError, r"min_replicas must be in \[1, inf\], got 0"),
        ({"min_replicas": 3, "start_replicas": 2}, ValueError, r"start_replicas must be in \[3, inf\], got 2"),
        ({"port": 70000}, ValueError, r"port must be in \[0, 65535\], got 70000"),
        ({"join_timeout": -1}, ValueError, r"join_timeout must be a finite number of seconds > 0, got -1"),
        ({"max_waiters": "8"}, TypeError, r"max_waiters must be an int, got '8'"),
        ({"balance_every": -2}, ValueError, r"balance_every must be in \[0, inf\], got -2"),
        ({"insecure": 1}, TypeError, r"insecure must be a bool, got 1"),
        ({"tls_cert": "cert.pem"}, ValueError, r"tls_cert and tls_key go together"),
        ({"state_path": 3}, TypeError, r"state_path must be a str, an os.PathLike or None, got 3"),
        ({"store_limits": {}}, TypeError, r"store_limits must be a StoreLimits or None, got \{\}"),
        (
            {"join_timeut": 1.0},
            TypeError,
            r"unknown lighthouse setting\(s\) join_timeut: the settings are .*join_timeout",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_it_its_value_and_what_is_allowed(
    overrides: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Lighthouse(PLAN, **overrides)


def test_a_bad_token_is_refused_without_echoing_it() -> None:
    secret = "s3cret\nvalue"
    with pytest.raises(ValueError, match=r"token must be 1 to \d+ characters of printable ASCII") as refused:
        LighthouseSettings(token=secret)
    assert secret not in str(refused.value) and "s3cret" not in str(refused.value)
    assert "s3cret" not in repr(LighthouseSettings(token="s3cret")), "a settings' repr may land in a log"


def test_keywords_replace_the_fields_of_the_settings_given() -> None:
    settings = LighthouseSettings(min_replicas=2, join_timeout=7, header_timeout=3.0)
    lighthouse = Lighthouse(PLAN, settings, join_timeout=9.0)
    assert lighthouse.settings == replace(settings, join_timeout=9.0)
    assert (lighthouse.join_timeout, lighthouse.header_timeout, lighthouse.state.min_replicas) == (9.0, 3.0, 2)
    assert isinstance(settings.join_timeout, float), "seconds are kept as floats"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
