"""Fault-tolerant HSDP: each replica group shards its model with FSDP2, stalwart replicates across groups.

    stalwart lighthouse --port 29510 --min-replicas 2 &
    export STALWART_LIGHTHOUSE=http://127.0.0.1:29510
    STALWART_MEMBER=group-a torchrun --standalone --nproc-per-node 2 examples/train_hsdp.py &
    STALWART_MEMBER=group-b torchrun --standalone --nproc-per-node 2 examples/train_hsdp.py

Each torchrun launch is one replica group: its processes ``fully_shard`` the
model over their own mesh (FSDP2 reduce-scatters gradients inside the group),
and the Manager reduces each gradient shard with the same shard of the other
groups. Kill any process of a group (``kill -9``): torchrun ends its group,
the other group carries the group's share of every step; start the launch
again and the group is healed shard by shard. Every group must run the same
script on the same number of processes. On GPUs, run one process per GPU
(torchrun's ``LOCAL_RANK`` picks it).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from stalwart import ElasticLoader, EpochPlan, Manager, ReplicaGroup, WorldInfo
from stalwart.runtime.comm import default_device

device = default_device()  # cuda:LOCAL_RANK when CUDA is available, else the CPU
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # the group's own processes (torchrun's)
mesh = init_device_mesh(device.type, (dist.get_world_size(),))

generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(1024, 16, generator=generator), torch.randint(0, 4, (1024,), generator=generator))
torch.manual_seed(0)  # every group starts from the same parameters (a joining group is healed anyway)
model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built on the sharded parameters
loss_fn = torch.nn.CrossEntropyLoss()

manager = Manager(
    model,
    optimizer,
    max_microbatch=16,
    plan=EpochPlan(len(dataset), 64),
    group=ReplicaGroup(WorldInfo.from_env()),  # this process's rank in its group: the group's share is split by it
    device=device,
)
loader = ElasticLoader(dataset)
for step in manager.steps(loader, max_steps=100):
    for inputs, targets in step:
        step.backward(loss_fn(model(inputs.to(device)), targets.to(device)))
    optimizer.step()
    optimizer.zero_grad()
    if step.report.step % 20 == 0 and manager.is_leader:
        print(f"step {step.report.step}: loss {step.report.loss:.4f}, groups {step.report.world_size}")
manager.close()
loader.close()
dist.destroy_process_group()
