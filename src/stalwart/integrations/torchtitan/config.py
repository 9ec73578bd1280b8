"""The ``--fault_tolerance.*`` flags of stalwart's torchtitan trainer, and the checks of a torchtitan config.

The names follow torchtitan's own torchft integration where they mean the
same thing (``replica_id``, ``group_size``, ``min_replica_size``,
``process_group``, ``process_group_timeout_ms``, ``semi_sync_method``,
``sync_steps``, ``num_fragments``); ``redundancy`` and ``audit_dir`` are
stalwart's. The global batch is torchtitan's ``--training.global_batch_size``:
with stalwart it spans every replica group and stays constant whatever groups
are alive, so no flag here sets it. The lighthouse's URL and token come from
``STALWART_LIGHTHOUSE`` and ``STALWART_LIGHTHOUSE_TOKEN``, as everywhere in
stalwart. The quorum's minimum size is the lighthouse's ``--min-replicas``
(one setting for every group): ``min_replica_size``, when set, is checked
against it at start-up (:func:`check_min_replica_size`), so a torchft config
never runs under a lighthouse with another minimum.

Pure: nothing here imports torchtitan, so the checks run (and are tested)
without it. Each check raises ``ValueError`` naming the flag, the value and
what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.redundancy.config import parse_redundancy
from stalwart.runtime.config import Checkpointing
from stalwart.runtime.diloco.config import DiLoCo

SEMI_SYNC_METHODS = ("diloco",)
PROCESS_GROUPS = {"cpu": "gloo", "cuda": "nccl"}
"""The backend stalwart reduces across groups with, by device type."""


@dataclass(kw_only=True, slots=True)
class FaultTolerance:
    """``--fault_tolerance.*``: this torchrun job's place among the replica groups, and how they synchronise."""

    replica_id: int = 0
    """This replica group's number: its lighthouse member is ``replica-<replica_id>``."""

    group_size: int = 0
    """How many replica groups the job has at most (``replica_id`` must be below it); 0: not checked."""

    min_replica_size: int = 0
    """The fewest replica groups a quorum may have, as torchft's flag; in stalwart the lighthouse's
    ``--min-replicas`` sets it, and a nonzero value here must equal that (checked at start-up); 0: not checked."""

    process_group: str | None = None
    """The backend across groups: ``gloo`` on CPU, ``nccl`` on CUDA (default: the device's)."""

    process_group_timeout_ms: int | None = None
    """A collective across groups gives up after this many milliseconds (default: ``STALWART_COLLECTIVE_TIMEOUT``
    or stalwart's default)."""

    semi_sync_method: str | None = None
    """None: every step's gradients reduce across groups; ``diloco``: an outer step every ``sync_steps``."""

    sync_steps: int = 5
    """DiLoCo: inner steps per round (``training.steps`` must be a multiple)."""

    num_fragments: int = 1
    """DiLoCo: 1, or more for Streaming DiLoCo (each fragment synchronised once a round)."""

    redundancy: str | None = None
    """Shard the optimizer's state across groups: ``overlap:F`` or ``parity:K,M`` (stalwart's ``Overlap``,
    ``Parity``); None keeps a whole copy in every group."""

    audit_dir: str | None = None
    """A directory where each group's leader records every committed step's samples, for ``stalwart audit``."""

    checkpoint_folder: str | None = None
    """stalwart's durable checkpoints (the model, the optimizer, the LR schedulers and the trainer's counters, with
    the ledger's step): written here by one group every ``checkpoint_interval`` steps, and what a restart of the
    whole fleet resumes from, each sample trained once. A folder every group can read (shared storage). Unlike
    torchtitan's own ``--checkpoint.*`` (a group's own state, which a restarted group loads while others live)."""

    checkpoint_interval: int = 0
    """Steps between stalwart's durable checkpoints (rounds under DiLoCo); needed with ``checkpoint_folder``."""

    def member(self) -> str:
        """This group's lighthouse member name."""
        return f"replica-{self.replica_id}"

    def sync(self) -> DiLoCo | None:
        """The Manager's ``sync``: DiLoCo's rounds, or None for every-step reduction."""
        if self.semi_sync_method is None:
            return None
        return DiLoCo(inner_steps=self.sync_steps, fragments=self.num_fragments)

    def checkpointing(self) -> Checkpointing | None:
        """The Manager's ``checkpoint``: stalwart's durable checkpoints, or None without ``checkpoint_folder``."""
        if self.checkpoint_folder is None:
            return None
        return Checkpointing(self.checkpoint_folder, every_steps=self.checkpoint_interval)


