"""Fixtures every test module shares, the ``integration`` marker given by directory, and the ``slow`` tests first.

``tests/unit`` holds pure logic (no process, no socket); ``tests/integration``
and ``tests/gpu`` real processes, sockets and signals. ``pytest -m "not
integration"`` runs the unit tests alone.
"""

from __future__ import annotations

import datetime
import importlib.util
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.processes import preload_also
from stalwart.runtime.threads import apply_thread_default
from stalwart.testing import digits_job
from stalwart.testing.loopback import HOST

STORE_TIMEOUT = 30.0
TORCHTITAN_DOCUMENTS = 400  # ~40k tokens: some 80 steps of the CPU runs' 512 tokens before the corpus loops


def pytest_configure(config: pytest.Config) -> None:
    """Give each pytest process one intra-op thread, as the workers get (unless ``OMP_NUM_THREADS`` is set).

    The tests' own torch work (reference runs, in-process benchmarks, models
    under hypothesis) is small; a pool of a thread per core spends it in
    OpenMP's barriers when the cores are shared: the digits reference run of
    10 steps took 4.4-5.0 s with 2 threads and 0.27-0.35 s with 1, beside
    CPU-bound processes on 2 cores. Numbers differ from 2 threads' by float
    re-association only, as the workers' (1 thread) already did.

    With torchtitan installed, the forkserver the tests fork their workers
    from imports it as well: some twenty torchtitan processes are forked per
    run, each of which spent 1.9 s of CPU importing it. It imports hypothesis
    too: the tests whose peers run a function of their own module fork them
    with it, and every such import collected the whole torch heap once
    (hypothesis registers trio's random generator, which runs ``gc.collect``):
    some 5 s of CPU per run.
    """
    apply_thread_default()
    preload_also("hypothesis")
    if importlib.util.find_spec("torchtitan") is not None:
        preload_also("torchtitan.train", "stalwart.integrations.torchtitan.trainer", "stalwart.testing.torchtitan_cpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test outside ``tests/unit`` ``integration``, and move the ``slow`` ones to the front.

    Why the front: pytest-xdist's worksteal hands each process a contiguous
    part of this order and an idle process steals from the end of another's,
    so the tests at the front are started first and the run ends on short
    ones; a test of 40 s started last would leave the other process idle
    that long. The order is otherwise kept (stable), and every process
    computes the same one.
    """
    for item in items:
        if "unit" not in item.path.relative_to(item.config.rootpath).parts:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    """Put back this process's SIGTERM and SIGINT handlers after each test.

    A test that runs a library in this process may leave its handlers behind:
    torchx's local scheduler installs one that raises on SIGTERM, which the
    Manager's own handler then chains to in a later test of the same process.
    """
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in handlers.items():
        if handler is not None:
            signal.signal(number, handler)


@pytest.fixture
def make_lighthouse() -> Iterator[Callable[..., Lighthouse]]:
    """Start embedded lighthouses on 127.0.0.1, stopped when the test ends.

    ``make_lighthouse(plan, workers=3, **options)`` waits for ``workers``
    members before the first quorum; ``options`` are ``Lighthouse``'s own
    (``heartbeat_timeout`` 1 s and ``join_timeout`` 30 s unless given).
    """
    started: list[Lighthouse] = []

    def make(plan: EpochPlan = digits_job.PLAN, workers: int = digits_job.WORKERS, **options: Any) -> Lighthouse:
        options = {"min_replicas": 1, "heartbeat_timeout": 1.0, "join_timeout": 30.0, **options}
        server = Lighthouse(plan, start_replicas=workers, **options)
        server.start()
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        server.stop()


@pytest.fixture
def lighthouse(request: pytest.FixtureRequest, make_lighthouse: Callable[..., Lighthouse]) -> Lighthouse:
    """A lighthouse for the test module's ``PLAN`` and ``WORKERS`` (the digits job's when the module has none)."""
    module = request.module
    return make_lighthouse(getattr(module, "PLAN", digits_job.PLAN), getattr(module, "WORKERS", digits_job.WORKERS))


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    """The test's own ``TCPStore`` on 127.0.0.1: a rendezvous for process groups without a lighthouse."""
    yield dist.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT)
    )


@pytest.fixture(scope="session")
def reference() -> dict[str, torch.Tensor]:
    """The digits job's failure-free parameters after ``digits_job.STEPS`` steps."""
    return digits_job.reference_parameters(digits_job.STEPS)


@pytest.fixture(scope="session")
def long_reference() -> dict[str, torch.Tensor]:
    """The digits job's failure-free parameters after ``digits_job.LONG_STEPS`` steps."""
    return digits_job.reference_parameters(digits_job.LONG_STEPS)


@pytest.fixture(scope="session")
def torchtitan_assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A seeded corpus and the byte-level BPE tokenizer trained on it, written once per session
    (:func:`stalwart.testing.torchtitan_assets.write_assets`; ``.flags()`` points torchtitan at them)."""
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the torchtitan extra installs it)")
    from stalwart.testing.torchtitan_assets import write_assets

    return write_assets(tmp_path_factory.mktemp("torchtitan_assets"), documents=TORCHTITAN_DOCUMENTS)
