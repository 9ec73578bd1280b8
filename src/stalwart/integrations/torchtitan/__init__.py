"""stalwart inside torchtitan: a ``Trainer`` whose replica groups survive failures (docs/guide/torchtitan.md).

Turn it on in a torchtitan config function by building
``StalwartTrainer.Config`` instead of ``Trainer.Config`` (or
:func:`~stalwart.integrations.torchtitan.config_registry.with_stalwart`
around an existing one) and launch each replica group as its own torchrun
job with ``--module stalwart.integrations.torchtitan``. This package's
``__init__`` imports nothing of torchtitan: ``config`` (the flags and their
checks) and ``data`` (the packed dataset) read without it; ``trainer`` and
``config_registry`` import it.
"""

from stalwart.integrations.torchtitan.config import FaultTolerance

__all__ = ["FaultTolerance"]
