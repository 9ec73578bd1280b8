"""The user's training loop under the Manager: torch's verbs on every path, through real failures.

A user keeps the loop a DDP script has: a mean loss, backward, clipping, a
GradScaler, ``optimizer.step()``, a scheduler, evaluation on one worker.
These tests run the GPT task (a small decoder-only transformer with AdamW
over weight-decay groups and a warm-up cosine schedule) and the digits task
on local clusters of real worker processes with real SIGKILLs, and check the
final parameters against a failure-free single-process reference run of the
same loop; and they run the Manager in this process for what needs no
failure (the loss weighting, the step's contract, autocast, torch.compile,
activation checkpointing, a late joiner).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from stalwart import Checkpointing, ElasticLoader, EpochPlan, Lighthouse, Manager, StepContractError
from stalwart.data.shards import InMemoryShard, ShardedDataset
from stalwart.errors import JobFinishedError, PlanMismatchError
from stalwart.launch import gpt
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer, mean_loss
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import TASKS, gpt_datasets, reference_run
from stalwart.runtime.consistency import AuditError
from stalwart.runtime.threads import apply_thread_default
from stalwart.testing.digits_job import wait_for
from stalwart.testing.groups import end_group, launch_group

TOLERANCE = 1e-4
GPT_STEPS = 7
GPT_PLAN = EpochPlan(len(gpt_datasets("gpt-tiny")[0]), 16, seed=0)
CLIP = 0.05
"""Small enough that every step of the GPT clips: a path that skipped clipping would end far from the reference."""
DIGITS_PLAN = EpochPlan(1797, 48, seed=0)
JOB_TIMEOUT = 240.0


def gpt_args(*extra: str) -> list[str]:
    return ["--model", "gpt-tiny", "--optimizer", "adamw", "--clip", str(CLIP), "--max-steps", str(GPT_STEPS),
            "--max-microbatch", "3", "--collective-timeout", "1.0", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def gpt_reference() -> dict[str, torch.Tensor]:
    parameters, _ = reference_run(GPT_PLAN, GPT_STEPS, optimizer_name="adamw", clip=CLIP, task="gpt-tiny")
    unclipped, _ = reference_run(GPT_PLAN, GPT_STEPS, optimizer_name="adamw", clip=1e9, task="gpt-tiny")
    assert largest_difference(parameters, unclipped) > 20 * TOLERANCE  # a path that does not clip fails
    return parameters


def largest_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    return max(float((left[name] - value).abs().max()) for name, value in right.items())


def check_run(run_dir: Path, plan: EpochPlan, steps: int, reference: dict[str, torch.Tensor], finals: int) -> None:
    """Every step's global batch as planned, each sample once, and every final within TOLERANCE of ``reference``."""
    records = committed_steps(run_dir)
    assert [record["step"] for record in records] == list(range(steps))
    assert [record["samples"] for record in records] == [planned_total(plan, step) for step in range(steps)]
    assert audit_steps(plan, records) == (True, 0, 0)
    paths = sorted(run_dir.glob("final-*.pt"))
    assert len(paths) == finals
    for path in paths:
        assert largest_difference(torch.load(path, weights_only=True), reference) < TOLERANCE, path.name


@pytest.mark.parametrize(
    "redundancy", [[], ["--overlap", "0.5"], ["--parity", "2,2"]], ids=["replicated", "overlap", "parity"]
)
def test_the_gpt_loop_survives_a_kill_then_a_double_kill_with_clipping_and_its_schedule(
    tmp_path: Path, gpt_reference: dict[str, torch.Tensor], redundancy: list[str]
) -> None:
    """Four workers; worker 1 dies in step 2's backward, workers 2 and 3 together in step 5's update window.

    The survivor trains on alone; it ends on the failure-free parameters, so
    clipping and the schedule ran on the reduced gradient on every path.
    """
    kills = {1: "2:during_backward", 2: "5:during_update", 3: "5:during_update"}
    with Lighthouse(GPT_PLAN, min_replicas=2, start_replicas=4, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, gpt_args(*redundancy))
        for worker in range(4):
            cluster.start(worker, ["--kill-at", kills[worker]] if worker in kills else None)
        wait_for(cluster, timeout=JOB_TIMEOUT)
    assert [cluster.processes[worker].returncode for worker in kills] == [-signal.SIGKILL] * 3
    check_run(tmp_path, GPT_PLAN, GPT_STEPS, gpt_reference, finals=1)
    assert [record["world_size"] for record in committed_steps(tmp_path)][-1] == 1


