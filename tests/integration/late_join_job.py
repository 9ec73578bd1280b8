"""A user's training script as the README writes it, ending through the interpreter's own teardown (run by
test_exit_status, directly and under torchrun).

One copy per worker, with ``STALWART_LIGHTHOUSE`` and ``STALWART_MEMBER`` set.
``--kill-at STEP`` makes the process SIGKILL itself at the top of step STEP
(its first incarnation only: not after a torchrun restart); ``--hold-file PATH``
holds it before any step >= the number the file holds, except when the
lighthouse asks for a boundary (a joiner), as the stalwart worker's holds do;
``--restart-waits-for PATH`` makes a torchrun restart wait (bounded) until PATH
exists before it builds its Manager, so that a test decides when it joins;
``--waits-for PATH`` makes any incarnation wait so (a replacement a test starts
early, its interpreter and imports done while the job runs on).
At the end it saves its parameters to ``OUT/final-MEMBER-PID.pt`` and returns:
no ``os._exit``, so that whatever torch.distributed left alive meets
interpreter teardown, as in a user's script.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from stalwart import ElasticLoader, EpochPlan, Manager
from stalwart.launch.loop import HOLD_LIMIT, held_until

SAMPLES, BATCH = 256, 32
PLAN = EpochPlan(SAMPLES, BATCH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--hold-file", type=Path, default=None)
    parser.add_argument("--restart-waits-for", type=Path, default=None)
    parser.add_argument("--waits-for", type=Path, default=None)
    args = parser.parse_args()
    first_incarnation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    go = args.waits_for or (None if first_incarnation else args.restart_waits_for)
    if go is not None:
        deadline = time.monotonic() + HOLD_LIMIT
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 2, (SAMPLES,)))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    manager = Manager(model, optimizer, max_microbatch=BATCH, plan=PLAN)
    loader = ElasticLoader(dataset)
    for step in manager.steps(loader, max_steps=args.max_steps):
        if step.number == args.kill_at and first_incarnation:
            os.kill(os.getpid(), signal.SIGKILL)
        held_until(args.hold_file, step.number, lambda: manager.boundary_wanted)
        for inputs, targets in step:
            step.backward(loss_fn(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), args.out / f"final-{manager.member}-{os.getpid()}.pt")
    manager.close()
    loader.close()


if __name__ == "__main__":
    main()
