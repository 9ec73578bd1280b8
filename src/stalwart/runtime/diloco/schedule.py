"""A round's schedule: a group's inner steps over its share, and the inner steps its fragments synchronise at.

Pure integer rules (no torch, no I/O), the same on every process of a group,
so that the group's processes take the same inner steps and launch the same
exchanges without talking.

Inner steps
    A round is one step of the ledger: a group holds its share of the round
    (``ledger.in_flight[member]``), which began as its part of the round's
    total split among the members the round began with. That first share is
    cut into ``H`` regular inner steps by ``split_sizes`` (sizes differing by
    at most ``local_batch_multiple``). Positions a failure hands the group on
    top (``reassign`` appends them to its share) are trained in *extra* inner
    steps after the regular ones, each as large as the largest regular one:
    every inner step keeps the batch the inner optimizer was tuned for, and a
    failure found at the round's end, with no regular step left to spread the
    work over, is handled the same way as one found in its middle. Inner steps
    take the share's positions in order, so what a group has trained is a
    prefix of its share.

Fragment launches
    Fragment ``f`` of ``F`` launches its exchange after regular inner step
    ``(f + 1) * H // F - 1 - overlap`` and applies it ``overlap`` inner steps
    later (Streaming DiLoCo: staggered, overlapped with compute). A launch at
    the round's last regular step (no overlap: DiLoCo's single fragment) is the
    round's end instead, after any extra inner steps, so that the outer step
    holds every sample of the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stalwart.data.schedule import split_sizes

Positions = npt.NDArray[np.int64]


def fragment_launches(inner_steps: int, fragments: int, overlap: int) -> tuple[int, ...]:
    """After which regular inner step (from 0) each fragment's exchange is launched."""
    return tuple((fragment + 1) * inner_steps // fragments - 1 - overlap for fragment in range(fragments))


def at_round_end(launch: int, inner_steps: int) -> bool:
    """Whether a fragment launched after inner step ``launch`` is exchanged at the round's end instead."""
    return launch >= inner_steps - 1


@dataclass(frozen=True)
class InnerPlan:
    """How a group's share of a round is cut: ``regular`` sizes of its H inner steps, then extra steps of ``extra``."""

    regular: tuple[int, ...]
    extra: int

    def size(self, step: int) -> int:
        """Positions of inner step ``step`` (from 0) at most: a regular step's size, else the extra size."""
        return self.regular[step] if step < len(self.regular) else self.extra

    def count(self, share: int) -> int:
        """How many inner steps a share of ``share`` positions takes (regular ones first, then extras)."""
        regular = sum(self.regular)
        if share <= regular:
            taken = 0
            for steps, size in enumerate(self.regular):
                if taken >= share:
                    return steps
                taken += size
            return len(self.regular)
        return len(self.regular) + -(-(share - regular) // self.extra)


def inner_plan(round_total: int, began_with: list[str], member: str, inner_steps: int, multiple: int) -> InnerPlan:
    """The inner steps of ``member``'s share: its first share of ``round_total`` split among ``began_with``, cut in H.

    A member that did not begin the round (none does: joiners wait for a round's
    end) has an empty first share; its extras then go in steps of ``multiple``.
    """
    first = 0
    if member in began_with:
        first = split_sizes(round_total, len(began_with), multiple)[began_with.index(member)]
    regular = tuple(split_sizes(first, inner_steps, multiple))
    return InnerPlan(regular, max(max(regular), multiple))


def next_inner_positions(share: Positions, done: int, steps_done: int, plan: InnerPlan) -> Positions | None:
    """The group's positions of its next inner step (after ``steps_done`` steps took ``done`` positions), or None.

    None once the share is trained (no regular step is left and nothing more
    was handed over). A regular step may be empty (a share smaller than H
    chunks of the multiple); the group still takes it, as every group takes
    its H regular steps.
    """
    if steps_done >= len(plan.regular) and done >= share.size:
        return None
    size = plan.size(steps_done)
    return share[done : done + size]
