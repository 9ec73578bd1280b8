"""DiLoCo's pure parts and its exchange: fragments, the inner-step schedule, the codecs, error feedback.

The exchange runs over real Gloo groups (one thread per group, on a TCPStore
on 127.0.0.1): every group must end with the same bits, and the sum must be
the weighted sum of what the groups sent, as exact as the codec allows.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.runtime.comm import Communicator
from stalwart.runtime.diloco import exchange
from stalwart.runtime.diloco.codec import (
    BFLOAT16,
    FLOAT32,
    INT8,
    dequantize_int8,
    pack_int8,
    quantize_int8,
    unpack_int8,
)
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.diloco.fragments import partition
from stalwart.runtime.diloco.outer import OuterState
from stalwart.runtime.diloco.schedule import at_round_end, fragment_launches, inner_plan, next_inner_positions
from stalwart.testing.loopback import free_port


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.data())
def test_fragments_are_contiguous_runs_covering_every_tensor_once(sizes: list[int], data: Any) -> None:
    fragments = data.draw(st.integers(1, len(sizes)))
    runs = partition(sizes, fragments)
    assert len(runs) == fragments and all(len(run) for run in runs)
    assert [index for run in runs for index in run] == list(range(len(sizes)))
    total = sum(sizes)
    if fragments > 1 and total:  # no fragment is far from its share when the tensors are small against it
        largest = max(sizes)
        for run in runs:
            assert sum(sizes[i] for i in run) <= total / fragments + largest + 1


def test_more_fragments_than_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="fragments must be in"):
        partition([3, 4], 3)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 8),
    st.integers(0, 4),
)
def test_fragment_launches_are_staggered_inside_the_round(inner_steps: int, fragments: int, overlap: int) -> None:
    try:
        config = DiLoCo(inner_steps, fragments=fragments, overlap=overlap if fragments > 1 else 0)
    except ValueError:
        return  # refused configurations are tested below
    launches = fragment_launches(inner_steps, fragments, config.overlap_steps)
    assert list(launches) == sorted(set(launches))
    for launch in launches:
        assert launch >= 0 and launch + config.overlap_steps <= inner_steps - 1
    applied = [launch + config.overlap_steps for launch in launches]
    assert all(a < b for a, b in zip(applied, launches[1:], strict=False))  # one exchange in flight at a time
    assert at_round_end(launches[-1], inner_steps) == (config.overlap_steps == 0)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 500),
    st.integers(1, 6),
    st.integers(1, 16),
    st.sampled_from([1, 2, 4]),
    st.data(),
)
def test_inner_steps_cover_a_share_and_its_extras_once_in_order(
    total: int, members: int, inner_steps: int, multiple: int, data: Any
) -> None:
    """H regular steps cut the first share; extras (a failure's) follow in steps of the largest regular size."""
    names = [f"m{i}" for i in range(members)]
    member = data.draw(st.sampled_from(names))
    plan = inner_plan(total, names, member, inner_steps, multiple)
    first = sum(plan.regular)
    extra = data.draw(st.integers(0, 200))
    share = np.arange(first + extra, dtype=np.int64)
    taken: list[np.ndarray] = []
    steps = done = 0
    while (positions := next_inner_positions(share, done, steps, plan)) is not None:
        assert positions.size <= plan.extra
        taken.append(positions)
        done += positions.size
        steps += 1
        assert steps < 10_000
    assert steps >= inner_steps  # every group takes its H regular steps, even empty ones
    assert np.array_equal(np.concatenate(taken), share)
    assert [piece.size for piece in taken[:inner_steps]] == list(plan.regular)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inner_steps": 0}, "inner_steps must be in"),
        ({"inner_steps": 8, "fragments": 9}, "more than inner_steps"),
        ({"inner_steps": 8, "fragments": 4, "overlap": 2}, "overlap=2 must be less"),
        ({"inner_steps": 8, "overlap": 1}, "needs fragments > 1"),
        ({"inner_steps": 8, "pseudo_gradient_dtype": torch.int8}, "pseudo_gradient_dtype must be"),
        ({"inner_steps": 8, "pseudo_gradient_dtype": "fp8"}, "pseudo_gradient_dtype must be"),
        ({"inner_steps": 8, "outer_optimizer": 0.7}, "outer_optimizer must be a callable"),
        ({"inner_steps": 8, "round_timeout": 0}, "round_timeout must be"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        DiLoCo(**kwargs)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([1, 7, 64, 256]), st.floats(1e-6, 1e3))
def test_int8_blocks_round_trip_within_half_a_step_of_their_scale(numel: int, block: int, magnitude: float) -> None:
    generator = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=generator) * magnitude
    quantized, scales = quantize_int8(values, block)
    back = dequantize_int8(quantized, scales, numel)
    per_value = scales.repeat_interleave(block)[:numel]
    float32_rounding = values.abs() * 2**-22  # the division and the product each round once
    assert bool(((back - values).abs() <= per_value / 2 + float32_rounding).all())
    packed = pack_int8(values, block)
    assert torch.equal(unpack_int8(packed, numel, block), back)


