"""What a shard holds, as members, resumes and audits compare it, and the error a shard that cannot be read raises.

Apart from :mod:`stalwart.data.shards` so that what compares identities (the
Manager's session and peers, the audit) does not import pyarrow, which the
readers need: 0.2 s of CPU in every worker interpreter that never reads a
shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stalwart.errors import StalwartError


class ShardError(StalwartError, RuntimeError):
    """A shard could not be read, or it no longer holds the rows it held when it was opened."""


@dataclass(frozen=True)
class ShardIdentity:
    """What a shard holds, as every member and every resume compares it: rows and content, not where it lies."""

    name: str
    rows: int
    digest: str

    def same_data(self, other: ShardIdentity) -> bool:
        """True when ``other`` holds the same rows (its name may differ)."""
        return (self.rows, self.digest) == (other.rows, other.digest)

    def describe(self) -> str:
        """``'part-003.parquet' (5000 rows, content 1a2b3c4d5e6f7a8b)``."""
        return f"{self.name!r} ({self.rows} rows, content {self.digest})"

    def to_list(self) -> list[Any]:
        """``[name, rows, digest]``: the JSON form in states and audit specs."""
        return [self.name, self.rows, self.digest]

    @classmethod
    def from_list(cls, value: Any) -> ShardIdentity:
        """The identity from :meth:`to_list`'s form; ``ValueError`` for anything else."""
        if (
            not isinstance(value, list | tuple)
            or len(value) != 3
            or not isinstance(value[0], str)
            or isinstance(value[1], bool)
            or not isinstance(value[1], int)
            or not isinstance(value[2], str)
        ):
            raise ValueError(f"a shard identity must be [name, rows, digest], got {value!r}")
        return cls(value[0], value[1], value[2])


def shard_difference(expected: Sequence[ShardIdentity], actual: Sequence[ShardIdentity], where: str) -> str | None:
    """None when ``actual`` holds the same data as ``expected``, shard by shard; else one phrase naming the first
    shard that differs, e.g. ``shard 3 is 'b.parquet' (...) here but 'a.parquet' (...) in the state``."""
    for number, (mine, theirs) in enumerate(zip(actual, expected, strict=False)):
        if not mine.same_data(theirs):
            return f"shard {number} is {mine.describe()} here but {theirs.describe()} in {where}"
    if len(actual) != len(expected):
        return f"there are {len(actual)} shards here but {len(expected)} in {where}"
    return None


def fingerprint_of(identities: Sequence[ShardIdentity]) -> str:
    """A digest of the shards' row counts and contents, in order (names left out)."""
    layout = json.dumps([[identity.rows, identity.digest] for identity in identities])
    return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()
