"""torchtitan on CPU with Gloo: the tests' and benchmarks' torchrun entry point.

Run as the module torchrun starts in every process, followed by torchtitan's
own flags::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m stalwart.testing.torchtitan_cpu --module llama3 --config llama3_debugmodel ...

It applies the shims below, then runs ``torchtitan.train.main()`` unchanged.
torchtitan picks the trainer from ``--module``/``--config`` (the config
function's ``Trainer.Config`` subclass builds its own trainer), so the same
entry point runs plain torchtitan (``--module llama3``), torchft's
``FaultTolerantTrainer`` (``--module torchft.llama3 --config
llama3_torchft_debugmodel``) or any trainer a module's ``config_registry``
names (a dotted module path works). :func:`torchrun_command` builds that
command line.

Everything CPU needs lives here, never in an integration (issue 39). The
shims, for torchtitan 0.3.0 and torch 2.13 (each patches the narrowest public
name that works):

1. **Device type.** ``torchtitan.tools.utils.device_type``/``device_module``
   fall back to ``"cuda"``/``torch.cuda`` when no accelerator is present, and
   the trainer's first act is ``torch.cuda.set_device``. They are set to
   ``"cpu"`` and :class:`CpuDeviceModule` (``torch.cpu`` plus the memory
   queries the metrics ask for, answering "no device memory") before
   torchtitan builds anything, and every already-imported torchtitan module
   that bound them by value (``from torchtitan.tools.utils import
   device_type``: metrics, distributed utils, parallel dims, ...) is updated.
   Gloo then serves the default process group (torch's map of ``cpu``).
2. **FlexAttention.** The llama3 models' attention is ``flex_attention``
   under ``torch.compile``; its CPU kernel has no backward. Its one entry
   point, ``FlexAttention.compiled_flex_attn``, is replaced by eager
   ``scaled_dot_product_attention`` with the block mask's ``mask_mod``
   evaluated as a dense boolean mask (same result, slower; the debug model's
   sequences are short), once per block mask: every layer, and each
   recompute under activation checkpointing, asks for the same one. Score
   mods and the log-sum-exp output are not supported and raise.
   ``create_attention_mask`` (``create_block_mask`` under ``torch.compile``:
   a C++ inductor build of half a minute per process on a busy CPU) becomes
   the eager ``create_block_mask``.
3. **Sum reduction for FSDP's gradients.** torchtitan divides gradients
   itself and sets FSDP2's divide factor to 1, which makes FSDP reduce-scatter
   with ``ReduceOp.PREMUL_SUM``; Gloo has no ``PREMUL_SUM``. Setting a divide
   factor now also forces sum reduction for comms
   (``set_force_sum_reduction_for_comms``), which reduces with ``SUM`` and
   divides locally (by the factor: 1 here): the same gradients.
4. **``torch.distributed.set_timeout``.** torchtitan's
   ``set_pg_timeouts`` calls it after the first step; torch 2.13 has it only
   as ``distributed_c10d._set_pg_timeout``, aliased here when missing.
5. **SPMD backend.** With torchtitan's default ``spmd_types`` backend,
   FSDP2 refuses the debug model on 2 CPU processes with torch 2.13 ("When
   dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD
   mesh ... Got plain tensor for parameter 'weight'");
   ``--parallelism.spmd-backend partial_dtensor`` is put before the caller's
   flags, so a caller's own choice still wins.

Shims 4 and 5 are gaps between torchtitan 0.3.0 and torch 2.13, not CPU's:
with ``STALWART_TORCHTITAN_DEVICE=cuda`` (``scripts/gpu-check``'s torchtitan
recipe) only they are applied and torchtitan runs on its own device, CUDA
with NCCL (:data:`DEVICE_VARIABLE`).

Not a shim: with ``STALWART_TORCHTITAN_AUDIT`` (and ``STALWART_TORCHTITAN_HOLD``)
set, the batches each process takes are recorded (and held at a step) for the
benchmarks (:mod:`stalwart.testing.torchtitan_audit`). With
``STALWART_TORCHTITAN_EXIT_AT_ONCE=1`` (:data:`EXIT_VARIABLE`) a run ends at
once: rank 0 skips the 2-second sleep at the end of torchtitan's ``train()``
("for other ranks to complete": the other ranks never wait for it), and a
process whose run ended well exits, its output flushed, instead of going
through the interpreter's teardown of torch's and torchtitan's modules (some
2 s of CPU per process): for tests that run many groups and check their exit
elsewhere.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stalwart.testing import torchtitan_audit

SPMD_BACKEND_FLAGS = ("--parallelism.spmd-backend", "partial_dtensor")
DEVICE_VARIABLE = "STALWART_TORCHTITAN_DEVICE"
"""``cpu`` (the default: every shim) or ``cuda`` (the version shims 4 and 5 only; torchtitan picks the GPU)."""
DEVICES = ("cpu", "cuda")
EXIT_VARIABLE = "STALWART_TORCHTITAN_EXIT_AT_ONCE"
"""``1``: no sleep at the end of ``train()``, and after a run that ended well ``os._exit(0)`` (logs flushed) instead
of the interpreter's teardown; ``0`` or unset: torchtitan's sleep and the teardown (a crash there shows in the exit
status)."""


class NoSleep:
    """The ``time`` module as ``torchtitan.trainer`` sees it, less ``sleep`` (its one use: rank 0's 2 s at the end of
    ``train()``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


class CpuDeviceModule:
    """``torch.cpu`` with the device-memory queries torchtitan's metrics make (CPU has no device memory to report:
    capacity is the machine's memory, the statistics are empty)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        """An index, as CUDA's (``torch.cpu.current_device`` answers ``"cpu"``, which ``barrier(device_ids=...)``
        refuses)."""
        return 0

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> Any:
        class Properties:
            name = "cpu"
            total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

        return Properties()

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def rebind(name: str, old: object, new: object) -> None:
    """Set ``name`` to ``new`` in every imported torchtitan module where it is ``old`` (a module that did ``from m
    import name`` holds its own binding; modules imported later read the patched source)."""
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.split(".")[0] == "torchtitan" and getattr(module, name, None) is old:
            setattr(module, name, new)


def use_cpu_device() -> None:
    """Shim 1: torchtitan's device type and module become CPU's, in ``torchtitan.tools.utils`` and in every
    imported torchtitan module that bound them by value."""
    import torchtitan.tools.utils as titan_utils

    if titan_utils.device_type == "cpu":
        return
    rebind("device_module", titan_utils.device_module, CpuDeviceModule())
    rebind("device_type", titan_utils.device_type, "cpu")


_DENSE_MASKS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], torch.Tensor]] = weakref.WeakKeyDictionary()
"""Each live block mask's dense masks, by shape and device (:func:`dense_mask`)."""


