"""An exact erasure code on tensor bytes: ``k`` data buffers -> ``m`` parity buffers; any ``k`` of those give all back.

The code works on bit patterns, never on values, so any dtype round-trips bit
for bit (NaN payloads, signed zeros, bf16 included): take the bytes of a
contiguous tensor with :func:`byte_view`.

- ``m = 1``: the parity is the XOR of the ``k`` data buffers (RAID-5), on the
  buffers' own device (numpy's XOR on the CPU, torch's on a GPU).
- ``m >= 2``: Reed-Solomon from pyeclib (``pip install 'stalwart[parity]'``),
  by default its ISA-L Cauchy backend, which pyeclib's wheel ships and which
  is MDS for every ``(k, m)``. It runs on the CPU, ``chunk_bytes`` of each
  buffer at a time (64 KiB, see ``CHUNK_BYTES``: a bounded transient). Parity is
  computed with pyeclib's ``reconstruct``, asking for the ``m`` parity
  fragments from the ``k`` data ones: the same bytes as its ``encode``,
  without copying the data fragments back out. pyeclib's fragment headers
  depend only on the sizes, so they are taken once per chunk size from an
  encode of zeros.

Buffers of unequal length (the last cells of a flat state are shorter) are
read as if zero-padded at their end to the longest one's length; parity
buffers have that length, and :meth:`ParityCode.decode` trims what it
rebuilds to the lengths it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import numpy as np
import torch

from stalwart._validate import check_int
from stalwart.redundancy.config import Parity

RS_BACKEND = "isa_l_rs_cauchy"
"""pyeclib's backend for ``m >= 2``: ISA-L's Cauchy Reed-Solomon, bundled in pyeclib's wheel, MDS for any ``(k, m)``."""

CHUNK_BYTES = 64 << 10
"""Below glibc's default mmap threshold (128 KiB), so that the fragment buffers liberasurecode allocates at each
call come from the heap: fresh mappings (page faults, then munmap) took 30 times the coding itself with 8 processes
on 2 cores (11 ms of CPU per stripe's encode against 0.4 ms for the same bytes in 64 KiB chunks)."""

Buffer = TypeVar("Buffer", torch.Tensor, np.ndarray)
"""A flat uint8 buffer: a torch tensor (any device) or a numpy array; a code returns what it was given."""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its storage: any dtype, bits as they are."""
    if not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous to view its bytes, got strides {tensor.stride()}")
    return tensor.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class ParityCode:
    """The code of a ``Parity(k, m)``: units ``0..k-1`` are the data buffers, ``k..k+m-1`` the parity buffers."""

    parity: Parity
    backend: str = RS_BACKEND
    chunk_bytes: int = CHUNK_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.parity, Parity):
            raise TypeError(f"parity must be a Parity, got {self.parity!r} ({type(self.parity).__name__})")
        check_int("chunk_bytes", self.chunk_bytes, minimum=1)

    def encode(self, data: Sequence[Buffer]) -> list[Buffer]:
        """The ``m`` parity buffers of ``k`` data buffers, each as long as the longest data buffer."""
        k = self.parity.k
        if len(data) != k:
            raise ValueError(f"encode needs k = {k} data buffers, got {len(data)}")
        tensors = [_as_tensor(f"data[{i}]", buffer) for i, buffer in enumerate(data)]
        _check_same_kind(data)
        length = max(len(tensor) for tensor in tensors)
        if self.parity.m == 1:
            parity = [_xor(tensors, length)]
        else:
            parity = self._rs(dict(enumerate(tensors)), list(range(k, k + self.parity.m)), length)
        return [_like(data[0], tensor) for tensor in parity]

    def decode(self, units: Mapping[int, Buffer], lengths: Sequence[int]) -> list[Buffer]:
        """The ``k`` data buffers, of ``lengths``, from any ``k`` or more ``units`` (unit index -> buffer).

        Data units given are returned as they are; the missing ones are rebuilt.
        """
        k, m = self.parity.k, self.parity.m
        if len(lengths) != k:
            raise ValueError(f"decode needs the lengths of the k = {k} data buffers, got {len(lengths)}")
        sizes = [check_int(f"lengths[{i}]", size, minimum=0) for i, size in enumerate(lengths)]
        length = max(sizes)
        tensors: dict[int, torch.Tensor] = {}
        for index, buffer in sorted(units.items()):
            check_int("unit index", index, minimum=0, maximum=k + m - 1)
            tensor = _as_tensor(f"units[{index}]", buffer)
            expected = sizes[index] if index < k else length
            if len(tensor) != expected:
                raise ValueError(f"units[{index}] must be {expected} bytes long, got {len(tensor)}")
            tensors[index] = tensor
        if len(tensors) < k:
            lost = sorted(set(range(k + m)) - set(tensors))
            raise ValueError(f"cannot decode {self.parity}: units {lost} are lost, at most m = {m} may be")
        _check_same_kind(list(units.values()))
        missing = [index for index in range(k) if index not in tensors]
        if not missing:
            rebuilt: dict[int, torch.Tensor] = {}
        elif m == 1:
            (index,) = missing
            rebuilt = {index: _xor(list(tensors.values()), length)[: sizes[index]]}
        else:
            found = self._rs(tensors, missing, length)
            rebuilt = {index: tensor[: sizes[index]] for index, tensor in zip(missing, found, strict=True)}
        first = next(iter(units.values()))
        return [units[index] if index in units else _like(first, rebuilt[index]) for index in range(k)]

    def _rs(self, units: dict[int, torch.Tensor], wanted: list[int], length: int) -> list[torch.Tensor]:
        """Reed-Solomon: the ``wanted`` units (each ``length`` bytes) from ``units``, chunk by chunk on the CPU."""
        k, m = self.parity.k, self.parity.m
        driver = _driver(k, m, self.backend)
        sources = {index: tensor.cpu().numpy() for index, tensor in units.items()}
        out = [np.empty(length, dtype=np.uint8) for _ in wanted]
        for start in range(0, length, self.chunk_bytes):
            size = min(self.chunk_bytes, length - start)
            headers = _headers(k, m, self.backend, size)
            fragments = [_fragment(headers[index], source, start, size) for index, source in sources.items()]
            for target, fragment, index in zip(out, driver.reconstruct(fragments, wanted), wanted, strict=True):
                target[start : start + size] = np.frombuffer(fragment, np.uint8, size, len(headers[index]))
        device = next(iter(units.values())).device
        return [torch.from_numpy(array).to(device) for array in out]


def _xor(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """XOR of ``tensors``, each zero-padded to ``length``: numpy's on the CPU (several times torch's), else torch's."""
    if tensors[0].device.type == "cpu":
        out = np.zeros(length, dtype=np.uint8)
        for tensor in tensors:
            np.bitwise_xor(out[: len(tensor)], tensor.numpy(), out=out[: len(tensor)])
        return torch.from_numpy(out)
    result = torch.zeros(length, dtype=torch.uint8, device=tensors[0].device)
    for tensor in tensors:
        result[: len(tensor)].bitwise_xor_(tensor)
    return result


