"""The update contract: the user's own ``optimizer.step()`` is the update of a reduced step, and only that.

Inside ``manager.steps()``, iterating a step's micro-batches ends with the
quorum's reduced mean gradient in ``param.grad``; from there to the end of
the loop body is the step's *update window*: the user's code clips, unscales
(a GradScaler), logs and calls ``optimizer.step()`` (or lets the GradScaler
skip it: every member sees the same reduced gradient, so every member
decides the same). A step pre-hook on the user's optimizer refuses a call
outside the window (the gradients would be this process's unreduced ones)
or a second call in one window, with :class:`~stalwart.errors.StepContractError`.

With sharded state the update is the sharded one: the pre-hook takes the
gradients over (every ``param.grad`` becomes None, so the optimizer's own
step has nothing to do and creates no state) and the post-hook updates the
held shards with the groups' hyper-parameters as the user's code left them,
then syncs the parameters (:mod:`stalwart.runtime.zero`). Schedulers and
GradScaler see a real ``optimizer.step()`` call either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stalwart.errors import StepContractError
from stalwart.runtime.events import Event, Notify
from stalwart.runtime.zero import ShardedOptimizer


class UpdateWindow:
    """Guards ``optimizer.step()`` with hooks; with ``sharded``, makes it the sharded update followed by ``sync()``.

    ``notify`` is told ``update_started`` before a sharded update (a kill point of the failure tests).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        sharded: ShardedOptimizer | None,
        notify: Notify,
        sync: Callable[[], None],
    ) -> None:
        self._sharded = sharded
        self._notify = notify
        self._sync = sync
        self._step: int | None = None
        self._passthrough = 0
        self.updates = 0
        """``optimizer.step()`` calls in the open window."""
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    @property
    def is_open(self) -> bool:
        return self._step is not None

    def open(self, step: int) -> None:
        """Step ``step``'s gradients are reduced: ``optimizer.step()`` may run once."""
        self._step = step
        self.updates = 0

    def close(self) -> int:
        """End the window (the step commits); how many updates ran in it (0 or 1)."""
        self._step = None
        return self.updates

    @contextlib.contextmanager
    def passthrough(self) -> Iterator[None]:
        """Let torch's own ``optimizer.step()`` calls through unguarded (DCP initialises a fresh optimizer's state
        with a step at learning rate 0 when it saves or loads one)."""
        self._passthrough += 1
        try:
            yield
        finally:
            self._passthrough -= 1

    def remove(self) -> None:
        """Remove the hooks (the Manager is closed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._passthrough:
            return
        if self._step is None:
            raise StepContractError(
                "optimizer.step() was called outside a reduced step: inside manager.steps(), call it after iterating "
                "the step's micro-batches (the gradients are then the quorum's mean), once per step"
            )
        if self.updates:
            raise StepContractError(f"optimizer.step() was called twice in step {self._step}: call it once per step")
        if self._sharded is not None:
            self._sharded.take_gradients()

    def _after_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._passthrough:
            return
        self.updates += 1
        if self._sharded is not None:
            self._notify(Event.UPDATE_STARTED)
            self._sharded.update()
            self._sync()