def dense_mask(block_mask: Any, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``block_mask``'s ``mask_mod`` as a dense boolean mask (batch, 1, q_len, kv_len), evaluated once per block
    mask: evaluated by every layer and every recompute, it was a quarter of a CPU process's training time."""
    from torch.nn.attention.flex_attention import create_mask

    masks = _DENSE_MASKS.setdefault(block_mask, {})
    key = (batch, q_len, kv_len, str(device))
    if key not in masks:
        masks[key] = create_mask(block_mask.mask_mod, batch, None, q_len, kv_len, device=device)
    return masks[key]


def eager_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Callable[..., torch.Tensor] | None,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_aux: Any,
    kernel_options: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """Shim 2: ``FlexAttention.compiled_flex_attn``'s contract ((B, N, L, H) in and out) by eager SDPA over the
    block mask's dense boolean mask."""
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None:
        raise NotImplementedError("the CPU shim's flex attention supports no score_mod")
    if return_aux is not None and (getattr(return_aux, "lse", False) or getattr(return_aux, "max_scores", False)):
        raise NotImplementedError(f"the CPU shim's flex attention returns no auxiliary outputs, asked {return_aux!r}")
    mask = None
    if block_mask is not None:
        mask = dense_mask(block_mask, block_mask.shape[0], q.shape[-2], k.shape[-2], q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def eager_attention_mask(*args: Any, **kwargs: Any) -> Any:
    """Shim 2: ``create_attention_mask`` by eager ``create_block_mask`` (no inductor compile on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(*args, **kwargs)


def use_eager_attention() -> None:
    """Shim 2: install :func:`eager_flex_attention` as torchtitan's compiled flex attention, and
    :func:`eager_attention_mask` wherever a torchtitan module bound ``create_attention_mask``."""
    from torchtitan.models.common import attention

    attention.FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
    rebind("create_attention_mask", attention.create_attention_mask, eager_attention_mask)


def force_sum_reduction() -> None:
    """Shim 3: setting an FSDP2 module's gradient divide factor also forces sum reduction for its comms."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "stalwart_cpu_shim", False):
        return

    @functools.wraps(original)
    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    set_gradient_divide_factor.stalwart_cpu_shim = True  # type: ignore[attr-defined]
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor  # type: ignore[method-assign]


def alias_set_timeout() -> None:
    """Shim 4: ``torch.distributed.set_timeout`` where torch has only the private ``_set_pg_timeout``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def launch_device(environ: Mapping[str, str] | None = None) -> str:
    """The device :data:`DEVICE_VARIABLE` names in ``environ`` (this process's environment by default)."""
    device = (os.environ if environ is None else environ).get(DEVICE_VARIABLE, "cpu")
    if device not in DEVICES:
        raise ValueError(f"{DEVICE_VARIABLE} must be one of {', '.join(DEVICES)}, got {device!r}")
    return device


def exits_at_once(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`EXIT_VARIABLE` in ``environ`` (this process's environment by default) asks to exit at once."""
    value = (os.environ if environ is None else environ).get(EXIT_VARIABLE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{EXIT_VARIABLE} must be 0 or 1, got {value!r}")
    return value == "1"


def skip_the_end_sleep() -> None:
    """Rank 0 ends ``train()`` without torchtitan's 2-second sleep (:class:`NoSleep` as ``torchtitan.trainer.time``)."""
    import torchtitan.trainer

    torchtitan.trainer.time = NoSleep()


def exit_at_once() -> None:
    """End this process with status 0 now: the logging handlers (torchtitan's JSONL log among them) and the standard
    streams flushed, the interpreter's teardown skipped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def apply_shims(device: str = "cpu") -> None:
    """The shims of this module's docstring for ``device`` (idempotent): all of them on ``cpu``, the version
    shims (4; 5 is a flag, :func:`torchtitan_args`) on ``cuda``."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        use_cpu_device()
        use_eager_attention()
        force_sum_reduction()
    alias_set_timeout()


def torchtitan_args(args: Sequence[str]) -> list[str]:
    """torchtitan's flags with the CPU defaults (shim 5) before the caller's."""
    return [*SPMD_BACKEND_FLAGS, *args]


def torchrun_command(nproc: int, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command running torchtitan on ``nproc`` CPU processes (``torchrun --standalone``, its own free port)
    through this launcher with torchtitan's flags ``args``."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        __name__ if __name__ != "__main__" else "stalwart.testing.torchtitan_cpu",
        *args,
    ]


def environment(scratch: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment by default) for a torchtitan run: the stalwart this process imported
    first on ``PYTHONPATH`` (the run imports the same sources from any working directory), Hugging Face datasets'
    cache under ``scratch`` (runs beside each other share no cache, nothing is written to the home directory),
    offline (the corpus is local: nothing may be fetched), one OpenMP thread per process."""
    import stalwart

    env = dict(os.environ if base is None else base)
    source_root = str(Path(stalwart.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(part for part in (source_root, env.get("PYTHONPATH")) if part)
    env.update(
        HF_DATASETS_CACHE=str(Path(scratch) / "hf_datasets"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return env


def main(argv: Sequence[str] | None = None) -> None:
    """Apply the shims and run ``torchtitan.train.main`` on ``argv`` (the process's arguments by default); with
    ``STALWART_TORCHTITAN_AUDIT`` set, record the batches (:mod:`stalwart.testing.torchtitan_audit`); with
    :data:`EXIT_VARIABLE` set, exit at once when it returns."""
    apply_shims(launch_device())
    at_once = exits_at_once()
    if at_once:
        skip_the_end_sleep()
    from torchtitan import train

    audit_dir = os.environ.get(torchtitan_audit.AUDIT_DIR_ENV)
    hold = os.environ.get(torchtitan_audit.HOLD_ENV)
    if audit_dir:
        torchtitan_audit.install(Path(audit_dir), Path(hold) if hold else None)
    sys.argv = [sys.argv[0], *torchtitan_args(sys.argv[1:] if argv is None else argv)]
    train.main()
    if audit_dir:
        torchtitan_audit.finish(Path(audit_dir))
    if at_once:
        exit_at_once()


def forked_main() -> None:
    """:func:`main` in a process forked from the preloaded forkserver
    (:class:`~stalwart.testing.groups.ForkedGroup`): torch was imported there, so the ``OMP_NUM_THREADS`` that
    torchrun sets is applied here."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()


if __name__ == "__main__":
    main()