def _fragment(header: bytes, array: np.ndarray, start: int, size: int) -> bytes:
    """``header``, then ``size`` bytes of ``array`` from ``start`` (zeros past its end), in one copy."""
    piece = array[start : start + size].data  # a memoryview: joined without a copy of its own
    return b"".join((header, piece, bytes(size - len(piece))))


def _as_tensor(name: str, buffer: Any) -> torch.Tensor:
    """A flat uint8 buffer as a tensor (numpy arrays without a copy), else ``TypeError`` naming it."""
    tensor = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        shape = tuple(getattr(buffer, "shape", ()))
        got = f"{type(buffer).__name__} of dtype {getattr(buffer, 'dtype', None)} and shape {shape}"
        raise TypeError(f"{name} must be a flat uint8 torch tensor or numpy array (see byte_view), got {got}")
    return tensor


def _check_same_kind(buffers: Sequence[Any]) -> None:
    kinds = {type(buffer).__name__ for buffer in buffers}
    if len(kinds) > 1:
        raise TypeError(f"buffers must be all torch tensors or all numpy arrays, got {sorted(kinds)}")


def _like(example: Buffer, tensor: torch.Tensor) -> Buffer:
    """``tensor`` as the kind of ``example``: a numpy array for numpy, else the tensor."""
    return tensor.numpy() if isinstance(example, np.ndarray) else tensor


@lru_cache(maxsize=16)
def _driver(k: int, m: int, backend: str) -> Any:
    """A pyeclib driver for ``(k, m)`` on ``backend``, with errors that say how to get it."""
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError as error:
        raise ModuleNotFoundError(
            f"Reed-Solomon parity (m = {m}) needs pyeclib: pip install 'stalwart[parity]'"
        ) from error
    try:
        return ECDriver(k=k, m=m, ec_type=backend)
    except Exception as error:  # pyeclib's own error types, raised for a backend or (k, m) it refuses
        raise ValueError(f"pyeclib backend {backend!r} refuses k = {k}, m = {m}: {error}") from error


@lru_cache(maxsize=64)
def _headers(k: int, m: int, backend: str, size: int) -> tuple[bytes, ...]:
    """pyeclib's fragment headers for fragments of ``size`` bytes: they depend on the sizes only, not the data."""
    fragments = _driver(k, m, backend).encode(bytes(k * size))
    return tuple(fragment[: len(fragment) - size] for fragment in fragments)
