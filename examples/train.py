"""A complete training script under stalwart: run one copy per worker against a lighthouse.

    stalwart lighthouse --port 29510 --min-replicas 2 --dataset-size 1024 --global-batch 64 &
    WORKER_NAME=w0 python examples/train.py &
    WORKER_NAME=w1 python examples/train.py

Kill either worker (``kill -9``) and start it again: the other one carries its
share of the step, the restarted one is healed and training goes on with every
step's 64 samples. ``STALWART_LIGHTHOUSE`` overrides the lighthouse's URL and
``STALWART_LIGHTHOUSE_TOKEN`` gives its token when it has one (the Manager reads it).
"""

import os

import torch
from torch.utils.data import TensorDataset

from stalwart import ElasticLoader, Manager

generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(1024, 16, generator=generator), torch.randint(0, 4, (1024,), generator=generator))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()

manager = Manager(
    model,
    optimizer,
    lighthouse=os.environ.get("STALWART_LIGHTHOUSE", "http://127.0.0.1:29510"),
    member=os.environ["WORKER_NAME"],
    max_microbatch=32,
)
loader = ElasticLoader(dataset)
for step in manager.steps(loader, max_steps=100):
    for inputs, targets in step:  # this worker's share of the step, in micro-batches
        step.backward(loss_fn(model(inputs), targets))  # a mean loss: stalwart weights micro-batches by samples
    optimizer.step()  # the quorum's mean gradient over the step's 64 samples
    optimizer.zero_grad()
    if manager.is_leader and step.report.step % 20 == 0:
        print(f"step {step.report.step}: loss {step.report.loss:.4f}, world {step.report.world_size}")
manager.close()
loader.close()
