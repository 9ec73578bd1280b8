"""The Manager's durable checkpoints: when the quorum's writer saves, how a finished one is reported, and loading.

The quorum's rank 0 writes (:class:`~stalwart.runtime.checkpoint.Checkpointer`,
in the background) every ``every_steps`` steps or ``every_seconds`` seconds
and at the job's last step, and reports each finished checkpoint to the
lighthouse, again while its step is not committed there (heartbeats lag).
Only a replica that trained the step itself writes it (one healed to it does
not), so two quorums never write the same step. With sharded optimizer state
every process sends its shard to the writer at the same steps (one
all-to-all), so the whole state is saved and loads at any world size; in
FSDP2 groups, process r of every group sends to process r of the writing
group.

A member that is an FSDP2 group (``fully_shard`` over its own processes)
writes with all of its processes, each its shards, through a Gloo group made
for that at start-up; they checkpoint at ``every_steps`` only, and wait for
the last checkpoint to end before deciding on the next, so that all of them
decide alike.

When no live member holds the job's state, the lighthouse announces the
newest checkpoint: a worker loads it only from inside its own checkpoint
directory, and only if it holds the announced step and digest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stalwart.coord.client import CheckpointAnnouncement, LighthouseError
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.data.ledger import DataLedger
from stalwart.errors import StateLostError
from stalwart.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointMeta, load_checkpoint
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.config import Checkpointing
from stalwart.runtime.replica import Replica
from stalwart.runtime.session import QuorumSession
from stalwart.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)

ANNOUNCE_BACKOFF = 0.2
ANNOUNCE_RETRIES = 50
"""A checkpoint is reported until the lighthouse has committed its step (heartbeats lag): ~10 s at most."""


class CheckpointPolicy:
    """Durable checkpoints of ``replica`` under ``config``, for the member of ``session``."""

    def __init__(
        self,
        config: Checkpointing,
        session: QuorumSession,
        replica: Replica,
        sharded: ShardedOptimizer | None,
        *,
        fsdp_group: bool = False,
    ) -> None:
        """``fsdp_group``: this member's model is ``fully_shard``-ed over its processes (the default process group)."""
        if (sharded is not None or fsdp_group) and (config.every_steps is None or config.every_seconds is not None):
            what = "sharded optimizer state" if sharded is not None else "an FSDP2 group"
            raise ValueError(
                f"{what} checkpoints at Checkpointing.every_steps and not every_seconds (got "
                f"every_steps={config.every_steps}, every_seconds={config.every_seconds}): every process takes "
                "part at the same step"
            )
        self.config = config
        self._session = session
        self._replica = replica
        self._sharded = sharded
        self._process_group = _group_writers(session) if fsdp_group else None
        self._writer = Checkpointer(
            config,
            on_finished=self._announce,
            process_group=self._process_group,
            finishes=session.group.is_leader,
        )

    def between_steps(self, ledger: DataLedger | None, *, last: bool = False) -> bool:
        """Start a checkpoint when one is due; False when gathering sharded state failed (re-form the quorum).

        Called between steps, after the training loop's body ran for the last
        one, so that what the loop steps there (an LR scheduler) is in the
        checkpoint as of the same step as the model. ``last``: the job's last
        step, checkpointed whatever the cadence. ``ledger``: as committed at
        this step; None when this process does not hold it (it joined here):
        it takes part in gathering the state, and writes nothing.
        """
        if self._sharded is not None:
            return self._checkpoint_shards(ledger, last=last)
        if self._process_group is not None:
            if not self._together_at(self._replica.applied_step, last=last):
                return True
            self._writer.wait()  # every process of the group decides with no checkpoint being written
        if ledger is not None and self._replica.trained_step == self._replica.applied_step and self._writes():
            step = self._replica.applied_step
            if self._writer.due(step, last=last):
                self._writer.start(self._replica.states, _meta(step, ledger))
        return True

    def final(self, ledger: DataLedger | None) -> bool:
        """At the end of the job the writer checkpoints the last step, so a late joiner finds the job done."""
        self._writer.wait()
        healthy = self.between_steps(ledger, last=True)
        self._writer.wait()
        return healthy

    def wait(self, timeout: float) -> bool:
        """Wait for a checkpoint being written and reported; False if it still is after ``timeout`` seconds."""
        return self._writer.wait(timeout)

    def load(self, announcement: CheckpointAnnouncement) -> int:
        """Load the checkpoint the quorum resumes from (every member holds the whole state: any world size).

        Returns its step. The announced path must lie inside this worker's
        own checkpoint directory (DCP's metadata is pickled: never load a file
        a peer named elsewhere).
        """
        path = Path(announcement.path).resolve()
        root = self.config.path
        if not path.is_relative_to(root):
            raise StateLostError(
                f"the lighthouse announced checkpoint {announcement.path}, which is outside this worker's "
                f"checkpoint directory {root}: refusing to load it"
            )
        try:
            meta = load_checkpoint(path, self._replica.states, process_group=self._process_group)
        except CheckpointError as error:
            raise StateLostError(f"the job resumes from checkpoint {path}, which fails: {error}") from None
        if meta.step != announcement.step or meta.digest != announcement.digest:
            raise StateLostError(
                f"checkpoint {path} holds step {meta.step} (digest {meta.digest}), "
                f"the lighthouse announced step {announcement.step} (digest {announcement.digest})"
            )
        log.info("%s: resumed from checkpoint %s at step %d", self._session.member, path, meta.step)
        return meta.step

    def _together_at(self, step: int, *, last: bool) -> bool:
        """Whether processes that checkpoint together (sharded state, an FSDP2 group) take part at ``step``.

        At every ``every_steps``-th step and the last, never step 0: the same
        decision on every process, whatever its writer's clock.
        """
        every = self.config.every_steps
        assert every is not None  # __init__ refuses these without every_steps
        return step != 0 and (last or step % every == 0)

    def _writes(self) -> bool:
        """Whether this process writes: the quorum's rank 0, or (FSDP2 groups) every process of its first member."""
        session = self._session
        if session.comm is None:
            return False
        if self._process_group is not None:
            return bool(session.members) and session.members[0] == session.member
        return session.rank == 0

    def _checkpoint_shards(self, ledger: DataLedger | None, *, last: bool) -> bool:
        """Sharded state: every process sends its shard to the writer at the same steps; the writer saves it all.

        The whole optimizer state sits in the user's optimizer only while the
        checkpoint stages it, so the checkpoint loads at any world size. In
        FSDP2 groups the state of each FSDP shard is split across the groups:
        process r of every group sends its part to process r of the writing
        group (the quorum's first), and that group's processes save together.
        """
        assert self._sharded is not None
        step = self._replica.applied_step
        if not self._together_at(step, last=last):
            return True
        if self._process_group is not None:
            self._writer.wait()  # every process of the group decides with no checkpoint being written
        comm = self._session.grad_comm  # the processes that share the state (FSDP2 groups: of this shard)
        assert comm is not None
        try:
            whole = self._sharded.gather_state(comm)
        except CollectiveError as error:
            log.warning("%s: gathering step %d's checkpoint failed (%s)", self._session.member, step, error)
            return False
        writes = ledger is not None and self._writes() and self._replica.trained_step == step
        if whole is None or not writes or not self._writer.due(step, last=last):
            return True
        optimizer = self._replica.optimizer
        optimizer.load_state_dict(whole)
        try:
            self._writer.start(self._replica.states, _meta(step, ledger))
        finally:
            optimizer.state.clear()
        return True

    def _announce(self, directory: Path, meta: CheckpointMeta) -> None:
        """Report a finished checkpoint to the lighthouse, again while its step is not committed there (409).

        Runs on the checkpoint writer's thread; the lighthouse client is thread-safe.
        """
        client = self._session.client
        if client is None:
            return
        member = self._session.member
        for attempt in range(ANNOUNCE_RETRIES):
            try:
                client.report_checkpoint(meta.step, str(directory.resolve()), meta.ledger, meta.digest)
            except LighthouseError as error:
                if error.status == 409 and attempt + 1 < ANNOUNCE_RETRIES:
                    time.sleep(ANNOUNCE_BACKOFF)
                    continue
                log.warning("%s: the lighthouse refused checkpoint %s: %s", member, directory, error)
                return
            except (RuntimeError, OSError) as error:
                log.warning("%s: checkpoint %s not reported: %s", member, directory, error)
                return
            log.info("%s: checkpoint of step %d in %s", member, meta.step, directory)
            self._writer.prune(meta.step)
            return


def _group_writers(session: QuorumSession) -> Any:
    """A Gloo group of this FSDP2 group's processes (the default process group's), for DCP's saves and loads.

    Not the default group itself: an asynchronous save runs its collectives
    on DCP's thread, and two threads must not issue collectives on one group.
    Every process of the group makes it at the same point (the Manager's
    construction), as ``new_group`` requires.
    """
    size = session.group.size
    if not dist.is_initialized() or dist.get_world_size() != size:
        found = dist.get_world_size() if dist.is_initialized() else "none"
        raise ValueError(
            f"checkpoints of an FSDP2 group need its processes as the default process group ({size} processes, "
            f"ReplicaGroup's world size); found {found}"
        )
    return dist.new_group(backend="gloo")


def _meta(step: int, ledger: DataLedger | None) -> CheckpointMeta:
    assert ledger is not None and not ledger.in_step, "a checkpoint holds a committed ledger"
    state = ledger.state_dict()
    return CheckpointMeta(step, state, ledger_digest(state))
