"""A complete training script under stalwart: run one copy per worker against a lighthouse.

    stalwart lighthouse --port 29510 --min-replicas 2 &
    export STALWART_LIGHTHOUSE=http://127.0.0.1:29510
    STALWART_MEMBER=w0 python examples/train.py &
    STALWART_MEMBER=w1 python examples/train.py

Kill either worker (``kill -9``) and start it again: the other one carries its
share of the step, the restarted one is healed and training goes on with every
step's 64 samples. The Manager reads the lighthouse's URL from ``STALWART_LIGHTHOUSE``, this
worker's name from ``STALWART_MEMBER`` and the token (when the lighthouse
has one) from ``STALWART_LIGHTHOUSE_TOKEN``.
"""

import torch
from torch.utils.data import TensorDataset

from stalwart import ElasticLoader, EpochPlan, Manager

generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(1024, 16, generator=generator), torch.randint(0, 4, (1024,), generator=generator))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()

manager = Manager(
    model,
    optimizer,
    max_microbatch=32,
    plan=EpochPlan(len(dataset), 64),  # 64 samples every step, whatever the number of workers
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
