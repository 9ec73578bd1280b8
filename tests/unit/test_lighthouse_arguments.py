"""The lighthouse's constructor names a bad connection-hygiene setting, before it binds anything."""

from __future__ import annotations

import math

import pytest

from stalwart.coord.server import Lighthouse
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
