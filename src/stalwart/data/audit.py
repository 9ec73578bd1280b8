"""Coverage audit: were an epoch's samples consumed exactly once?"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Coverage:
    """What a set of consumers took of an expected set of samples."""

    consumed: int
    duplicates: dict[int, int]
    missing: list[int]
    unexpected: list[int]

    @property
    def exactly_once(self) -> bool:
        """True when every expected sample was consumed once and nothing else was."""
        return not self.duplicates and not self.missing and not self.unexpected


def coverage(consumed: Iterable[npt.ArrayLike], expected: npt.ArrayLike) -> Coverage:
    """Compare the concatenation of ``consumed`` index lists with the ``expected`` indices.

    ``duplicates`` maps each index taken more than once to how often it was
    taken; ``missing`` lists expected indices never taken; ``unexpected`` those
    taken that were not expected (sorted).
    """
    parts = [np.asarray(part, dtype=np.int64).reshape(-1) for part in consumed]
    taken = np.concatenate([np.zeros(0, dtype=np.int64), *parts])
    wanted = np.unique(np.asarray(expected, dtype=np.int64))
    values, counts = np.unique(taken, return_counts=True)
    repeated = counts > 1
    return Coverage(
        consumed=int(taken.size),
        duplicates=dict(zip(values[repeated].tolist(), counts[repeated].tolist())),
        missing=np.setdiff1d(wanted, values, assume_unique=True).tolist(),
        unexpected=np.setdiff1d(values, wanted, assume_unique=True).tolist(),
    )
