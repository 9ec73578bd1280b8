"""How pseudo-gradients travel: float32, bfloat16, or 8-bit blocks with a float32 scale each.

Pure torch on tensors, no collectives (the exchange,
:mod:`~stalwart.runtime.diloco.exchange`, moves what these functions make).

8 bits: a tensor is cut into blocks of ``block`` values; each block is sent
as int8 values ``round(x / scale)`` in [-127, 127] with ``scale = max|x| /
127`` (float32, 1 for an all-zero block), so an outlier costs precision only
in its own block. :func:`pack_int8` lays a vector's blocks out as bytes
(the values, then the scales' bytes), the unit that an all-to-all and an
all-gather move.
"""

from __future__ import annotations

import torch

FLOAT32, BFLOAT16, INT8 = "float32", "bfloat16", "int8"
CODECS = (FLOAT32, BFLOAT16, INT8)
_INT8_LIMIT = 127.0


def quantize_int8(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-D float32) as int8 blocks of ``block`` and their float32 scales (the last block zero-padded)."""
    flat = values.reshape(-1).float()
    blocks = -(-flat.numel() // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1) / _INT8_LIMIT
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(grid / scales[:, None]).clamp_(-_INT8_LIMIT, _INT8_LIMIT).to(torch.int8)
    return quantized.reshape(-1), scales


def dequantize_int8(quantized: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values of int8 blocks and their scales, the first ``numel`` of them."""
    grid = quantized.view(scales.numel(), -1).float() * scales[:, None]
    return grid.reshape(-1)[:numel]


def pack_int8(values: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` quantized, as bytes: the int8 values, then the scales' float32 bytes (``packed_size`` long)."""
    quantized, scales = quantize_int8(values, block)
    return torch.cat([quantized.view(torch.uint8), scales.view(torch.uint8)])


def packed_size(numel: int, block: int) -> int:
    """Bytes :func:`pack_int8` gives for ``numel`` values."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def unpack_int8(packed: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The float32 values of what :func:`pack_int8` packed for ``numel`` values."""
    blocks = -(-numel // block)
    quantized = packed[: blocks * block].view(torch.int8)
    scales = packed[blocks * block : blocks * block + 4 * blocks].clone().view(torch.float32)
    return dequantize_int8(quantized, scales, numel)
