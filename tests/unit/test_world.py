"""Rank discovery: torchrun's variables, the default process group, and their agreement."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from stalwart.data.world import WorldInfo


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A real single-process gloo group (rank 0 of 1) on a FileStore, torn down afterwards."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torchrun_variables_are_read() -> None:
    environ = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert WorldInfo.from_env(environ) == WorldInfo(rank=5, world_size=8, local_rank=1, local_world_size=4)


def test_no_variables_and_no_process_group_is_rank_0_of_1() -> None:
    assert not dist.is_initialized()
    assert WorldInfo.from_env({}) == WorldInfo(0, 1, 0, 1)


def test_surrounding_whitespace_is_accepted() -> None:
    assert WorldInfo.from_env({"RANK": " 2 ", "WORLD_SIZE": "3\n"}) == WorldInfo(2, 3)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "LOCAL_WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "local_world_size"),
    ],
)
def test_malformed_variables_name_the_variable_and_value(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named) as caught:
        WorldInfo.from_env(environ)
    bad = next((value for value in environ.values() if not value.strip().lstrip("-").isdigit()), None)
    if bad is not None:
        assert repr(bad) in str(caught.value)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ((0, 0), "world_size"),
        ((2, 2), "rank"),
        ((-1, 2), "rank"),
        ((0, 2, 1, 1), "local_rank"),
        ((0, 2, 0, 3), "local_world_size"),
    ],
)
def test_world_info_is_validated(arguments: tuple[int, ...], named: str) -> None:
    with pytest.raises(ValueError, match=rf"^{named} must be in"):
        WorldInfo(*arguments)


def test_world_info_rejects_non_integers() -> None:
    with pytest.raises(TypeError, match="rank"):
        WorldInfo("0", 1)  # type: ignore[arg-type]


@pytest.mark.usefixtures("process_group")
def test_initialised_process_group_is_used_without_variables() -> None:
    assert WorldInfo.from_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) == WorldInfo(0, 1)


@pytest.mark.usefixtures("process_group")
def test_variables_agreeing_with_the_process_group_are_accepted() -> None:
    assert WorldInfo.from_env({"RANK": "0", "WORLD_SIZE": "1"}) == WorldInfo(0, 1)


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("environ", [{"RANK": "1", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "4"}])
def test_variables_disagreeing_with_the_process_group_raise(environ: dict[str, str]) -> None:
    with pytest.raises(RuntimeError, match=r"disagree with torch.distributed's default group \(rank 0 of 1\)"):
        WorldInfo.from_env(environ)


def test_process_group_is_torn_down_between_tests() -> None:
    assert not dist.is_initialized()
