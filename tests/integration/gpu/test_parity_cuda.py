"""The parity code on CUDA tensors: XOR on the GPU, Reed-Solomon through the CPU, results back on the GPU.

Skipped without CUDA.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stalwart.redundancy import Parity
from stalwart.redundancy.parity import ParityCode, byte_view

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("m", [1, 2])
def test_cuda_buffers_round_trip_bit_for_bit_on_their_device(m: int) -> None:
    generator = torch.Generator().manual_seed(m)
    tensors = [torch.randn(n, generator=generator).to(torch.bfloat16).cuda() for n in (4096, 4095, 4000)]
    tensors[0][:2] = torch.tensor([float("nan"), -0.0], dtype=torch.bfloat16)
    code = ParityCode(Parity(3, m))
    data = [byte_view(tensor) for tensor in tensors]
    parity = code.encode(data)
    assert all(p.device == data[0].device and len(p) == len(data[0]) for p in parity)
    units = dict(enumerate([*data, *parity]))
    for lost in itertools.combinations(range(3 + m), m):
        decoded = code.decode({i: u for i, u in units.items() if i not in lost}, [len(d) for d in data])
        assert all(d.device == data[0].device and torch.equal(d, o) for d, o in zip(decoded, data, strict=True))