def check_fault_tolerance(flags: FaultTolerance, *, device_type: str) -> None:
    """Refuse flags stalwart cannot run, each error naming the flag, its value and what is allowed."""
    _check_count("fault_tolerance.replica_id", flags.replica_id, minimum=0)
    _check_count("fault_tolerance.group_size", flags.group_size, minimum=0)
    if flags.group_size and flags.replica_id >= flags.group_size:
        raise ValueError(
            f"fault_tolerance.replica_id={flags.replica_id} must be below fault_tolerance.group_size="
            f"{flags.group_size} (or set group_size to 0)"
        )
    _check_count("fault_tolerance.min_replica_size", flags.min_replica_size, minimum=0)
    if flags.group_size and flags.min_replica_size > flags.group_size:
        raise ValueError(
            f"fault_tolerance.min_replica_size={flags.min_replica_size} exceeds fault_tolerance.group_size="
            f"{flags.group_size}: no quorum could form; allowed is 0 (not checked) up to group_size"
        )
    expected = PROCESS_GROUPS.get(device_type)
    if flags.process_group is not None and flags.process_group != expected:
        allowed = f"{expected!r} on {device_type}" if expected else f"one of {sorted(set(PROCESS_GROUPS.values()))}"
        raise ValueError(f"fault_tolerance.process_group={flags.process_group!r}: allowed is {allowed}, or unset")
    if flags.process_group_timeout_ms is not None:
        _check_count("fault_tolerance.process_group_timeout_ms", flags.process_group_timeout_ms, minimum=1)
    if flags.semi_sync_method is not None and flags.semi_sync_method not in SEMI_SYNC_METHODS:
        raise ValueError(
            f"fault_tolerance.semi_sync_method={flags.semi_sync_method!r}: allowed are {list(SEMI_SYNC_METHODS)} "
            "or unset (every step reduces across groups)"
        )
    _check_count("fault_tolerance.sync_steps", flags.sync_steps, minimum=1)
    _check_count("fault_tolerance.num_fragments", flags.num_fragments, minimum=1)
    if flags.semi_sync_method is None and flags.num_fragments != 1:
        raise ValueError(
            f"fault_tolerance.num_fragments={flags.num_fragments} needs fault_tolerance.semi_sync_method='diloco'"
        )
    try:
        redundancy = parse_redundancy(flags.redundancy)
    except (TypeError, ValueError) as error:
        raise ValueError(f"fault_tolerance.redundancy: {error}") from None
    if redundancy is not None and flags.semi_sync_method is not None:
        raise ValueError(
            f"fault_tolerance.redundancy={flags.redundancy!r} with semi_sync_method={flags.semi_sync_method!r}: each "
            "group keeps its own inner optimizer state under DiLoCo; leave redundancy unset"
        )
    if flags.audit_dir is not None and not flags.audit_dir:
        raise ValueError("fault_tolerance.audit_dir must be a directory path or unset, got ''")
    _check_count("fault_tolerance.checkpoint_interval", flags.checkpoint_interval, minimum=0)
    if flags.checkpoint_folder is not None:
        if not flags.checkpoint_folder:
            raise ValueError("fault_tolerance.checkpoint_folder must be a directory path or unset, got ''")
        if not flags.checkpoint_interval:
            raise ValueError(
                f"fault_tolerance.checkpoint_folder={flags.checkpoint_folder!r} needs "
                "fault_tolerance.checkpoint_interval, the steps between checkpoints (an integer >= 1)"
            )
    elif flags.checkpoint_interval:
        raise ValueError(
            f"fault_tolerance.checkpoint_interval={flags.checkpoint_interval} needs fault_tolerance.checkpoint_folder, "
            "where the checkpoints go"
        )


