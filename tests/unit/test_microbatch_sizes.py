"""The micro-batch sizes of a process's part of its group's positions (every-step parts and DiLoCo's inner steps)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from stalwart.data.info import split_group_share
from stalwart.runtime.planner import microbatch_sizes


@given(
    positions=st.integers(min_value=0, max_value=200),
    group_size=st.integers(min_value=1, max_value=5),
    multiple=st.integers(min_value=1, max_value=4),
    max_microbatch=st.integers(min_value=1, max_value=9),
    lockstep=st.booleans(),
)
def test_sizes_cover_the_process_share_and_lockstep_groups_run_as_many_micro_batches(
    positions: int, group_size: int, multiple: int, max_microbatch: int, lockstep: bool
) -> None:
    group = np.arange(positions, dtype=np.int64) * 3
    per_rank = [
        microbatch_sizes(group, group_size, rank, multiple, max_microbatch, lockstep) for rank in range(group_size)
    ]
    for rank, sizes in enumerate(per_rank):
        assert sum(sizes) == split_group_share(group, group_size, rank, multiple).size
        assert all(0 <= size <= max_microbatch for size in sizes)
        real = [size for size in sizes if size]
        assert list(sizes[: len(real)]) == real  # the zero-sample micro-batches pad the end
        assert len(real) == -(-sum(sizes) // max_microbatch)
    counts = {len(sizes) for sizes in per_rank}
    if lockstep:  # FSDP2 groups: every process runs the group's collectives as often
        assert len(counts) == 1
    else:
        assert all(0 not in sizes for sizes in per_rank)
