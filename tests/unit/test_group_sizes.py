"""Members' group sizes read from the quorum's store in batched requests, in member order (a loopback TCPStore).

Garbage sizes through the real lighthouse: ``test_hostile.py``.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from stalwart.coord.protocol import MAX_STORE_KEYS_PER_REQUEST
from stalwart.runtime.session import _group_sizes


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def test_sizes_come_in_member_order_across_request_batches(store: dist.TCPStore) -> None:
    members = [f"m{index}" for index in range(MAX_STORE_KEYS_PER_REQUEST + 3)]  # two requests
    sizes = [1 + index % 7 for index in range(len(members))]
    store.multi_set([f"group_size/{member}" for member in members], [str(size) for size in sizes])
    assert _group_sizes(store, members) == sizes
