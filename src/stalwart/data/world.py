"""Who this process is in the data-parallel world: rank discovery from torchrun and torch.distributed.

Is ``RANK`` the same as ``dist.get_rank()``?
    For the default process group of a job launched by ``torchrun``, yes:
    ``init_process_group`` with the default ``env://`` rendezvous reads
    ``RANK`` and ``WORLD_SIZE`` from the environment, so the two agree. They
    differ for the rank within a subgroup (``dist.get_rank(group)`` counts
    from 0 inside the group), and when the process group was created with
    explicit ``rank=``/``world_size=`` arguments that ignore the variables.
    :meth:`WorldInfo.from_env` checks that they agree and says so when they
    do not, instead of silently picking one.

``LOCAL_RANK`` is something else: the rank among the processes on this
node (``0 .. LOCAL_WORLD_SIZE - 1``), meant for choosing the device
(``cuda:{LOCAL_RANK}``), never for choosing data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from stalwart._validate import check_int

RANK_VARIABLES = ("RANK", "WORLD_SIZE")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class WorldInfo:
    """This process's global rank and world size, and its rank among the processes on its node."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank", self.rank, minimum=0, maximum=self.world_size - 1)
        check_int("local_world_size", self.local_world_size, minimum=1, maximum=self.world_size)
        check_int("local_rank", self.local_rank, minimum=0, maximum=self.local_world_size - 1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorldInfo:
        """Discover the world from torchrun's variables and, if initialised, the default process group.

        Reads ``RANK``/``WORLD_SIZE`` and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
        from ``environ`` (default ``os.environ``); each pair is set together or
        not at all. When ``torch.distributed`` is initialised, its default
        group's rank and world size are used and must agree with the
        variables where those are set. With neither, this is rank 0 of 1.
        """
        environ = os.environ if environ is None else environ
        rank_pair = _read_pair(environ, RANK_VARIABLES)
        local_pair = _read_pair(environ, LOCAL_RANK_VARIABLES)
        process_group = _process_group_rank()
        if process_group is not None:
            if rank_pair is not None and rank_pair != process_group:
                raise RuntimeError(
                    f"RANK={rank_pair[0]}, WORLD_SIZE={rank_pair[1]} disagree with torch.distributed's default "
                    f"group (rank {process_group[0]} of {process_group[1]}); was init_process_group called with "
                    "explicit rank/world_size? Launch with torchrun and init_process_group() without them, or "
                    "pass WorldInfo(rank, world_size) yourself"
                )
            rank_pair = process_group
        rank, world_size = rank_pair if rank_pair is not None else (0, 1)
        local_rank, local_world_size = local_pair if local_pair is not None else (0, 1)
        return cls(rank, world_size, local_rank, local_world_size)


def _read_pair(environ: Mapping[str, str], names: tuple[str, str]) -> tuple[int, int] | None:
    """Read a (rank, size) pair of variables: both set, or neither (None)."""
    present = [name for name in names if name in environ]
    if not present:
        return None
    if len(present) == 1:
        missing = next(name for name in names if name not in environ)
        raise ValueError(f"environment variable {present[0]} is set but {missing} is not; set both or neither")
    rank_name, size_name = names
    size = _read_int(environ, size_name, minimum=1)
    rank = _read_int(environ, rank_name, minimum=0)
    if rank >= size:
        raise ValueError(
            f"environment variable {rank_name} must be in [0, {size - 1}] ({size_name}={size}), got {rank}"
        )
    return rank, size


def _read_int(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    text = environ[name]
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None
    return check_int(f"environment variable {name}", value, minimum=minimum)


def _process_group_rank() -> tuple[int, int] | None:
    """The default process group's (rank, world size), or None when torch.distributed is not initialised.

    torch is imported here, not at module level, so that the pure data package
    does not load it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()
