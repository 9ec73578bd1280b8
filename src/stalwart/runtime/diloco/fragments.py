"""The model's parameters cut into fragments: runs of whole tensors, in model order, of about equal size.

Streaming DiLoCo synchronises one fragment at a time, so the peak of bytes on
the wire is a fragment's; a fragment holds whole tensors (a layer's weight and
bias may part, a tensor never splits) so that its outer optimizer is a plain
``torch.optim`` optimizer over them. Contiguous runs keep a transformer's
blocks together. Pure: sizes in, index runs out.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart._validate import check_int


def partition(sizes: Sequence[int], fragments: int) -> list[range]:
    """Cut tensors of ``sizes`` elements (model order) into ``fragments`` non-empty runs of about equal total.

    Fragment ``f`` ends at the tensor whose cumulative size is closest to
    ``(f + 1) / fragments`` of the total, leaving each later fragment at least
    one tensor. ``fragments`` may be at most ``len(sizes)``.
    """
    fragments = check_int("fragments", fragments, minimum=1, maximum=max(len(sizes), 1))
    if not sizes:
        raise ValueError("sizes must name at least one tensor")
    total = sum(sizes)
    cumulative = []
    running = 0
    for size in sizes:
        running += check_int("size", size, minimum=0)
        cumulative.append(running)
    runs: list[range] = []
    start = 0
    for fragment in range(fragments):
        remaining = fragments - fragment - 1
        if remaining == 0:
            runs.append(range(start, len(sizes)))
            break
        target = total * (fragment + 1) / fragments
        last = len(sizes) - remaining  # exclusive end: leave one tensor for each later fragment
        end = min(range(start + 1, last + 1), key=lambda stop: (abs(cumulative[stop - 1] - target), stop))
        runs.append(range(start, end))
        start = end
    return runs
