"""Redundancy benchmark: what sharded optimizer state with copies or parity costs.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.redundancy           # full run, about a minute
    python -m benchmarks.redundancy --quick   # small buffers, a few seconds (numbers indicative only)

Sections, each printed as a table:

1. **Parity codec throughput.** ``ParityCode.encode`` and ``decode`` on ``k``
   random buffers of one cell each: XOR for ``(7, 1)``, and Reed-Solomon for
   ``(6, 2)`` on pyeclib's ISA-L Cauchy backend (the default) and its
   Vandermonde one, on the CPU; XOR on the GPU too when CUDA is there.
   Throughput counts the ``k`` data buffers' bytes per second (MB/s, 10^6);
   decode rebuilds one lost data buffer, then ``m`` of them. Medians over
   repeats, in this process, with torch's default threads.

The training sections (state bytes, step time and repair time per
configuration against DDP and a checkpoint reload) come with the sharded
optimizer.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rich.console import Console

from benchmarks._measure import make_console, median_of_repeats, print_table, progress_display
from stalwart.redundancy import Parity
from stalwart.redundancy.parity import RS_BACKEND, ParityCode

MIB = 1 << 20
CODEC_TITLE = "1. Parity codec throughput"


@dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts of one run (full or ``--quick``)."""

    cell_bytes: int
    repeats: int


FULL = Settings(cell_bytes=32 * MIB, repeats=5)
QUICK = Settings(cell_bytes=1 * MIB, repeats=2)


@dataclass(frozen=True)
class CodecCase:
    """One row of table 1: a code, its backend and the device its buffers live on."""

    parity: Parity
    backend: str
    device: str

    @property
    def label(self) -> str:
        return "XOR" if self.parity.m == 1 else f"Reed-Solomon, pyeclib {self.backend}"


@dataclass(frozen=True)
class CodecRow:
    """Table 1's measurements for one case, in data bytes per second."""

    case: CodecCase
    cell_bytes: int
    encode: float
    decode_one: float
    decode_all: float


def codec_cases() -> list[CodecCase]:
    """XOR (7, 1) and Reed-Solomon (6, 2) on both ISA-L backends on the CPU; XOR on CUDA when there is a GPU."""
    cases = [
        CodecCase(Parity(7, 1), RS_BACKEND, "cpu"),
        CodecCase(Parity(6, 2), RS_BACKEND, "cpu"),
        CodecCase(Parity(6, 2), "isa_l_rs_vand", "cpu"),
    ]
    if torch.cuda.is_available():
        cases.append(CodecCase(Parity(7, 1), RS_BACKEND, "cuda"))
    return cases


def measure_codec(case: CodecCase, settings: Settings) -> CodecRow:
    """Encode, decode one lost data buffer and decode ``m`` of them, each a median over repeats."""
    k, m = case.parity.k, case.parity.m
    code = ParityCode(case.parity, backend=case.backend)
    generator = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, 256, (settings.cell_bytes,), dtype=torch.uint8, generator=generator).to(case.device)
        for _ in range(k)
    ]
    units = dict(enumerate([*data, *code.encode(data)]))
    lengths = [settings.cell_bytes] * k

    def rate(work: Callable[[], object]) -> float:
        def once() -> float:
            start = time.perf_counter()
            work()
            if case.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        return k * settings.cell_bytes / median_of_repeats(once, settings.repeats)

    def without(*lost: int) -> dict[int, torch.Tensor]:
        return {index: unit for index, unit in units.items() if index not in lost}

    return CodecRow(
        case=case,
        cell_bytes=settings.cell_bytes,
        encode=rate(lambda: code.encode(data)),
        decode_one=rate(lambda: code.decode(without(0), lengths)),
        decode_all=rate(lambda: code.decode(without(*range(m)), lengths)),
    )


def print_codec(console: Console, rows: Sequence[CodecRow]) -> None:
    """Table 1."""
    print_table(
        console,
        f"{CODEC_TITLE}: ParityCode.encode and decode",
        ["(k, m)", "code", "device", "cell (MiB)", "encode (MB/s)", "decode 1 lost (MB/s)", "decode m lost (MB/s)"],
        [
            [
                f"({row.case.parity.k}, {row.case.parity.m})",
                row.case.label,
                row.case.device,
                f"{row.cell_bytes / MIB:g}",
                f"{row.encode / 1e6:,.0f}",
                f"{row.decode_one / 1e6:,.0f}",
                f"{row.decode_all / 1e6:,.0f}",
            ]
            for row in rows
        ],
        caption=(
            "MB/s of the k data buffers (10^6 bytes). Reed-Solomon runs on the CPU in 1 MiB chunks; "
            f"{RS_BACKEND} is ParityCode's default. Medians over repeats, torch threads: {torch.get_num_threads()}."
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables; return the exit status (0 unless it crashed)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redundancy", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small buffers and few repeats: a few seconds")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    console = make_console()
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    quick = " (quick run: indicative only)" if args.quick else ""
    console.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs{load}{quick}")
    cases = codec_cases()
    rows = []
    with progress_display(console) as progress:
        task = progress.add_task("parity codec", total=len(cases))
        for case in cases:
            rows.append(measure_codec(case, settings))
            progress.advance(task)
    print_codec(console, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
