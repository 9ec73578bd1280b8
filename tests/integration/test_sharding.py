"""The FSDP2 helpers: detection, local shards, layout digests, summed gradients and gradient sync.

Two spawned processes form one replica group (Gloo, a DeviceMesh of 2) and
shard the same MLP. Their local gradient shards are compared here with
gradients of the unsharded model computed in the test process.
"""

from __future__ import annotations

import datetime
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.runtime.sharding import is_sharded, local_tensor, prepare_fsdp, set_gradient_sync, sharding_layout
from tests.integration.fsdp_support import HOST, TIMEOUT, batch, join_group, loss, mlp, run_processes, shard

WORLD = 2


def peer(rank: int, port: int, prefix: str, out: str) -> None:
    """Shard three copies of one MLP: default (averaging), prepared (summing), prepared with an unsynced backward."""
    mesh = join_group(port, prefix, rank, WORLD)
    averaged, summed, accumulated, retried = (shard(mlp(seed=0), mesh) for _ in range(4))
    for model in (summed, accumulated, retried):
        prepare_fsdp(model)
    for micro in (0, 1):  # a synced backward, then another (a failure's extra positions): sums add up
        loss(retried, batch(rank, micro)).backward()
    for model in (averaged, summed):
        loss(model, batch(rank, 0)).backward()
    set_gradient_sync(accumulated, False)
    loss(accumulated, batch(rank, 0)).backward()
    unsynced = [param.grad is None for param in accumulated.parameters()]
    set_gradient_sync(accumulated, True)
    loss(accumulated, batch(rank, 1)).backward()
    weight = averaged[0].weight
    result = {
        "grads": {
            name: {key: local_tensor(param.grad).clone() for key, param in model.named_parameters()}
            for name, model in (
                ("averaged", averaged),
                ("summed", summed),
                ("accumulated", accumulated),
                ("retried", retried),
            )
        },
        "unsynced_grad_is_none": unsynced,
        "sharded": [is_sharded(averaged), is_sharded(averaged[0]), is_sharded(mlp(seed=0))],
        "local_weight": local_tensor(weight).clone(),
        "full_weight": weight.full_tensor(),
        "layouts": [
            sharding_layout(averaged),
            sharding_layout(shard(mlp(seed=1), mesh)),
            sharding_layout(shard(mlp(seed=0, hidden=8), mesh)),
            sharding_layout(mlp(seed=0)),
        ],
    }
    torch.save(result, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def reference_grads(micros: list[int]) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model, summed over both processes' ``micros`` micro-batches."""
    model = mlp(seed=0)
    for rank in range(WORLD):
        for micro in micros:
            loss(model, batch(rank, micro)).backward()
    return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("sharding")
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    prefix = f"sharding-{uuid.uuid4().hex}"
    run_processes(peer, [(rank, master.port, prefix, str(out)) for rank in range(WORLD)], timeout=4 * TIMEOUT)
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(WORLD)]


def gathered(results: list[dict[str, object]], which: str) -> dict[str, torch.Tensor]:
    """The processes' local gradient shards of ``which`` model, concatenated (FSDP2 shards dim 0 in rank order)."""
    grads = [result["grads"][which] for result in results]  # type: ignore[index]
    return {name: torch.cat([grad[name] for grad in grads]) for name in grads[0]}


def test_prepared_gradients_are_shards_of_the_sum_and_default_ones_of_the_mean(results: list[dict]) -> None:
    expected = reference_grads([0])
    summed, averaged = gathered(results, "summed"), gathered(results, "averaged")
    assert set(summed) == set(expected) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, grad in expected.items():
        torch.testing.assert_close(summed[name], grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(averaged[name], grad / WORLD, rtol=1e-6, atol=1e-6)
    assert [tuple(result["grads"]["summed"]["2.weight"].shape) for result in results] == [(1, 6), (0, 6)]


def test_gradients_accumulate_unsynced_until_sync_is_turned_back_on(results: list[dict]) -> None:
    assert all(all(result["unsynced_grad_is_none"]) for result in results)  # nothing reduced while off
    accumulated, retried = gathered(results, "accumulated"), gathered(results, "retried")
    for name, grad in reference_grads([0, 1]).items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(retried[name], grad, rtol=1e-5, atol=1e-6)


def test_is_sharded_and_local_tensor(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["sharded"] == [True, True, False]
        assert torch.equal(result["local_weight"], result["full_weight"][3 * rank : 3 * rank + 3])
    plain = torch.ones(2)
    assert local_tensor(plain) is plain
    assert not is_sharded(mlp(seed=0))


def test_layout_digest_tells_shapes_and_sharding_apart_not_values(results: list[dict]) -> None:
    for result in results:
        same, other_values, wider, unsharded = result["layouts"]
        assert same == other_values
        assert len({same, wider, unsharded}) == 3
        assert len(same) == 16
    assert results[0]["layouts"][0] != results[1]["layouts"][0]  # the last layer's shards differ: (1, 6) and (0, 6)
    assert sharding_layout(mlp(seed=0)) == sharding_layout(mlp(seed=3)) == results[0]["layouts"][3]
