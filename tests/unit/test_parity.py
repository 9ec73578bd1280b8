"""The parity code: bit-exact round trips for every loss pattern up to m, every dtype, unequal lengths, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pyeclib.ec_iface import ECDriver

from stalwart.redundancy import Parity, lost_shards, place
from stalwart.redundancy.memory import split_lengths
from stalwart.redundancy.parity import RS_BACKEND, ParityCode, byte_view

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def random_bytes(generator: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)


def round_trips(code: ParityCode, data: list[torch.Tensor]) -> None:
    """Every pattern of at most m lost units (data or parity) decodes to ``data``, bit for bit."""
    k, m = code.parity.k, code.parity.m
    parity = code.encode(data)
    assert [len(p) for p in parity] == [max(len(d) for d in data)] * m
    units = dict(enumerate([*data, *parity]))
    lengths = [len(d) for d in data]
    for lost in range(m + 1):
        for gone in itertools.combinations(range(k + m), lost):
            decoded = code.decode({i: u for i, u in units.items() if i not in gone}, lengths)
            assert all(torch.equal(a, b) for a, b in zip(decoded, data, strict=True)), (code.parity, gone)


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 1), (7, 1), (1, 2), (2, 2), (3, 2), (6, 2), (4, 3), (5, 4)])
def test_every_loss_pattern_up_to_m_round_trips(k: int, m: int) -> None:
    generator = torch.Generator().manual_seed(k * 10 + m)
    data = [random_bytes(generator, 1000 - 3 * i) for i in range(k)]  # unequal: padded with zeros to 1000
    round_trips(ParityCode(Parity(k, m), chunk_bytes=256), data)  # several chunks and a short tail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2])
def test_every_dtype_round_trips_bit_for_bit(dtype: torch.dtype, m: int) -> None:
    """Random bit patterns (NaNs with payloads, -0.0, subnormals) and named NaNs come back with the same bits."""
    generator = torch.Generator().manual_seed(7)
    size = torch.empty(0, dtype=dtype).element_size()
    tensors = [random_bytes(generator, size * n).view(dtype) for n in (64, 63, 61)]
    if dtype.is_floating_point:
        tensors[0][:4] = torch.tensor([float("nan"), -float("nan"), -0.0, float("inf")]).to(dtype)
    if dtype is torch.bfloat16:
        tensors[1][:2] = torch.tensor([0x7FC1, -0x1], dtype=torch.int16).view(torch.bfloat16)  # NaN payloads
    if dtype is torch.bool:
        tensors = [random_bytes(generator, n).bool() for n in (64, 63, 61)]
    code = ParityCode(Parity(3, m))
    data = [byte_view(tensor) for tensor in tensors]
    parity = code.encode(data)
    for lost in itertools.combinations(range(3), m):
        decoded = code.decode({i: d for i, d in enumerate([*data, *parity]) if i not in lost}, [len(d) for d in data])
        for original, back in zip(tensors, decoded, strict=True):
            restored = back.view(dtype)
            assert restored.dtype == dtype
            assert torch.equal(byte_view(restored), byte_view(original))


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 6),
    m=st.integers(1, 3),
    lengths=st.lists(st.integers(0, 300), min_size=6, max_size=6),
    chunk=st.integers(1, 512),
    seed=st.integers(0, 2**16),
)
def test_any_lengths_and_chunk_sizes_round_trip(k: int, m: int, lengths: list[int], chunk: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    data = [random_bytes(generator, length) for length in lengths[:k]]
    round_trips(ParityCode(Parity(k, m), chunk_bytes=chunk), data)


def test_rs_parity_is_pyeclibs_own_encode() -> None:
    """Parity computed through reconstruct is byte for byte the parity fragments of pyeclib's encode."""
    k, m, length = 5, 3, 4096
    generator = torch.Generator().manual_seed(3)
    data = [random_bytes(generator, length) for _ in range(k)]
    ours = ParityCode(Parity(k, m), chunk_bytes=1000).encode(data)
    fragments = ECDriver(k=k, m=m, ec_type=RS_BACKEND).encode(torch.cat(data).numpy().tobytes())
    header = len(fragments[0]) - length
    assert [bytes(p.numpy()) for p in ours] == [fragment[header:] for fragment in fragments[k:]]


