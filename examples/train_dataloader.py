"""examples/train.py with your own DataLoader: ``ManagedDistributedSampler(manager, dataset)`` as its batch sampler.

    stalwart lighthouse --port 29510 --min-replicas 2 &
    export STALWART_LIGHTHOUSE=http://127.0.0.1:29510
    STALWART_MEMBER=w0 python examples/train_dataloader.py &
    STALWART_MEMBER=w1 python examples/train_dataloader.py

The DataLoader keeps its worker processes, ``pin_memory`` and
``prefetch_factor``; each batch it yields is a micro-batch the Manager planned
(at most ``max_microbatch`` samples). Kill either worker (``kill -9``): the
other one drops the micro-batches its DataLoader had prefetched for its old
share, loads the positions it took over, and the step still trains on its 64
samples, each once. ``step.epoch_end`` steps the epoch-wise LR scheduler.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

from stalwart import EpochPlan, ManagedDistributedSampler, Manager

generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(1024, 16, generator=generator), torch.randint(0, 4, (1024,), generator=generator))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
loss_fn = torch.nn.CrossEntropyLoss()

manager = Manager(
    model,
    optimizer,
    max_microbatch=16,
    plan=EpochPlan(len(dataset), 64),  # 64 samples every step, whatever the number of workers
)
manager.register_state("lr_scheduler", scheduler)  # healed with the model, like the optimizer
sampler = ManagedDistributedSampler(manager, dataset)
loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, pin_memory=torch.cuda.is_available())
for step in manager.steps(loader, max_steps=100):
    for inputs, targets in step:  # this worker's part of the step, in micro-batches
        step.backward(loss_fn(model(inputs), targets))
    optimizer.step()
    optimizer.zero_grad()
    if step.epoch_end:
        scheduler.step()
    if step.epoch_end and manager.is_leader:
        print(f"epoch {step.report.epoch} done at step {step.report.step}: loss {step.report.loss:.4f}, "
              f"world {step.report.world_size}")  # fmt: skip
manager.close()