@pytest.mark.parametrize("codec", [BFLOAT16, INT8])
def test_error_feedback_keeps_what_was_sent_within_one_rounding_of_what_was_trained(codec: str) -> None:
    """Over many sends the sum of the decoded sends tracks the sum of the pseudo-gradients (errors carried)."""
    model = torch.nn.Linear(40, 30)
    params = list(model.parameters())
    dtype = torch.bfloat16 if codec == BFLOAT16 else codec
    config = DiLoCo(4, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), pseudo_gradient_dtype=dtype)
    outer = OuterState(params, config)
    fragment = outer.fragments[0]
    generator = torch.Generator().manual_seed(0)
    trained = torch.zeros(fragment.numel)
    sent = torch.zeros(fragment.numel)
    for _ in range(50):
        with torch.no_grad():
            for param in params:
                param.sub_(torch.randn(param.shape, generator=generator) * 1e-3)
        fragment.window = 3
        trained += fragment.flat_globals() - fragment.flat_local()
        pending = outer.launch(fragment, 0, 1, 2, merge=False)
        sent += pending.prepared.decoded / 3
        outer.apply(fragment, pending.prepared.decoded, 3.0)  # lr 1: the globals follow the locals
    residual = (trained - sent).abs().max()
    assert fragment.error is not None
    assert torch.allclose(trained - sent, fragment.error, atol=1e-5)  # what is left to send is the carried error
    assert float(residual) < 5e-3 * float(trained.abs().max())  # one rounding, not fifty


@pytest.mark.parametrize("codec", [FLOAT32, BFLOAT16, INT8])
def test_an_exchange_sums_the_weighted_contributions_with_the_same_bits_everywhere(codec: str) -> None:
    members, numel, block = 3, 1000, 64
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    prefix = uuid.uuid4().hex
    contributions = [torch.randn(numel, generator=torch.Generator().manual_seed(rank)) for rank in range(members)]
    weights = [3.0, 1.0, 2.0]
    results: dict[int, tuple[torch.Tensor, float]] = {}
    errors: list[BaseException] = []

    def group(rank: int) -> None:
        try:
            store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
            comm = Communicator(store, rank, members, timeout=30.0, device=torch.device("cpu"))
            values = contributions[rank] * weights[rank]
            prepared = exchange.prepare(values, weights[rank], codec, members, block)
            results[rank] = exchange.run(comm, prepared)
        except BaseException as error:  # reported to the test's thread
            errors.append(error)

    threads = [threading.Thread(target=group, args=(rank,)) for rank in range(members)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    del master
    assert not errors and len(results) == members
    exact = sum(c * w for c, w in zip(contributions, weights, strict=True))
    first, weight = results[0]
    assert weight == sum(weights)
    for rank in range(1, members):
        assert torch.equal(results[rank][0], first) and results[rank][1] == weight
    tolerance = {FLOAT32: 1e-5, BFLOAT16: 0.05, INT8: 0.1}[codec]
    assert float((first - exact).abs().max()) < tolerance * float(exact.abs().max())
    assert exchange.sent_bytes(codec, numel, members, block) > 0


def test_int8_sends_about_a_quarter_of_float32s_bytes() -> None:
    float32 = exchange.sent_bytes(FLOAT32, 1_000_000, 4, 256)
    assert 3.8 < float32 / exchange.sent_bytes(INT8, 1_000_000, 4, 256) < 4.0
    assert 1.9 < float32 / exchange.sent_bytes(BFLOAT16, 1_000_000, 4, 256) < 2.01
