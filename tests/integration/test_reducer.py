"""The bucketed reducer: bucket planning (properties), and real 2-process Gloo rounds.

The rounds run in spawned processes that rendezvous on a TCPStore started by
the test. Each process builds the same model (seeded) and its own data
(seeded by rank), so each can compute the expected mean gradient of both
processes' samples by itself and compare it with what the reducer applied.
A failure is real: one process exits while its peer waits on a bucket; the
survivor must still hold its own gradient sums and reduce them again in a new
(one-process) group. In the ``fsdp`` scenario each process is an FSDP2 group
of its own (``fully_shard`` over a mesh of one), as in fault-tolerant HSDP:
the cross-group buckets must still launch while backward runs.
"""

from __future__ import annotations

import itertools
import queue
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from stalwart.launch.processes import preloaded_context
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.reducer import GradientReducer, plan_buckets
from stalwart.runtime.sharding import local_tensor, prepare_fsdp
from stalwart.testing.loopback import prefix_store

HOST = "127.0.0.1"
WORLD = 2
GROUP_TIMEOUT = 30.0
TEST_BOUND = 90.0
CONTEXT = preloaded_context()  # forked from one interpreter that imported torch once
MICROBATCH = 4
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@given(
    st.lists(st.tuples(st.integers(1, 5000), st.sampled_from(DTYPES)), max_size=40),
    st.integers(1, 40_000),
    st.integers(1, 40_000),
    st.sampled_from([None, torch.float32, torch.bfloat16]),
)
def test_buckets_cover_every_parameter_once_in_reverse_order_within_their_caps(
    params: list[tuple[int, torch.dtype]], cap: int, first_cap: int, reduce_dtype: torch.dtype | None
) -> None:
    buckets = plan_buckets(params, cap_bytes=cap, first_cap_bytes=first_cap, reduce_dtype=reduce_dtype)
    order = [index for bucket in buckets for index in bucket.params]
    assert order == list(reversed(range(len(params))))
    for number, bucket in enumerate(buckets):
        sizes = [params[index][0] for index in bucket.params]
        assert list(bucket.offsets) == [sum(sizes[:slot]) for slot in range(len(sizes))]
        assert bucket.numel == sum(sizes)
        assert all((reduce_dtype or params[index][1]) == bucket.dtype for index in bucket.params)
        limit = first_cap if number == 0 else cap
        if len(bucket.params) > 1:
            assert bucket.numel * bucket.dtype.itemsize <= limit
    for before, after in itertools.pairwise(buckets):  # a bucket closes only when the next would not fit
        first = params[after.params[0]]
        limit = first_cap if before is buckets[0] else cap
        fits = (before.numel + first[0]) * before.dtype.itemsize <= limit
        assert (reduce_dtype or first[1]) != before.dtype or not fits


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 300), torch.nn.ReLU(), torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3)
    )
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))
    return model


def fully_shard_alone(model: torch.nn.Module) -> None:
    """Shard ``model`` (each linear layer, then the root) with FSDP2 over a mesh of this process alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prepare_fsdp(model)


def data(rank: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(samples, 16, generator=generator), torch.randint(0, 3, (samples,), generator=generator)


def local_sums(model: torch.nn.Module, rank: int, samples: int) -> list[torch.Tensor]:
    """This rank's gradient sums, computed without any reducer (zeros for the unused parameter)."""
    inputs, targets = data(rank, samples)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum").backward()
    sums = [
        torch.zeros_like(local_tensor(p)) if p.grad is None else local_tensor(p.grad).clone()
        for p in model.parameters()
    ]
    model.zero_grad(set_to_none=True)
    return sums


def train_round(model: torch.nn.Module, reducer: GradientReducer, comm: Communicator, rank: int, samples: int) -> int:
    """Micro-batches of ``samples``; the last backward runs armed. Returns buckets launched by backward's hooks."""
    inputs, targets = data(rank, samples)
    chunks = list(zip(inputs.split(MICROBATCH), targets.split(MICROBATCH), strict=True))
    tail = torch.tensor([float(samples), 1.0])
    for number, (batch, labels) in enumerate(chunks, start=1):
        if number == len(chunks):
            reducer.arm(comm, lambda: tail, tail.numel())
        torch.nn.functional.cross_entropy(model(batch), labels, reduction="sum").backward()
    return reducer.launched_buckets


