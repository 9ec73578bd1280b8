"""torchtitan config functions for stalwart's trainer: ``--module stalwart.integrations.torchtitan --config NAME``.

torchtitan's ``ConfigManager`` imports ``MODULE.config_registry`` and calls
the function ``--config`` names; the ``Trainer.Config`` subclass it returns
builds its own trainer. :func:`with_stalwart` turns any torchtitan config
into :class:`~stalwart.integrations.torchtitan.trainer.StalwartTrainer`'s,
so a user's own config function changes one line::

    return with_stalwart(my_config(), FaultTolerance(replica_id=0))
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3.config_registry import llama3_debugmodel as titan_llama3_debugmodel
from torchtitan.trainer import Trainer

from stalwart.integrations.torchtitan.config import FaultTolerance
from stalwart.integrations.torchtitan.trainer import StalwartTrainer


def with_stalwart(
    config: Trainer.Config,
    fault_tolerance: FaultTolerance | None = None,
    *,
    trainer: type[StalwartTrainer] = StalwartTrainer,
) -> StalwartTrainer.Config:
    """``config`` (any torchtitan ``Trainer.Config``) as stalwart's trainer's, with ``fault_tolerance``'s flags.

    ``trainer``: a subclass of :class:`StalwartTrainer` whose ``Config`` builds it (your own seams on top).
    """
    if not isinstance(trainer, type) or not issubclass(trainer, StalwartTrainer):
        raise TypeError(f"trainer must be StalwartTrainer or a subclass of it, got {trainer!r}")
    if not isinstance(config, Trainer.Config):
        raise TypeError(f"config must be a torchtitan Trainer.Config, got {type(config).__name__}")
    if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
        raise TypeError(f"fault_tolerance must be a FaultTolerance or None, got {type(fault_tolerance).__name__}")
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
    return trainer.Config(**fields, fault_tolerance=fault_tolerance or FaultTolerance())


def llama3_debugmodel() -> StalwartTrainer.Config:
    """torchtitan's llama3 debug model (``llama3_debugmodel``) trained by stalwart's trainer."""
    return with_stalwart(titan_llama3_debugmodel())
