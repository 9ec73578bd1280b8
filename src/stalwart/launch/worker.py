"""One worker process of the local cluster: trains the digits task under a Manager.

Started by torchrun (``RANK``/``WORLD_SIZE`` set), the processes of one launch
form a replica group named ``--member`` and split the group's share.

Run by :mod:`stalwart.launch.cluster` as ``python -m stalwart.launch.worker``.
After every committed step it appends a JSON line to ``RUN_DIR/steps-MEMBER.jsonl``
with the step's number, epoch, quorum, world size, samples, loss, wall time and
the positions the whole quorum committed (the audit's input); at the end it
saves its parameters to ``RUN_DIR/final-MEMBER.pt``.

``--kill-at STEP:POINT`` makes the worker SIGKILL itself at a named point of a
step, for tests: ``before_forward``, ``during_backward``, ``during_reduce``
(the all-reduce is in flight) or ``after_reduce`` (reduced, not applied).
``--corrupt-at STEP`` adds noise to this worker's parameters at the start of
step STEP, for tests of the replica-consistency check (the Manager must heal
it from the others before the step is applied).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch

from stalwart.data.world import WorldInfo
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer, summed_loss
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager

KILL_POINTS = ("before_forward", "during_backward", "during_reduce", "after_reduce")
_MANAGER_EVENTS = {"reduce_started": "during_reduce", "reduce_finished": "after_reduce"}


def parse_kill_at(text: str | None) -> tuple[int, str] | None:
    """Parse ``STEP:POINT`` into (step, point)."""
    if text is None:
        return None
    step_text, _, point = text.partition(":")
    if not step_text.isdigit() or point not in KILL_POINTS:
        raise argparse.ArgumentTypeError(f"--kill-at must be STEP:POINT with POINT in {KILL_POINTS}, got {text!r}")
    return int(step_text), point


def main(argv: list[str] | None = None) -> None:
    """Join the lighthouse and train until the job has committed ``--max-steps`` steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--member", required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--max-microbatch", type=int, default=16)
    parser.add_argument("--token", default=None)
    parser.add_argument("--host", default="127.0.0.1", help="The address other workers reach this one on.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--collective-timeout", type=float, default=None, help="Default: STALWART_COLLECTIVE_TIMEOUT.")
    parser.add_argument("--rendezvous-timeout", type=float, default=None, help="Default: STALWART_RENDEZVOUS_TIMEOUT.")
    parser.add_argument("--heal-timeout", type=float, default=None, help="Default: STALWART_HEAL_TIMEOUT.")
    parser.add_argument("--kill-at", type=parse_kill_at, default=None)
    parser.add_argument("--corrupt-at", type=int, default=None, help="Perturb the parameters at this step (tests).")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="Extra seconds of simulated compute at the start of each step."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)

    def kill_if(point: str, step: int) -> None:
        if args.kill_at == (step, point):
            os.kill(os.getpid(), signal.SIGKILL)

    group = WorldInfo.from_env()
    loader = ElasticLoader(digits_dataset(), seed=args.seed)
    model = digits_model(args.seed)
    optimizer = digits_optimizer(model, args.lr)
    manager = Manager(
        model,
        optimizer,
        lighthouse=args.lighthouse,
        member=args.member,
        token=args.token,
        max_microbatch=args.max_microbatch,
        collective_timeout=args.collective_timeout,
        rendezvous_timeout=args.rendezvous_timeout,
        heal_timeout=args.heal_timeout,
        host=args.host,
        group=group,
        on_event=lambda event, step: kill_if(_MANAGER_EVENTS[event], step),
    )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    name = args.member if group.world_size == 1 else f"{args.member}.{group.rank}"
    with open(args.run_dir / f"steps-{name}.jsonl", "a", encoding="utf-8") as steps_file:
        for step in manager.steps(loader, max_steps=args.max_steps):
            number = manager.ledger.step
            time.sleep(args.step_seconds)
            if args.corrupt_at == number:
                args.corrupt_at = None
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(number)) * 1e-2)
            for batch in step:
                kill_if("before_forward", number)
                loss = summed_loss(model, batch)  # type: ignore[arg-type]
                if args.kill_at == (number, "during_backward"):
                    loss.register_hook(lambda grad, step_number=number: kill_if("during_backward", step_number))
                step.backward(loss)
            report = step.report
            record = {
                "member": args.member,
                "step": report.step,
                "epoch": report.epoch,
                "quorum_id": report.quorum_id,
                "world_size": report.world_size,
                "samples": report.samples,
                "loss": report.loss,
                "drift_heals": report.drift_heals,
                "time": time.time(),
                "positions": sorted(report.positions.tolist()),
            }
            steps_file.write(json.dumps(record) + "\n")
            steps_file.flush()
    torch.save(model.state_dict(), args.run_dir / f"final-{name}.pt")
    manager.close()
    loader.close()


if __name__ == "__main__":
    main()
