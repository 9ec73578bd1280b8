"""Semi-synchronous training across replica groups: DiLoCo and Streaming DiLoCo, with exactly-once rounds.

``Manager(..., sync=DiLoCo(inner_steps=H))`` keeps the user's loop: each
step it yields is an inner step, reduced within the replica group only; every
H inner steps the groups average their pseudo-gradients, weighted by the
samples each trained, and the outer optimizer updates the global parameters
every group continues from. A step of the ledger is a round, committed at the
outer step: a group that dies mid-round hands its whole share of the round
back, the survivors train it as extra inner steps, and the round commits the
samples it would have without the failure, each in one committed round.

The parts: :mod:`~stalwart.runtime.diloco.config` (the configuration and its
checks), :mod:`~stalwart.runtime.diloco.schedule` (inner steps and fragment
launches, pure), :mod:`~stalwart.runtime.diloco.fragments` (the parameters in
fragments, pure), :mod:`~stalwart.runtime.diloco.codec` (float32, bfloat16,
8-bit blocks), :mod:`~stalwart.runtime.diloco.exchange` (one fragment's
exchange across groups and its bytes), :mod:`~stalwart.runtime.diloco.outer`
(globals, outer optimizers, error feedback) and
:mod:`~stalwart.runtime.diloco.rounds` (the round loop the Manager runs).
"""

from stalwart.runtime.diloco.config import DiLoCo, nesterov_outer

__all__ = ["DiLoCo", "nesterov_outer"]