def check_min_replica_size(flags: FaultTolerance, lighthouse_status: Mapping[str, Any]) -> None:
    """Refuse a nonzero ``min_replica_size`` other than the lighthouse's ``--min-replicas``.

    ``lighthouse_status`` is the lighthouse's ``/v1/status`` JSON. torchft's
    Manager takes the quorum's minimum from this flag; stalwart's lighthouse
    holds one minimum for every group, so a torchft config that names one
    runs only where the lighthouse enforces the same (never a silent change).
    """
    wanted = flags.min_replica_size
    _check_count("fault_tolerance.min_replica_size", wanted, minimum=0)
    if not wanted:
        return
    actual = lighthouse_status.get("min_replicas")
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise ValueError(
            f"fault_tolerance.min_replica_size={wanted}: the lighthouse's status has no integer min_replicas to "
            f"check it against (got {actual!r}); drop the flag (0: not checked)"
        )
    if wanted != actual:
        raise ValueError(
            f"fault_tolerance.min_replica_size={wanted}, but the lighthouse runs with --min-replicas {actual} (in "
            f"stalwart the quorum's minimum is the lighthouse's): start the lighthouse with --min-replicas {wanted}, "
            "or drop --fault_tolerance.min_replica_size (0: not checked)"
        )


@dataclass(frozen=True)
class TrainingShape:
    """What of a torchtitan config stalwart's trainer depends on (read from the config and the built trainer)."""

    global_batch_size: int
    local_batch_size: int
    steps: int
    degrees: dict[str, int]
    """Parallelism degrees other than FSDP's (``tensor_parallel_degree``, ...) by their flag names."""
    optimizers: int
    """Optimizer instances in torchtitan's container."""
    cuda_graphs: bool
    """CUDA graphs would capture the forward and backward (on CUDA, unless ``training.disable_cuda_graphs``)."""
    checkpointing: bool = False
    """torchtitan's checkpointer is enabled (``checkpoint.enable``)."""


def check_training(shape: TrainingShape, flags: FaultTolerance) -> None:
    """Refuse a torchtitan config stalwart's trainer cannot run, naming the flag, the value and what is allowed."""
    if shape.global_batch_size <= 0:
        raise ValueError(
            f"training.global_batch_size={shape.global_batch_size}: with stalwart it is the global batch over every "
            "replica group, kept constant as groups fail and rejoin; set it to a positive number of samples"
        )
    _check_count("training.local_batch_size", shape.local_batch_size, minimum=1)
    for name, degree in shape.degrees.items():
        if degree != 1:
            raise ValueError(
                f"parallelism.{name}={degree}: stalwart's torchtitan trainer splits a group's share of each step "
                "among the group's processes, so inside a group only FSDP (data_parallel_shard_degree) is "
                "supported; allowed: 1 (replica groups are separate torchrun jobs, not a replicate degree)"
            )
    if shape.optimizers != 1:
        raise ValueError(
            f"optimizer.param_groups build {shape.optimizers} optimizers: stalwart's trainer updates through one "
            "optimizer; use one optimizer_name for every parameter group"
        )
    if shape.cuda_graphs:
        raise ValueError(
            "training.disable_cuda_graphs=False on CUDA: stalwart back-propagates each micro-batch weighted by its "
            "tokens and varies the micro-batches per step as groups come and go; set --training.disable_cuda_graphs"
        )
    if shape.checkpointing and flags.redundancy is not None:
        raise ValueError(
            f"checkpoint.enable with fault_tolerance.redundancy={flags.redundancy!r}: torchtitan's checkpointer "
            "initialises an empty optimizer state with a step of its own, which the sharded optimizer refuses; "
            "disable one of them"
        )
    if flags.semi_sync_method is not None and shape.steps % flags.sync_steps:
        raise ValueError(
            f"training.steps={shape.steps} must be a multiple of fault_tolerance.sync_steps={flags.sync_steps} "
            "(DiLoCo commits whole rounds)"
        )


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: allowed is an integer >= {minimum}")