def test_xor_parity_is_the_xor_of_the_data() -> None:
    data = [np.array([1, 2, 3], dtype=np.uint8), np.array([4, 8], dtype=np.uint8)]
    (parity,) = ParityCode(Parity(2, 1)).encode(data)
    assert isinstance(parity, np.ndarray)
    assert parity.tolist() == [1 ^ 4, 2 ^ 8, 3]


def test_numpy_in_numpy_out() -> None:
    data = [np.arange(10, dtype=np.uint8), np.arange(7, dtype=np.uint8)]
    code = ParityCode(Parity(2, 2))
    parity = code.encode(data)
    assert all(isinstance(p, np.ndarray) and len(p) == 10 for p in parity)
    decoded = code.decode({2: parity[0], 3: parity[1]}, [10, 7])
    assert all(isinstance(d, np.ndarray) for d in decoded)
    assert [d.tolist() for d in decoded] == [d.tolist() for d in data]


def test_placement_and_code_rebuild_a_lost_node() -> None:
    """A state placed with parity (6, 2) over 4 nodes of 2: a whole node dies, its cells come back bit for bit."""
    nodes = [f"n{p // 2}" for p in range(8)]
    placement = place(Parity(6, 2), nodes)
    code = ParityCode(placement.redundancy)  # type: ignore[arg-type]
    state = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    shards = torch.split(state, split_lengths(len(state), 8))
    cells = [torch.split(shard, split_lengths(len(shard), 6)) for shard in shards]
    held = {}  # (stripe, slot) -> the unit's bytes, on the process that holds it
    for index, stripe in enumerate(placement.stripes):
        data = [byte_view(cells[cell.shard][cell.index].contiguous()) for cell in stripe.cells]
        held.update({(index, slot): unit for slot, unit in enumerate([*data, *code.encode(data)])})
    failed = {0, 1}  # node n0
    assert lost_shards(placement, failed) == ()
    rebuilt = torch.zeros_like(state)
    starts = np.cumsum([0, *split_lengths(len(state), 8)])
    for index, stripe in enumerate(placement.stripes):
        alive = {slot: held[index, slot] for slot, holder in enumerate(stripe.holders) if holder not in failed}
        lengths = [len(held[index, slot]) for slot in range(len(stripe.cells))]
        for cell, data in zip(stripe.cells, code.decode(alive, lengths), strict=True):
            offset = starts[cell.shard] + sum(split_lengths(len(shards[cell.shard]), 6)[: cell.index])
            rebuilt[offset : offset + len(data) // 4] = data.view(torch.float32)
    assert torch.equal(byte_view(rebuilt), byte_view(state))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.encode([torch.zeros(3, dtype=torch.uint8)]), ValueError, "encode needs k = 2 data buffers, got 1"),
        (lambda c: c.encode([torch.zeros(3), torch.zeros(3)]), TypeError, "data[0] must be a flat uint8 torch tensor"),
        (
            lambda c: c.encode([np.zeros(3, np.uint8), torch.zeros(3, dtype=torch.uint8)]),
            TypeError,
            "buffers must be all torch tensors or all numpy arrays",
        ),
        (lambda c: c.decode({0: torch.zeros(3, dtype=torch.uint8)}, [3]), ValueError, "lengths of the k = 2 data"),
        (
            lambda c: c.decode({0: torch.zeros(3, dtype=torch.uint8)}, [3, 3]),
            ValueError,
            "cannot decode parity (2, 2): units [1, 2, 3] are lost, at most m = 2 may be",
        ),
        (
            lambda c: c.decode({0: torch.zeros(3, dtype=torch.uint8), 2: torch.zeros(2, dtype=torch.uint8)}, [3, 3]),
            ValueError,
            "units[2] must be 3 bytes long, got 2",
        ),
        (
            lambda c: c.decode({4: torch.zeros(3, dtype=torch.uint8)}, [3, 3]),
            ValueError,
            "unit index must be in [0, 3]",
        ),
    ],
)
def test_bad_input_is_named(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        call(ParityCode(Parity(2, 2)))  # type: ignore[operator]
    assert message in str(raised.value)


def test_a_view_of_a_strided_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        byte_view(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="parity must be a Parity, got"):
        ParityCode((2, 1))  # type: ignore[arg-type]