def peer(rank: int, port: int, prefix: str, scenario: str, reports: Any) -> None:
    """One process; reports ``(rank, what, detail)``."""
    torch.set_num_threads(1)
    try:
        model = build_model()
        if scenario == "fsdp":
            fully_shard_alone(model)
        dtype = torch.bfloat16 if scenario == "bf16" else None
        reducer = GradientReducer(
            list(model.parameters()), device=torch.device("cpu"), bucket_cap_mb=0.1, reduce_dtype=dtype
        )
        comm = Communicator(
            prefix_store(HOST, port, prefix, GROUP_TIMEOUT),
            rank,
            WORLD,
            timeout=GROUP_TIMEOUT,
            device=torch.device("cpu"),
        )
        samples = 10 + rank * 3
        expected_sums = [a + b for a, b in zip(local_sums(model, 0, 10), local_sums(model, 1, 13), strict=True)]
        if scenario == "kill" and rank == 1:
            reports.put((rank, "exiting", None))
            comm.abort()
            return
        by_hooks = train_round(model, reducer, comm, rank, samples)
        reducer.launch_rest()
        try:
            tail = reducer.wait()
        except CollectiveError as error:
            # The survivor: its gradients are intact; it reduces them again alone, in a new group.
            alone = Communicator(
                prefix_store(HOST, port, prefix + "alone/", GROUP_TIMEOUT),
                0,
                1,
                timeout=GROUP_TIMEOUT,
                device=torch.device("cpu"),
            )
            reducer.arm(alone, lambda: torch.tensor([float(samples), 1.0]), 2)
            reducer.launch_rest()
            tail = reducer.wait()
            reducer.apply(samples)
            own = local_sums(build_model(), rank, samples)
            reports.put((rank, "recovered", (str(error), gap(model, own, samples))))
            return
        total = round(float(tail[0]))
        reducer.apply(total)
        reports.put(
            (rank, "reduced", (by_hooks, len(reducer.buckets), tail.tolist(), gap(model, expected_sums, total)))
        )
    except Exception as error:  # the test reports it instead of waiting for a report that never comes
        reports.put((rank, "error", repr(error)))


def gap(model: torch.nn.Module, sums: list[torch.Tensor], samples: int) -> float:
    """Largest difference between ``param.grad`` and ``sums / samples``."""
    return max(
        float((local_tensor(p.grad).float() - s / samples).abs().max())
        for p, s in zip(model.parameters(), sums, strict=True)
    )


class Peers:
    def __init__(self, port: int, scenario: str) -> None:
        self.reports: Any = CONTEXT.Queue()
        prefix = f"{scenario}-{uuid.uuid4().hex}/"
        self.processes = [
            CONTEXT.Process(target=peer, args=(rank, port, prefix, scenario, self.reports)) for rank in range(WORLD)
        ]
        self.deadline = time.monotonic() + TEST_BOUND
        for process in self.processes:
            process.start()

    def collect(self, count: int) -> dict[int, tuple[str, Any]]:
        found: dict[int, tuple[str, Any]] = {}
        while len(found) < count:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"only {found} reported in time")
            try:
                rank, kind, detail = self.reports.get(timeout=remaining)
            except queue.Empty:
                continue
            assert kind != "error", f"rank {rank} failed: {detail}"
            found[rank] = (kind, detail)
        return found

    def close(self) -> None:
        for process in self.processes:
            process.join(timeout=TEST_BOUND)
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("scenario", ["fp32", "bf16", "fsdp"])
def test_buckets_launch_during_backward_and_apply_the_mean_gradient(store: dist.TCPStore, scenario: str) -> None:
    peers = Peers(store.port, scenario)
    try:
        results = peers.collect(WORLD)
    finally:
        peers.close()
    tolerance = 2e-2 if scenario == "bf16" else 1e-5
    for kind, (by_hooks, buckets, tail, difference) in results.values():
        assert kind == "reduced"
        assert buckets > 2
        assert by_hooks == buckets - 1  # all but the bucket of the unused parameter (the first one registered)
        assert tail == [23.0, 2.0]  # exact counts, in a float32 tail either way
        assert difference < tolerance


def test_a_failed_bucket_leaves_the_gradients_to_reduce_again(store: dist.TCPStore) -> None:
    peers = Peers(store.port, "kill")
    try:
        results = peers.collect(WORLD)
    finally:
        peers.close()
    assert results[1][0] == "exiting"
    kind, (error, difference) = results[0]
    assert kind == "recovered" and "all-reduce" in error
    assert difference < 1e-5
