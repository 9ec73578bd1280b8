"""The Manager's configuration, grouped by what each part of it is for.

Each group is a frozen dataclass checked when it is built, so a bad value
fails at the line that wrote it, naming the field, the value and what is
allowed. The Manager takes the groups as keyword arguments::

    Manager(model, optimizer, lighthouse=url, member=name, max_microbatch=16,
            checkpoint=Checkpointing("ckpt", every_steps=100),
            reduction=Reduction(dtype=torch.bfloat16))

Timeouts are a group of their own (:class:`~stalwart.runtime.timeouts.Timeouts`),
resolved from the environment when not given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart._validate import check_int
from stalwart.data.world import WorldInfo

DEFAULT_BUCKET_CAP_MB = 25.0
"""DDP's default ``bucket_cap_mb``."""
REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Checkpointing:
    """Durable checkpoints: written by the quorum's writer every ``every_steps`` steps or ``every_seconds`` seconds.

    With sharded optimizer state only ``every_steps`` applies (every process
    gathers its shard to the writer at the same steps). ``keep``: how many
    finished checkpoints stay on disk.
    """

    directory: str | os.PathLike[str]
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike) or not str(self.directory):
            raise TypeError(f"Checkpointing.directory must be a path, got {self.directory!r}")
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("Checkpointing needs every_steps or every_seconds (got neither)")
        if self.every_steps is not None:
            check_int("Checkpointing.every_steps", self.every_steps, minimum=1)
        if self.every_seconds is not None and not _positive(self.every_seconds):
            raise ValueError(f"Checkpointing.every_seconds must be a positive number, got {self.every_seconds!r}")
        check_int("Checkpointing.keep", self.keep, minimum=1)

    @property
    def path(self) -> Path:
        """The checkpoint directory, resolved (announced paths are checked against it)."""
        return Path(self.directory).resolve()


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced: buckets of ``bucket_cap_mb`` (DDP's 25), in their own dtype or ``dtype``.

    ``dtype`` (for example ``torch.bfloat16``) halves the bytes on the wire;
    the step's counts ride in float32 either way.
    """

    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not _positive(self.bucket_cap_mb):
            raise ValueError(f"Reduction.bucket_cap_mb must be a positive number, got {self.bucket_cap_mb!r}")
        if self.dtype is not None and self.dtype not in REDUCE_DTYPES:
            raise ValueError(f"Reduction.dtype must be one of {list(REDUCE_DTYPES)} or None, got {self.dtype!r}")


@dataclass(frozen=True)
class Checks:
    """Replica consistency and heal bounds.

    ``every``: the replicas' parameter checksum rides in the all-reduce every
    this many steps (default: every step up to 2**17 parameters, less often
    for larger models); drifted replicas are healed from the majority.
    ``max_heal_bytes`` bounds what a heal may allocate (default: a few times
    this member's own state).

    ``audit_dir``: record what the job trained there, for ``stalwart audit
    DIR``. After each committed step the member's leading process appends
    the whole step's sample indices to ``DIR/steps-MEMBER.jsonl`` (every
    member the same step, so a member that dies loses nothing of the record)
    and the plan goes to ``DIR/audit.json``; the audit counts each step once
    and names any step the members recorded differently. A shared directory
    (or each member's copied into one) audits the whole job.
    """

    every: int | None = None
    max_heal_bytes: int | None = None
    audit_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.every is not None:
            check_int("Checks.every", self.every, minimum=1)
        if self.max_heal_bytes is not None:
            check_int("Checks.max_heal_bytes", self.max_heal_bytes, minimum=1)
        if self.audit_dir is not None:
            if not isinstance(self.audit_dir, str | os.PathLike) or not str(self.audit_dir):
                raise TypeError(f"Checks.audit_dir must be a directory path or None, got {self.audit_dir!r}")
            if Path(self.audit_dir).exists() and not Path(self.audit_dir).is_dir():
                raise ValueError(f"Checks.audit_dir must be a directory, got the file {str(self.audit_dir)!r}")


@dataclass(frozen=True)
class Transport:
    """How this process reaches the lighthouse and its peers.

    ``host``: the address peers reach this process at (its process group
    binds there). ``heartbeat_interval``: seconds between heartbeats (None,
    the default: a quarter of the lighthouse's ``heartbeat_timeout``, 0.5 s at
    its default 2 s; the lighthouse may recommend a longer one). Each beat
    takes the GIL from the training loop, and a dead member is found by the
    lighthouse's timeout, not by the interval, so a shorter one buys only
    fresher step reports. ``max_join_attempts``: quorums
    that could not start in a row before :class:`~stalwart.errors.JoinError`.
    """

    host: str = "127.0.0.1"
    heartbeat_interval: float | None = None
    max_join_attempts: int = 20

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"Transport.host must be a non-empty address, got {self.host!r}")
        if self.heartbeat_interval is not None and not _positive(self.heartbeat_interval):
            raise ValueError(
                "Transport.heartbeat_interval must be a positive number of seconds or None (a quarter of the "
                f"lighthouse's heartbeat timeout), got {self.heartbeat_interval!r}"
            )
        check_int("Transport.max_join_attempts", self.max_join_attempts, minimum=1)


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's place in a replica group that acts as one lighthouse member (a torchrun launch).

    ``store``: the group's own store (default: torchrun's agent store at
    ``MASTER_ADDR:MASTER_PORT`` when the group has several processes).
    """

    world: WorldInfo = field(default_factory=lambda: WorldInfo(rank=0, world_size=1))
    store: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.world, WorldInfo):
            raise TypeError(f"ReplicaGroup.world must be a WorldInfo, got {type(self.world).__name__}")
        if self.store is not None and not isinstance(self.store, dist.Store):
            raise TypeError(f"ReplicaGroup.store must be a torch.distributed.Store, got {type(self.store).__name__}")


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value > 0