def test_the_gpt_loop_in_fsdp2_groups_survives_a_double_kill_then_a_kill(
    tmp_path: Path, gpt_reference: dict[str, torch.Tensor]
) -> None:
    """Four FSDP2 groups of two processes: groups B and C die together in step 2, group D in step 5.

    Clipping runs over each group's DTensor shards (the global norm across the
    group's mesh), after the cross-group reduction.
    """
    kills = {"group-b": "2:during_backward", "group-c": "2:during_backward", "group-d": "5:after_reduce"}
    with Lighthouse(GPT_PLAN, min_replicas=1, start_replicas=4, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        agents = {
            name: launch_group(
                server.url,
                name,
                tmp_path,
                ["--fsdp", *gpt_args("--step-seconds", "0"), *(["--kill-at", kills[name]] if name in kills else [])],
            )
            for name in ("group-a", "group-b", "group-c", "group-d")
        }
        try:
            codes = {name: agent.wait(timeout=JOB_TIMEOUT) for name, agent in agents.items()}
        finally:
            for agent in agents.values():
                end_group(agent)
    assert codes["group-a"] == 0 and all(codes[name] != 0 for name in kills)
    check_run(tmp_path, GPT_PLAN, GPT_STEPS, gpt_reference, finals=2)


def test_a_gradscaler_overflow_on_one_worker_is_skipped_by_every_member(tmp_path: Path) -> None:
    """Worker 1's loss is inf in step 3: the reduced gradient overflows everywhere, every member skips the update."""
    steps = 8
    reference, _ = reference_run(DIGITS_PLAN, steps, skip_steps={3})
    unskipped, _ = reference_run(DIGITS_PLAN, steps)
    assert largest_difference(reference, unskipped) > 100 * TOLERANCE
    args = ["--max-steps", str(steps), "--max-microbatch", "8", "--collective-timeout", "1.0", "--scaler"]
    with Lighthouse(DIGITS_PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, args)
        for worker in range(2):
            cluster.start(worker, ["--inf-at", "3"] if worker == 1 else None)
        wait_for(cluster, timeout=JOB_TIMEOUT)
    check_run(tmp_path, DIGITS_PLAN, steps, reference, finals=2)
    by_member: dict[str, list[float]] = {}
    for path in sorted(tmp_path.glob("steps-*.jsonl")):
        by_member[path.name] = [json.loads(line)["scale"] for line in path.read_text().splitlines()]
    for scales in by_member.values():
        assert scales[:3] == [2.0**10] * 3 and scales[3] == 2.0**9  # the overflow halved every member's scale
    assert len({tuple(scales) for scales in by_member.values()}) == 1


def test_evaluation_on_the_leader_alone_forms_no_spurious_quorum(tmp_path: Path) -> None:
    """The leader evaluates for 2.5 s every 4 steps; the other goes on to its next step, as DDP's ranks do, and
    waits for the leader before that step's reduction, with no collective pending (collective_timeout 1 s). Ahead
    of the busy leader for longer than the lighthouse's join_timeout (1 s), it still reports the step it was at:
    the lighthouse evicts a member that peers ahead of it wait on (when it reported its new steps, it did)."""
    steps = 8
    reference, _ = reference_run(DIGITS_PLAN, steps)
    args = ["--max-steps", str(steps), "--max-microbatch", "16", "--collective-timeout", "1.0"]
    args += ["--eval-every", "4", "--eval-seconds", "2.5"]
    with Lighthouse(DIGITS_PLAN, min_replicas=2, heartbeat_timeout=1.0, join_timeout=1.0) as server:
        cluster = LocalCluster(server.url, tmp_path, args)
        for worker in range(2):
            cluster.start(worker)
        wait_for(cluster, timeout=JOB_TIMEOUT)
        status = server.status()
    check_run(tmp_path, DIGITS_PLAN, steps, reference, finals=2)
    assert [quorum["reason"] for quorum in status["quorums"]] == ["start-up"] and status["failures"] == []
    evaluations = {
        path.name: [
            event["step"] for event in map(json.loads, path.read_text().splitlines()) if event["event"] == "evaluated"
        ]
        for path in tmp_path.glob("events-*.jsonl")
    }
    assert sorted(steps for steps in evaluations.values() if steps) == [[4, 8]]  # one worker evaluated
    leader = next(name for name, steps in evaluations.items() if steps).removeprefix("events-")
    evaluated = next(
        event["time"]
        for event in map(json.loads, (tmp_path / f"events-{leader}").read_text().splitlines())
        if event["event"] == "evaluated" and event["step"] == 4
    )
    (other,) = [path for path in tmp_path.glob("steps-*.jsonl") if path.name != f"steps-{leader}"]
    finished = {record["step"]: record["time"] for record in map(json.loads, other.read_text().splitlines())}
    assert finished[3] < evaluated < finished[4]  # on past on_leader(), held at step 4's reduction until it ended


@pytest.mark.parametrize("first", [False, True], ids=["after-update", "top-of-step"])
def test_a_leader_killed_inside_on_leader_is_named_dead_there_not_busy(tmp_path: Path, first: bool) -> None:
    """The leader is SIGKILLed inside its evaluation (``manager.on_leader()``) after step 1; the survivor, waiting
    for it, is told that the leader died inside on_leader (it used to be told nothing), then trains the job's end
    alone. Evaluating at the top of a step's body (nanoGPT's place), the survivor goes on to reduce that step: the
    failed all-reduce's warning says the same, where a busy peer's hint could come."""
    args = ["--max-steps", "4", "--max-microbatch", "16", "--eval-every", "2", "--kill-at", "1:during_evaluate"]
    args += ["--eval-first"] if first else []
    with Lighthouse(DIGITS_PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=5.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, args)
        for worker in range(2):
            cluster.start(worker)  # both carry the kill: only the leader evaluates
        wait_for(cluster, timeout=JOB_TIMEOUT)
    codes = {worker: process.returncode for worker, process in cluster.processes.items()}
    assert sorted(codes.values()) == [-signal.SIGKILL, 0], codes
    leader = next(worker for worker, code in codes.items() if code)
    survivor = 1 - leader
    log = (tmp_path / f"worker-{survivor}.log").read_text()
    told = [line for line in log.splitlines() if f"the leader worker-{leader} died inside manager.on_leader()" in line]
    assert told, log
    if first:
        assert any("step 2 all-reduce failed" in line for line in told), log
    assert "alive but busy" not in log
    assert (tmp_path / f"final-worker-{survivor}.pt").exists()


# --- the Manager in this process ----------------------------------------------------------------------


@pytest.fixture
def solo() -> Iterator[Lighthouse]:
    """A lighthouse with no plan of its own: the training script's plan is adopted."""
    with Lighthouse(None, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        yield server


def train(
    server: Lighthouse,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Any,
    plan: EpochPlan,
    steps: int,
    micro: int,
    loss_of: Any,
    **manager: Any,
) -> list[float]:
    """The user's loop for ``steps`` steps with one member; each step's reported mean loss."""
    runner = Manager(model, optimizer, lighthouse=server.url, member="solo", max_microbatch=micro, plan=plan, **manager)
    loader = ElasticLoader(dataset)
    losses = []
    try:
        for step in runner.steps(loader, max_steps=steps):
            for batch in step:
                loss, weight = loss_of(model, batch)
                step.backward(loss, weight=weight)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step.report.loss)
    finally:
        runner.close()
        loader.close()
    return losses


def test_mean_losses_weighted_by_samples_train_what_one_mean_over_the_step_does(solo: Lighthouse) -> None:
    """Micro-batches of 7 from 48-sample steps (six of 7, one of 6): their means weighted by samples are the mean."""
    reference, reference_losses = reference_run(DIGITS_PLAN, 5)
    model = digits_model(0)
    losses = train(
        solo, model, digits_optimizer(model), digits_dataset(), DIGITS_PLAN, 5, 7, lambda m, b: (mean_loss(m, b), None)
    )
    assert largest_difference(model.state_dict(), reference) < 1e-6
    assert losses == pytest.approx(reference_losses, rel=1e-6)


def test_a_token_mean_loss_weighted_by_its_tokens_is_the_steps_token_mean(solo: Lighthouse) -> None:
    """Targets partly masked (-100) so micro-batches hold different token counts; ``weight=`` the count."""
    windows, _ = gpt_datasets("gpt-tiny")
    masked = [(inputs, torch.where(torch.arange(inputs.numel()) < (index % 13) + 2, targets, -100))
              for index, (inputs, targets) in ((i, windows[i]) for i in range(96))]  # fmt: skip
    dataset = TensorDataset(torch.stack([x for x, _ in masked]), torch.stack([y for _, y in masked]))
    plan = EpochPlan(len(dataset), 24, shuffle=False)

    def token_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits, _ = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return loss, (targets != -100).sum()

    model = TASKS["gpt-tiny"].model(0)
    expected = TASKS["gpt-tiny"].model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected_optimizer = torch.optim.SGD(expected.parameters(), lr=0.5)
    train(solo, model, optimizer, dataset, plan, 3, 5, token_loss)
    for step in range(3):  # one mean over the step's tokens
        inputs, targets = dataset[step * 24 : (step + 1) * 24]
        token_loss(expected, (inputs, targets))[0].backward()
        expected_optimizer.step()
        expected_optimizer.zero_grad()
    assert largest_difference(model.state_dict(), expected.state_dict()) < 1e-6


def test_the_steps_contract_is_enforced_with_errors_that_say_what_to_do(solo: Lighthouse) -> None:
    model = digits_model(0)
    optimizer = digits_optimizer(model)
    manager = Manager(model, optimizer, lighthouse=solo.url, member="solo", max_microbatch=16, plan=DIGITS_PLAN)
    loader = ElasticLoader(digits_dataset())
    mean_loss(model, digits_dataset()[:4]).backward()
    with pytest.raises(StepContractError, match=r"optimizer.step\(\) was called outside a reduced step"):
        optimizer.step()  # unreduced gradients
    optimizer.zero_grad()
    try:
        steps = manager.steps(loader, max_steps=4)
        step = next(steps)
        for batch in step:
            step.backward(mean_loss(model, batch))
        optimizer.step()
        with pytest.raises(StepContractError, match="called twice in step 0"):
            optimizer.step()
        step = next(steps)
        batches = iter(step)
        batch = next(batches)
        with pytest.raises(StepContractError, match="outside a reduced step"):
            optimizer.step()  # in the middle of the step's micro-batches
        mean_loss(model, batch).backward()  # not through step.backward: the step cannot weigh it
        with pytest.raises(StepContractError, match=r"not back-propagated with step.backward\(loss\)"):
            next(batches)
        with pytest.raises(ValueError, match="weight must be a finite count >= 0"):
            step.backward(mean_loss(model, batch), weight=-1)
    finally:
        manager.close()
        loader.close()


@pytest.mark.parametrize(
    "variant",
    ["bf16-autocast", "fp16-autocast-gradscaler", pytest.param("compiled", marks=pytest.mark.slow), "checkpointed"],
)
def test_autocast_gradscaler_torch_compile_and_activation_checkpointing_train_the_gpt(
    solo: Lighthouse, variant: str
) -> None:
    """Each runs the GPT loop under the Manager and ends where the same loop ends in plain torch (one process)."""
    windows, _ = gpt_datasets("gpt-tiny")
    plan = EpochPlan(len(windows), 12, seed=1)
    config = TASKS["gpt-tiny"].model(0).config
    if variant == "checkpointed":
        config = gpt.GPTConfig(**{**config.__dict__, "activation_checkpointing": True})
    dtype = {"bf16-autocast": torch.bfloat16, "fp16-autocast-gradscaler": torch.float16}.get(variant)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if dtype == torch.float16 else None

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = gpt.GPT(config)
        return model, torch.optim.SGD(gpt.optimizer_groups(model, 0.1), lr=0.3, momentum=0.9)  # SGD: a mis-scaled
        # gradient shows (Adam's update would hide it)

    def forward(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            return model(inputs, targets)[1]

    model, optimizer = build()
    runnable = torch.compile(model, backend="aot_eager") if variant == "compiled" else model
    manager = Manager(model, optimizer, lighthouse=solo.url, member="solo", max_microbatch=12, plan=plan)
    if scaler is not None:
        manager.register_state("scaler", scaler)
    loader = ElasticLoader(windows)
    try:
        for step in manager.steps(loader, max_steps=4):
            for inputs, targets in step:
                step.backward(forward(runnable, inputs, targets), scaler=scaler)
            if scaler is None:
                optimizer.step()
            else:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
    finally:
        manager.close()
        loader.close()
    expected, expected_optimizer = build()
    expected_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler is not None else None
    for step_number in range(4):
        indices = plan.indices(0, plan.step_start(step_number), plan.step_start(step_number + 1))
        inputs, targets = torch.utils.data.default_collate([windows[int(index)] for index in indices])
        loss = forward(expected, inputs, targets)
        if expected_scaler is None:
            loss.backward()
            expected_optimizer.step()
        else:
            expected_scaler.scale(loss).backward()
            expected_scaler.unscale_(expected_optimizer)
            torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
            expected_scaler.step(expected_optimizer)
            expected_scaler.update()
        expected_optimizer.zero_grad()
    # autocast rounds the micro-batch's loss-weighted backward in bf16 (8 mantissa bits) or fp16 (11): a few
    # thousandths of the training's movement, which is over 50 times each tolerance
    tolerance = {torch.bfloat16: 5e-3, torch.float16: 5e-4}.get(dtype, TOLERANCE)  # type: ignore[call-overload]
    assert largest_difference(model.state_dict(), expected.state_dict()) < tolerance
    assert largest_difference(expected.state_dict(), build()[0].state_dict()) > 50 * tolerance
    if scaler is not None:
        assert expected_scaler is not None and scaler.get_scale() == expected_scaler.get_scale()


def test_a_worker_joining_after_the_end_loads_the_final_checkpoint_or_is_told_it_is_untrained(
    solo: Lighthouse, tmp_path: Path
) -> None:
    model = digits_model(0)
    optimizer = digits_optimizer(model)
    checkpoint = Checkpointing(tmp_path / "checkpoints", every_steps=2)
    train(solo, model, optimizer, digits_dataset(), DIGITS_PLAN, 3, 16, lambda m, b: (mean_loss(m, b), None),
          checkpoint=checkpoint)  # fmt: skip
    late = digits_model(1)
    late_optimizer = digits_optimizer(late)
    assert train(solo, late, late_optimizer, digits_dataset(), DIGITS_PLAN, 3, 16, lambda m, b: (mean_loss(m, b), None),
                 checkpoint=checkpoint) == []  # fmt: skip
    assert largest_difference(late.state_dict(), model.state_dict()) == 0.0  # the trained parameters, loaded
    untrained = digits_model(2)  # without a checkpoint directory of its own it cannot load the trained state
    with pytest.raises(JobFinishedError, match="no checkpoint directory"):
        train(solo, untrained, digits_optimizer(untrained), digits_dataset(), DIGITS_PLAN, 3, 16,
              lambda m, b: (mean_loss(m, b), None))  # fmt: skip


def test_bad_manager_arguments_name_the_argument(solo: Lighthouse, monkeypatch: pytest.MonkeyPatch) -> None:
    model = digits_model(0)
    monkeypatch.delenv("STALWART_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="lighthouse must be given, or the environment variable STALWART_LIGHTHOUSE"):
        Manager(model, digits_optimizer(model), member="m", max_microbatch=4)
    with pytest.raises(TypeError, match="checkpoint must be a Checkpointing or None, got str"):
        Manager(model, digits_optimizer(model), lighthouse=solo.url, member="m", max_microbatch=4, checkpoint="dir")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Checkpointing needs every_steps or every_seconds"):
        Checkpointing("dir")
    wrong = EpochPlan(1797, 50)
    mismatched = Manager(model, digits_optimizer(model), lighthouse=solo.url, member="m", max_microbatch=4, plan=wrong)
    loader = ElasticLoader(digits_dataset())
    try:
        next(mismatched.steps(loader, max_steps=1))  # the first plan offered is adopted
    finally:
        mismatched.close()
        loader.close()
    other = Manager(
        model, digits_optimizer(model), lighthouse=solo.url, member="n", max_microbatch=4, plan=EpochPlan(1797, 60)
    )
    loader = ElasticLoader(digits_dataset())
    try:
        with pytest.raises(PlanMismatchError, match="global_batch_size"):
            next(other.steps(loader, max_steps=1))
    finally:
        other.close()
        loader.close()


def test_rows_that_change_under_their_indices_stop_the_job_at_the_end_of_the_epoch(solo: Lighthouse) -> None:
    """The row audit through the Manager: the loader's rows are reshuffled in place after epoch 0 (a source that
    changed): every position is still delivered once, but epoch 1's rows sum to another value than epoch 0's."""
    rows = [{"id": index, "x": [float(index % 7), 1.0]} for index in range(32)]
    dataset = ShardedDataset([InMemoryShard(rows)], key="id")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    manager = Manager(model, optimizer, lighthouse=solo.url, member="solo", max_microbatch=8, plan=EpochPlan(32, 16))
    loader = ElasticLoader(dataset, collate_fn=lambda batch: torch.tensor([row["x"] for row in batch]))
    epochs = []
    try:
        with pytest.raises(AuditError, match=r"epoch 1: the rows the quorum trained on sum to"):
            for step in manager.steps(loader, max_steps=8):
                for features in step:
                    step.backward(model(features).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                epochs.append(step.epoch)
                if step.epoch_end and step.epoch == 0:
                    rows.reverse()  # in place: the shard's rows under the same indices change
                    dataset.close()  # and the source is read again (its cached pieces dropped)
    finally:
        manager.close()
        loader.close()
    assert epochs == [0, 0, 1, 1]  # epoch 0 passed; epoch 1 was refused as it committed


def test_a_worker_started_by_hand_gets_one_thread_as_under_torchrun() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert apply_thread_default({"OMP_NUM_THREADS": "2"}) is None and torch.get_num_threads() == 2
        assert apply_thread_default({"TORCHELASTIC_RUN_ID": "job"}) is None and torch.get_num_threads() == 2
        assert apply_thread_default({}) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
