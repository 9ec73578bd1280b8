"""Runtime benchmark: fault tolerance's cost per step against what users would pick, recovery, work lost.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.runtime                 # full run: 3 models x 2 and 4 workers, ~45 min on 2 cores
    python -m benchmarks.runtime --quick         # tiny model, 2 workers, 4 variants, one failure of each kind: < 1 min
    python -m benchmarks.runtime --models 10m --workers 2 --rounds 3 --skip-recovery   # one comparison
    python -m benchmarks.runtime --device cuda   # NCCL, one GPU per worker (LOCAL_RANK = rank)

torchft is optional (``pip install torchft==0.2.0``); without it its rows say
why they were not run. Three measurements, each printed as a table, then a
summary of the goals:

1. **Per-step time and memory without failures.** Worker processes
   (:mod:`benchmarks._runtime_workers`, on 127.0.0.1) train the same MLP on
   the same plan and apply the same update (the mean gradient over the global
   batch), with micro-batches: ``ddp`` (torch's ``DistributedDataParallel``,
   default buckets, ``no_sync()`` but for the last micro-batch: the baseline
   every ratio is taken against), ``plain`` (one flat all-reduce after the
   last micro-batch, no fault tolerance), ``stalwart`` (the Manager and
   ElasticLoader against an embedded lighthouse, prefetch off), ``stalwart+prefetch``
   (the loader's background prefetch on), ``torchft`` (torchft's
   Manager and all-reduce against its lighthouse), ``fsdp2`` (``fully_shard``
   over all processes) and ``hsdp`` (``fully_shard`` over a (replicate,
   shard) mesh of groups of 2 processes: 4 workers only), and
   ``stalwart-hsdp`` (stalwart's Manager over groups of 2 processes that
   ``fully_shard`` the model: fault-tolerant HSDP); none but stalwart and
   torchft tolerates faults. MLPs of about 1M, 10M and 50M parameters
   (``--quick``: a 5k-parameter one, where fixed per-step costs dominate),
   2 and 4 workers. Rank 0 times every step (top of one loop iteration to the
   next) and its phases, and the CPU time its process used; every worker
   reports its peak memory (CPU: growth of its peak RSS from before the model
   was built; CUDA: ``torch.cuda.max_memory_allocated``). Variants run in turn,
   in an order that rotates each round, so the per-round ratios come from one
   run; medians after warm-up are reported. Goals: stalwart's step at most
   1.03x DDP's (wall time and CPU time) at 10M and 50M parameters, and faster
   than torchft's; stalwart's peak memory at most DDP's plus one DDP bucket
   (25 MiB); stalwart over HSDP groups at most 1.05x plain HSDP; on the tiny
   model, less than 1 ms added per step. With more workers than cores and
   other jobs on the machine, wall time depends on how the scheduler
   interleaves the workers; CPU time per step is the steadier measure of the
   work a step costs.
2. **Recovery.** The digits job (``stalwart.launch.worker`` on a
   :class:`~stalwart.launch.cluster.LocalCluster`, 3 workers, embedded
   lighthouse with a heartbeat timeout of 1 s, collective timeout 1 s, 0.05 s
   of simulated compute per step) loses a worker to SIGKILL or SIGSTOP
   several times; recovery is the time from the signal to the first step
   committed by a new quorum. Goals: SIGKILL under 1 s, SIGSTOP under the
   heartbeat timeout + 1 s. In the full run torchft's survivors are also
   watched through one SIGKILL of a peer (torchft's DDP wrapper, then its
   all-reduce).
3. **Work lost per failure.** Sample-gradients recomputed and samples never
   trained, per failure: stalwart (the dead member's share of the step in
   flight, replayed from the lighthouse's quorum history with the real
   ledger), torchft (from its SIGKILL run when it ran) and checkpoint-restart
   every K steps (K/2 steps of the global batch recomputed on average, plus a
   restart measured as launch to first step of a DDP job).

Every wait is bounded (a run that overstays ``STEP_RUN_TIMEOUT_S`` is killed
and its row says so). The benchmark reports; it never fails because a goal is
missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Column

from benchmarks._measure import (
    Goal,
    add_rounds,
    machine_line,
    make_console,
    print_goals,
    print_table,
    progress_display,
    run_directory,
)
from benchmarks._rounds import interleaved_rounds, round_ratios, span
from benchmarks._runtime_workers import MODELS, ModelSpec, build_model
from benchmarks._workers import POLL_S, TorchftLighthouse, WorkerGroup, torchft_missing
from stalwart.coord.server import Lighthouse
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.digits import digits_dataset

RECOVERY_WORKERS = 3
HEARTBEAT_TIMEOUT = 1.0
COLLECTIVE_TIMEOUT = 1.0
RECOVERY_STEP_SECONDS = 0.05
DIGITS_GLOBAL_BATCH = 48
CHECKPOINT_INTERVALS = (10, 50)
OVERHEAD_TIMEOUT = 60.0
"""Collective and heartbeat timeouts of the per-step runs: nothing fails there, a slow step must not break a run."""
BASELINE = "ddp"
LARGE_MODELS = ("10m", "50m")
LARGE_GOAL_RATIO = 1.03
HSDP_GOAL_RATIO = 1.03
"""Fault-tolerant HSDP's goal against plain HSDP, wall time (10M parameters, 2 groups of 2)."""
DDP_BUCKET_MIB = 25.0
"""DistributedDataParallel's default ``bucket_cap_mb``: the memory goal's allowance over DDP."""
TINY_GOAL_MS = 1.0
SIGKILL_GOAL_S = 1.0
SIGSTOP_GOAL_S = HEARTBEAT_TIMEOUT + 1.0
RUN_TIMEOUT_S = 240.0
STEP_RUN_TIMEOUT_S = 600.0
"""A per-step run's limit: FSDP2 and HSDP over Gloo take seconds a step on the 50M model with 4 workers on 2 cores."""
PHASES = ("total", "cpu", "compute", "before", "reduce", "after")


@dataclass(frozen=True)
class Variant:
    """A row of table 1: its worker loop, what coordinates it, its extra arguments and its replica groups' size."""

    loop: str
    coordinator: Literal["store", "lighthouse", "torchft"] = "store"
    """``store``: torch.distributed through the driver's TCPStore; ``lighthouse``: stalwart's; ``torchft``: its own."""
    args: tuple[str, ...] = ()
    group_size: int = 1
    """Processes per replica group (HSDP's shard groups); a lighthouse's members are the groups."""

    def runs_with(self, workers: int) -> bool:
        """True when ``workers`` make at least two whole replica groups."""
        return workers % self.group_size == 0 and workers // self.group_size >= 2


VARIANTS = {
    "ddp": Variant("ddp"),
    "plain": Variant("plain"),
    "stalwart": Variant("stalwart", "lighthouse"),
    "stalwart+prefetch": Variant("stalwart", "lighthouse", ("--prefetch",)),
    "torchft": Variant("torchft", "torchft"),
    "fsdp2": Variant("fsdp2"),
    "hsdp": Variant("hsdp", group_size=2),
    "stalwart-hsdp": Variant("stalwart-hsdp", "lighthouse", group_size=2),
}
"""Table 1's rows, in order. Every worker gets the driver's store (``--store-port``, ``--prefix``) and
``--group-size``; the HSDP loops' groups build their meshes from that store."""


@dataclass(frozen=True)
class Settings:
    """Sizes, worker counts, step counts and failure counts of one run (full or ``--quick``)."""

    models: tuple[str, ...]
    workers: tuple[int, ...]
    variants: tuple[str, ...]
    steps: dict[str, int]
    warmup: dict[str, int]
    rounds: int
    failures_per_signal: int
    torchft_kill_trial: bool
    recovery: bool = True
    forked_workers: bool = False
    """Fork workers from one interpreter that imported torch (quick runs: start-up figures are not a user's)."""


FULL = Settings(
    models=("1m", "10m", "50m"),
    workers=(2, 4),
    variants=tuple(VARIANTS),
    steps={"tiny": 300, "1m": 40, "10m": 20, "50m": 10},
    warmup={"tiny": 50, "1m": 5, "10m": 4, "50m": 2},
    rounds=3,
    failures_per_signal=5,
    torchft_kill_trial=True,
)
QUICK = dataclasses.replace(
    FULL,
    models=("tiny",),
    workers=(2,),
    variants=("ddp", "stalwart", "torchft", "fsdp2"),
    steps={**FULL.steps, "tiny": 40},
    warmup={**FULL.warmup, "tiny": 10},
    rounds=1,
    failures_per_signal=1,
    torchft_kill_trial=False,
    forked_workers=True,
)


# 1. Per-step time and memory without failures.


@dataclass
class OverheadRow:
    """Rank 0's step times (ms) of one variant on one model and worker count, pooled over rounds.

    ``peak_mib`` holds each round's largest peak memory of a worker;
    ``note`` says why the row was not run.
    """

    model: str
    workers: int
    variant: str
    phases: dict[str, list[float]] = field(default_factory=lambda: {phase: [] for phase in PHASES})
    round_medians: list[float | None] = field(default_factory=list)
    """Each round's median step (ms); None for a round it did not run."""
    peak_mib: list[float] = field(default_factory=list)
    first_step_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def measured(self) -> bool:
        """True when some steps were timed."""
        return bool(self.phases["total"])

    def median(self, phase: str = "total") -> float:
        """Median milliseconds of ``phase`` (one of ``PHASES``)."""
        return statistics.median(self.phases[phase])


@dataclass(frozen=True)
class Run:
    """One run of a variant: its model, worker count, steps, device and name (the prefix of its files)."""

    variant: str
    spec: ModelSpec
    workers: int
    steps: int
    device: str
    name: str
    forked: bool = False
    """Workers forked from one interpreter that imported torch (``Settings.forked_workers``)."""


def run_variant(run: Run, run_dir: Path, store: dist.TCPStore, tick: Callable[[], None]) -> tuple[WorkerGroup, str]:
    """Run ``run``'s workers to the end (bounded); returns the group and an error note ('' if it went well)."""
    variant = VARIANTS[run.variant]
    group = WorkerGroup(run_dir, run.name, run.workers, run.device, forked=run.forked)
    replicas = run.workers // variant.group_size
    extra = [
        "--store-port", str(store.port), "--prefix", f"{run.name}/", "--group-size", str(variant.group_size),
        "--collective-timeout", str(OVERHEAD_TIMEOUT),
    ]  # fmt: skip
    ours: Lighthouse | None = None
    theirs: TorchftLighthouse | None = None
    if variant.coordinator == "lighthouse":
        ours = Lighthouse(run.spec.plan(), min_replicas=replicas, heartbeat_timeout=OVERHEAD_TIMEOUT, join_timeout=30.0)
        ours.start()
        extra += ["--lighthouse", ours.url]
    elif variant.coordinator == "torchft":
        try:
            theirs = TorchftLighthouse(min_replicas=replicas)
        except RuntimeError as error:
            return group, f"torchft's lighthouse did not start: {error}"
        extra += ["--lighthouse", theirs.address, "--min-replicas", str(replicas)]
    extra += variant.args
    try:
        for rank in range(run.workers):
            group.start(variant.loop, run.spec.name, run.steps, rank, extra)
        finished = group.wait(STEP_RUN_TIMEOUT_S, tick)
    finally:
        group.kill()
        for server in (ours, theirs):
            if server is not None:
                server.stop()
    codes = [process.returncode for process in group.processes]
    if not finished:
        return group, f"timed out after {STEP_RUN_TIMEOUT_S:.0f} s: {group.log_tail(0)}"
    if any(codes):
        failed = next(rank for rank, code in enumerate(codes) if code)
        return group, f"exit codes {codes}: {group.log_tail(failed)}"
    return group, ""


def overhead_runs(settings: Settings) -> int:
    """How many runs :func:`measure_overhead` makes."""
    per_round = sum(VARIANTS[v].runs_with(workers) for v in settings.variants for workers in settings.workers)
    return len(settings.models) * settings.rounds * per_round


def measure_overhead(
    settings: Settings, device: str, run_dir: Path, progress: Progress, task: TaskID
) -> list[OverheadRow]:
    """Each variant, model and worker count, ``rounds`` interleaved rounds (rank 0's steps after warm-up)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    rows = []
    for model in settings.models:
        for workers in settings.workers:
            names = [variant for variant in settings.variants if VARIANTS[variant].runs_with(workers)]
            rows += _compare(
                Run("", MODELS[model], workers, settings.steps[model], device, "", settings.forked_workers),
                names,
                settings,
                run_dir,
                store,
                progress,
                task,
            )
    return rows


def _compare(
    base: Run,
    variants: Sequence[str],
    settings: Settings,
    run_dir: Path,
    store: dist.TCPStore,
    progress: Progress,
    task: TaskID,
) -> list[OverheadRow]:
    """``variants`` on one model and worker count (``base``'s), in interleaved rounds: table 1's rows for them."""
    model, workers = base.spec.name, base.workers
    rows = {variant: OverheadRow(model, workers, variant) for variant in variants}
    skip_torchft = torchft_missing()

    def measure(variant: str, round_number: int) -> float | None:
        row = rows[variant]
        progress.update(
            task, description=f"per-step time: {model}, {workers} workers, {variant} (round {round_number + 1})"
        )
        median = None
        if VARIANTS[variant].coordinator == "torchft" and skip_torchft:
            row.note = skip_torchft
        elif not row.note:
            slug = variant.replace(", ", "-").replace(" ", "-")
            run = dataclasses.replace(base, variant=variant, name=f"{slug}-{model}-{workers}-{round_number}")
            median = _record_run(row, run, settings.warmup[model], run_variant(run, run_dir, store, progress.refresh))
        progress.advance(task)
        return median

    for variant, medians in interleaved_rounds(variants, settings.rounds, measure).items():
        rows[variant].round_medians = medians
    return list(rows.values())


def _record_run(row: OverheadRow, run: Run, warmup: int, outcome: tuple[WorkerGroup, str]) -> float | None:
    """Add a run's steps after warm-up, its first step's time and its peak memory to ``row``, or note its failure.

    Returns the run's median step (ms), None when it failed.
    """
    group, error = outcome
    records = group.records(0)
    peaks = group.peak_memory_bytes()
    if error or len(records) < run.steps or len(peaks) < run.workers:
        missing = f"rank 0 wrote {len(records)} of {run.steps} steps, {len(peaks)} worker(s) their memory"
        row.note = f"not run: {error or missing}"
        row.phases = {phase: [] for phase in PHASES}
        return None
    kept = records[warmup:-1]  # after warm-up; the last step also times the shutdown
    for phase, values in row.phases.items():
        values += [record[phase] * 1e3 for record in kept if record[phase] is not None]
    row.peak_mib.append(max(peaks) / 2**20)
    row.first_step_s.append(records[0]["since_launch"])
    return statistics.median(record["total"] * 1e3 for record in kept)


# 2. Recovery and 3. work lost, on the digits job.


@dataclass(frozen=True)
class Recovery:
    """One injected failure: the signal, when, and how long until the next step committed by a new quorum."""

    signal: str
    worker: int
    seconds: float | None
    detect_s: float | None
    quorum_s: float | None


@dataclass
class RecoveryResult:
    """The failures of the digits run, the step time without failures, and the work each failure reassigned."""

    recoveries: list[Recovery]
    step_s: float | None
    reassigned: list[int]
    global_batch: int
    note: str = ""


class StepTail:
    """Reads the digits workers' step records incrementally (no re-reading of whole files while polling)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """Records written since the last poll."""
        new = []
        for path in sorted(self.run_dir.glob("steps-*.jsonl")):
            with open(path, "rb") as handle:
                handle.seek(self._offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.records += new
        return new

    def wait_for(self, condition: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The first new record meeting ``condition`` (bounded by ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.poll():
                if condition(record):
                    return record
            time.sleep(POLL_S / 5)
        return None


def failure_schedule(failures_per_signal: int) -> list[str]:
    """STOP and KILL in turn, so that a SIGKILLed worker (slow to restart) is last when there is one of each."""
    return [name for _ in range(failures_per_signal) for name in ("STOP", "KILL")]


def measure_recovery(settings: Settings, run_dir: Path, progress: Progress, task: TaskID) -> RecoveryResult:
    """Inject the failures one after another into one digits job; each waits until the quorum is whole again."""
    plan = EpochPlan(len(digits_dataset()), DIGITS_GLOBAL_BATCH, seed=0)
    lighthouse = Lighthouse(plan, min_replicas=1, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=5.0)
    lighthouse.start()
    worker_args = [
        "--max-steps", "1000000", "--max-microbatch", "16", "--step-seconds", str(RECOVERY_STEP_SECONDS),
        "--collective-timeout", str(COLLECTIVE_TIMEOUT),
    ]  # fmt: skip
    # fresh interpreters, as DDP relaunches (unless the quick run forks them)
    cluster = LocalCluster(lighthouse.url, run_dir / "digits", worker_args, preloaded=settings.forked_workers)
    tail = StepTail(cluster.run_dir)
    schedule = failure_schedule(settings.failures_per_signal)
    recoveries: list[Recovery] = []
    note = ""
    try:
        progress.update(task, description="recovery: starting the digits job")
        for worker in range(RECOVERY_WORKERS):
            cluster.start(worker)
        if tail.wait_for(lambda r: r["world_size"] == RECOVERY_WORKERS and r["step"] >= 5, 120.0) is None:
            raise TimeoutError("the digits job did not reach 5 steps with 3 workers in 120 s")
        for number, signal_name in enumerate(schedule):
            progress.update(task, description=f"recovery: failure {number + 1}/{len(schedule)} (SIG{signal_name})")
            victim = number % RECOVERY_WORKERS
            recoveries.append(_inject_failure(cluster, lighthouse, tail, victim, signal_name))
            progress.advance(task)
            if number == len(schedule) - 1:
                break
            cluster.revive(victim)
            if not _whole_again(tail, RUN_TIMEOUT_S / 2):
                note = f"worker-{victim} did not rejoin in {RUN_TIMEOUT_S / 2:.0f} s; stopped after {number + 1}"
                break
        status = lighthouse.status()
    except TimeoutError as error:
        note, status = str(error), lighthouse.status()
    finally:
        cluster.terminate()
        lighthouse.stop()
    tail.poll()
    return RecoveryResult(
        recoveries, _failure_free_step_s(tail.records), reassigned_shares(plan, status), DIGITS_GLOBAL_BATCH, note
    )


def _inject_failure(
    cluster: LocalCluster, lighthouse: Lighthouse, tail: StepTail, victim: int, signal_name: str
) -> Recovery:
    """Send ``signal_name`` to ``victim`` and wait (bounded) for the first step a new quorum commits."""
    quorum_before = max(record["quorum_id"] for record in tail.records)
    status_before = lighthouse.status()
    killed_at = time.time()
    cluster.kill(victim, signal_name, max(record["step"] for record in tail.records))
    first = tail.wait_for(lambda record: record["quorum_id"] > quorum_before and record["time"] > killed_at, 30.0)
    detect_s, quorum_s = _lighthouse_times(status_before, lighthouse.status(), f"worker-{victim}", killed_at)
    seconds = None if first is None else first["time"] - killed_at
    return Recovery(signal_name, victim, seconds, detect_s, quorum_s)


def _whole_again(tail: StepTail, timeout: float) -> bool:
    """Wait (bounded) until steps are committed by all workers again, five steps on."""
    start_step = max(record["step"] for record in tail.records)
    return (
        tail.wait_for(lambda r: r["world_size"] == RECOVERY_WORKERS and r["step"] >= start_step + 5, timeout)
        is not None
    )


def _lighthouse_times(
    before: dict[str, Any], after: dict[str, Any], member: str, killed_at: float
) -> tuple[float | None, float | None]:
    """(signal to the lighthouse's failure record, that record to the next quorum) for the new failure of ``member``."""
    known = len(before["recoveries"])
    new = [r for r in after["recoveries"][known:] if r["member"] == member]
    if not new:
        return None, None
    return new[0]["failed_at"] - killed_at, new[0]["seconds"]


def _failure_free_step_s(records: list[dict[str, Any]]) -> float | None:
    """Median time between consecutive commits of one quorum at full size (the job's step time)."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step.setdefault(record["step"], record)
    gaps = [
        by_step[step]["time"] - by_step[step - 1]["time"]
        for step in by_step
        if step - 1 in by_step
        and by_step[step]["world_size"] == by_step[step - 1]["world_size"] == RECOVERY_WORKERS
        and by_step[step]["quorum_id"] == by_step[step - 1]["quorum_id"]
    ]
    return statistics.median(gaps) if gaps else None


def reassigned_shares(plan: EpochPlan, status: dict[str, Any]) -> list[int]:
    """Positions reassigned to survivors at each failure quorum: the dead members' shares of the step in flight.

    Replays the lighthouse's quorum history with a real :class:`DataLedger`:
    each quorum's members run the steps up to the next quorum's
    ``applied_step``; at a failure quorum, the old members began the step, the
    missing ones failed and their positions are reassigned to the survivors. A
    rolled-back step (a member applied it and died before anyone else did)
    makes the replay stop: its count would be a whole step, which the history
    does not show directly.
    """
    ledger = DataLedger(plan)
    members: list[str] = []
    reassigned = []
    for entry in status["quorums"]:
        target, failure = entry["applied_step"], entry["reason"] == "failure"
        if target < ledger.step or (ledger.in_step and target == ledger.step and not failure):
            break  # a rolled-back or restarted step: the history does not say what was recomputed
        while ledger.step < target:
            if not ledger.in_step:
                ledger.begin_step(members)
            ledger.commit()
        if failure:
            if not ledger.in_step:
                ledger.begin_step(members)
            failed = False
            for member in ledger.members:
                if member not in entry["members"]:
                    failed |= ledger.member_failed(member)
            extra = ledger.reassign(entry["members"])
            if failed:
                reassigned.append(sum(int(positions.size) for positions in extra.values()))
        members = list(entry["members"])
    return reassigned


# torchft's survivors through one SIGKILL.


@dataclass(frozen=True)
class TorchftKill:
    """What torchft's survivors did after a peer was SIGKILLed (mode: ``ddp`` or ``allreduce``)."""

    mode: str
    observed: str
    recovery_s: float | None
    lost_samples: int | None
    uncommitted_steps: int | None


def torchft_kill_trial(mode: str, run_dir: Path, tick: Callable[[], None]) -> TorchftKill:
    """Three torchft replicas on the tiny model; SIGKILL replica 1 at step 30 and watch the other two for 30 steps."""
    steps, kill_step, watch_steps, victim = 200, 30, 30, 1
    survivors = [rank for rank in range(RECOVERY_WORKERS) if rank != victim]
    try:
        server = TorchftLighthouse(2, heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT * 1000), join_timeout_ms=1000)
    except RuntimeError as error:
        return TorchftKill(mode, f"torchft's lighthouse did not start: {error}", None, None, None)
    group = WorkerGroup(run_dir, f"torchft-kill-{mode}", RECOVERY_WORKERS)
    extra = ["--lighthouse", server.address, "--min-replicas", "2", "--mode", mode]
    extra += ["--collective-timeout", str(COLLECTIVE_TIMEOUT), "--step-seconds", str(RECOVERY_STEP_SECONDS)]
    killed_at: float | None = None
    try:
        for rank in range(RECOVERY_WORKERS):
            group.start("torchft", "tiny", steps, rank, extra)
        deadline = time.monotonic() + RUN_TIMEOUT_S / 2
        while time.monotonic() < deadline and killed_at is None:
            if len(group.records(victim)) >= kill_step:
                group.kill_one(victim)
                killed_at = time.time()
            elif any(process.poll() is not None for process in group.processes):
                break
            tick()
            time.sleep(POLL_S / 5)
        deadline = time.monotonic() + 60.0
        while killed_at is not None and time.monotonic() < deadline:
            running = [rank for rank in survivors if group.processes[rank].poll() is None]
            if not running or all(len(group.records(rank)) >= kill_step + watch_steps for rank in running):
                break
            tick()
            time.sleep(POLL_S)
        codes = {rank: group.processes[rank].poll() for rank in survivors}
    finally:
        group.kill()
        server.stop()
    if killed_at is None:
        return TorchftKill(mode, f"did not reach step {kill_step}: {group.log_tail(0)}", None, None, None)
    after = [r for rank in survivors for r in group.records(rank) if r.get("committed_at", 0) > killed_at]
    recovered = [r["committed_at"] for r in after if r["committed"] and r["participants"] < RECOVERY_WORKERS]
    uncommitted = [r for r in after if not r["committed"]]
    crashed = [rank for rank, code in codes.items() if code is not None]
    if crashed:
        observed = f"survivor(s) {crashed} crashed (exit {codes[crashed[0]]}): {_assertion_line(group, crashed[0])}"
    else:
        observed = f"both survivors went on; {len(uncommitted)} step(s) of theirs not committed after the kill"
    dead_share = MODELS["tiny"].global_batch // RECOVERY_WORKERS
    lost = None if crashed else dead_share + sum(r["share"] for r in uncommitted)
    recovery = min(recovered) - killed_at if recovered else None
    return TorchftKill(mode, observed, recovery, lost, len(uncommitted))


def _assertion_line(group: WorkerGroup, rank: int) -> str:
    """The most telling line of a crashed worker's log: the assertion or error, else its last line."""
    path = group.run_dir / f"{group.name}-worker-{rank}.log"
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
    telling = [line.strip() for line in lines if "Error" in line or "assert" in line]
    return (telling[-1] if telling else (lines[-1].strip() if lines else "no log"))[:200]


# Goals and tables.


def _find(rows: Sequence[OverheadRow], model: str, workers: int, variant: str) -> OverheadRow | None:
    return next((r for r in rows if (r.model, r.workers, r.variant) == (model, workers, variant) and r.measured), None)


def _pairs(
    rows: Sequence[OverheadRow], ours: str, theirs: str, models: Sequence[str] | None = None
) -> list[tuple[OverheadRow, OverheadRow]]:
    """``(ours, theirs)`` rows measured on the same model and worker count (of ``models`` when given)."""
    pairs = []
    for row in rows:
        other = _find(rows, row.model, row.workers, theirs)
        if row.variant == ours and row.measured and other is not None and (models is None or row.model in models):
            pairs.append((row, other))
    return pairs


def _ratio_goal(
    description: str, pairs: Sequence[tuple[OverheadRow, OverheadRow]], phase: str, met: Callable[[float], bool]
) -> Goal:
    """A goal on the ratio of medians of each pair: met when every ratio meets it."""
    if not pairs:
        return Goal(description, None, "not measured in this run")
    ratios = [(ours, ours.median(phase) / theirs.median(phase)) for ours, theirs in pairs]
    detail = "; ".join(f"{row.model}, {row.workers} workers: {ratio:.3f}x" for row, ratio in ratios)
    return Goal(description, all(met(ratio) for _, ratio in ratios), detail)


def overhead_goals(rows: Sequence[OverheadRow]) -> list[Goal]:
    """The per-step goals: against DDP (time, memory), torchft and plain HSDP, and the tiny model's added ms."""
    large = [name.upper() for name in LARGE_MODELS]
    goals = [
        _ratio_goal(
            f"{' and '.join(large)} parameters: stalwart at most {(LARGE_GOAL_RATIO - 1) * 100:.0f}% over DDP ({what})",
            _pairs(rows, "stalwart", BASELINE, LARGE_MODELS),
            phase,
            lambda ratio: ratio <= LARGE_GOAL_RATIO,
        )
        for phase, what in (("total", "wall time"), ("cpu", "CPU time"))
    ]
    goals.append(
        _ratio_goal(
            f"{' and '.join(large)} parameters: stalwart faster than torchft (wall time)",
            _pairs(rows, "stalwart", "torchft", LARGE_MODELS),
            "total",
            lambda ratio: ratio < 1.0,
        )
    )
    description = f"stalwart's peak memory per worker at most DDP's + one DDP bucket ({DDP_BUCKET_MIB:.0f} MiB)"
    memory = _pairs(rows, "stalwart", BASELINE)
    if memory:
        added = [(ours, statistics.median(ours.peak_mib) - statistics.median(ddp.peak_mib)) for ours, ddp in memory]
        detail = "; ".join(f"{row.model}, {row.workers} workers: {mib:+.1f} MiB" for row, mib in added)
        goals.append(Goal(description, all(mib <= DDP_BUCKET_MIB for _, mib in added), detail))
    else:
        goals.append(Goal(description, None, "not measured in this run"))
    description = f"stalwart over HSDP groups at most {(HSDP_GOAL_RATIO - 1) * 100:.0f}% over plain HSDP (wall time)"
    goals.append(
        _ratio_goal(description, _pairs(rows, "stalwart-hsdp", "hsdp"), "total", lambda ratio: ratio <= HSDP_GOAL_RATIO)
    )
    for phase, what in (("total", "wall time"), ("cpu", "CPU time")):
        description = f"tiny model: stalwart adds less than {TINY_GOAL_MS:.0f} ms per step to DDP's ({what})"
        tiny = _pairs(rows, "stalwart", BASELINE, ("tiny",))
        if tiny:
            added = [(ours, ours.median(phase) - ddp.median(phase)) for ours, ddp in tiny]
            detail = "; ".join(f"{row.workers} workers: {ms:+.2f} ms" for row, ms in added)
            goals.append(Goal(description, all(ms < TINY_GOAL_MS for _, ms in added), detail))
        else:
            goals.append(Goal(description, None, "the tiny model was not measured in this run"))
    return goals


def recovery_goals(result: RecoveryResult | None) -> list[Goal]:
    """SIGKILL and SIGSTOP recovery medians against their budgets."""
    goals = []
    for name, budget in (("KILL", SIGKILL_GOAL_S), ("STOP", SIGSTOP_GOAL_S)):
        description = f"SIG{name} recovery (signal to next committed step) under {budget:.1f} s"
        if result is None:
            goals.append(Goal(description, None, "recovery was skipped in this run"))
            continue
        times = [r.seconds for r in result.recoveries if r.signal == name and r.seconds is not None]
        if not times:
            goals.append(Goal(description, None, result.note or "no failure of this kind recovered"))
            continue
        median = statistics.median(times)
        goals.append(Goal(description, median < budget, f"median {median:.3f} s over {len(times)} failure(s)"))
    return goals


def print_overhead(console: Console, rows: Sequence[OverheadRow], settings: Settings, device: str) -> None:
    """Tables 1 and 1b: the variants of each model and worker count side by side, then where a step's time goes."""
    comparison, phases = [], []
    for row in rows:
        place = [row.model, str(row.workers), row.variant]
        if not row.measured:
            comparison.append([*place, *["-"] * 8, row.note or "not measured in this run"])
            continue
        totals = row.phases["total"]
        p90 = statistics.quantiles(totals, n=10)[-1] if len(totals) > 1 else row.median()
        peak = statistics.median(row.peak_mib)
        versus = ["-"] * 4
        ddp = _find(rows, row.model, row.workers, BASELINE)
        if ddp is not None:
            versus = [
                f"{row.median() / ddp.median():.3f}x",
                _ratio_range(row, ddp),
                f"{row.median('cpu') / ddp.median('cpu'):.3f}x",
                f"{peak - statistics.median(ddp.peak_mib):+.1f}",
            ]
        ratio, spread, cpu_ratio, memory_added = versus
        median, cpu = _ms(row.median()), _ms(row.median("cpu"))
        comparison.append([*place, median, _ms(p90), ratio, spread, cpu, cpu_ratio, f"{peak:.1f}", memory_added, ""])
        phases.append([*place, str(len(totals)), *(_ms_or_dash(row.phases[phase]) for phase in PHASES[2:])])
    spec_text = "; ".join(
        f"{s.name}: MLP {s.in_features}-{'-'.join([str(s.hidden)] * s.layers)}-{s.classes} "
        f"({_parameters(s):,} parameters), global batch {s.global_batch}, micro-batches of {s.max_microbatch}"
        for s in (MODELS[model] for model in settings.models)
    )
    memory = "torch.cuda.max_memory_allocated" if device == "cuda" else "growth of the peak RSS from before the model"
    print_table(
        console,
        f"1. Per-step time and memory without failures ({device}): rank 0's median after warm-up, against DDP",
        [
            Column("model", justify="left"),
            "workers",
            Column("variant", justify="left"),
            "median (ms)",
            "p90 (ms)",
            "vs DDP",
            "by round",
            "CPU (ms)",
            "CPU vs DDP",
            "peak memory (MiB)",
            "memory vs DDP (MiB)",
            Column("note", justify="left", max_width=60),
        ],
        comparison,
        caption=(
            f"{spec_text}. Rank 0's steps pooled over {settings.rounds} round(s), variants in an order that rotates "
            "each round. 'vs DDP' = ratio of the medians to DDP's; 'by round' = the lowest and highest ratio of one "
            "round's medians (this machine's noise). CPU = CPU time of rank 0's process (all its threads) per step: "
            "the work a step costs, whatever the scheduler does with the workers on this machine's cores. Peak "
            f"memory = the largest of the workers' ({memory}), median over rounds; 'memory vs DDP' = the difference "
            f"(goal: at most one DDP bucket, {DDP_BUCKET_MIB:.0f} MiB). hsdp = (replicate, shard) groups of 2 "
            "processes: 4 workers only. 'stalwart+prefetch' = ElasticLoader(prefetch=True); the default is off."
        ),
    )
    print_table(
        console,
        "1b. Where a step's time goes: median ms of each phase on rank 0",
        [
            Column("model", justify="left"),
            "workers",
            Column("variant", justify="left"),
            "steps",
            "compute (ms)",
            "before reduce (ms)",
            "all-reduce (ms)",
            "after reduce (ms)",
        ],
        phases,
        caption=(
            "compute = forward + backward (ddp, fsdp2, hsdp: with the reduction they overlap with it, so their "
            "other phases are not split out); before reduce = loading, flattening, quorum calls (torchft: waiting "
            "for the step's quorum); all-reduce = start to done (stalwart: its polled wait); after reduce = "
            "applying, optimizer, commit, next share and prefetch, ledger. Each phase's median is taken on its own."
        ),
    )


def print_recovery(console: Console, result: RecoveryResult, torchft_runs: Sequence[TorchftKill]) -> None:
    """Table 2: each signal's recovery times, the lighthouse's share of them, and torchft's SIGKILL when run."""
    lines = []
    for name, budget in (("KILL", SIGKILL_GOAL_S), ("STOP", SIGSTOP_GOAL_S)):
        chosen = [r for r in result.recoveries if r.signal == name]
        times = [r.seconds for r in chosen if r.seconds is not None]
        detects = [r.detect_s for r in chosen if r.detect_s is not None]
        quorums = [r.quorum_s for r in chosen if r.quorum_s is not None]
        lines.append(
            [
                "stalwart",
                f"SIG{name}",
                f"{len(times)}/{len(chosen)}",
                _s(statistics.median(times)) if times else "-",
                _s(min(times)) if times else "-",
                _s(max(times)) if times else "-",
                _s(statistics.median(detects)) if detects else "-",
                _s(statistics.median(quorums)) if quorums else "-",
                f"< {budget:.1f}",
                ", ".join(_s(t) for t in times) or result.note or "-",
            ]
        )
    for run in torchft_runs:
        recovered = run.recovery_s is not None
        lines.append(
            [
                f"torchft ({run.mode})",
                "SIGKILL",
                f"{int(recovered)}/1",
                _s(run.recovery_s) if recovered else "-",
                *["-"] * 4,
                "-",
                run.observed,
            ]
        )
    print_table(
        console,
        "2. Recovery: signal to the next step committed by a new quorum",
        [
            Column("system", justify="left"),
            Column("signal", justify="left"),
            "recovered",
            "median (s)",
            "min (s)",
            "max (s)",
            "to failure record (s)",
            "failure to quorum (s)",
            "goal (s)",
            Column("each failure (s) / what happened", justify="left", max_width=70),
        ],
        lines,
        caption=(
            f"Digits job, {RECOVERY_WORKERS} workers, {RECOVERY_STEP_SECONDS} s of simulated compute per step, "
            f"lighthouse heartbeat timeout {HEARTBEAT_TIMEOUT} s, collective timeout {COLLECTIVE_TIMEOUT} s; "
            "failures one after another in one job, each once the quorum is whole again. 'to failure record' and "
            "'failure to quorum' come from the lighthouse's /v1/status; the rest of a recovery is the new group's "
            "rendezvous, the survivors' extra share and the all-reduce. torchft: 3 replica groups of one, tiny "
            "model, same pacing, min 2 "
            "replicas, its lighthouse's heartbeat timeout 1 s."
        ),
    )


def print_work_lost(
    console: Console,
    result: RecoveryResult,
    overhead: Sequence[OverheadRow],
    torchft_runs: Sequence[TorchftKill],
) -> None:
    """Table 3: sample-gradients recomputed and samples never trained, per failure."""
    batch = result.global_batch
    medians = []
    for name in ("KILL", "STOP"):
        times = [r.seconds for r in result.recoveries if r.signal == name and r.seconds is not None]
        if times:
            medians.append(f"{statistics.median(times):.3f} ({name})")
    lines = [
        [
            "stalwart",
            _count(statistics.median(result.reassigned)) if result.reassigned else "-",
            "0",
            ", ".join(medians) or "-",
            f"measured: the dead member's share reassigned at each of {len(result.reassigned)} failure quorum(s) "
            f"(each: {', '.join(map(str, result.reassigned)) or '-'}); an upper bound on what is recomputed",
        ]
    ]
    for run in torchft_runs:
        lost = "-" if run.lost_samples is None else str(run.lost_samples)
        lines.append(
            [
                f"torchft ({run.mode})",
                "0",
                lost,
                _s(run.recovery_s) if run.recovery_s is not None else "-",
                f"measured, tiny model (global batch {MODELS['tiny'].global_batch}): the dead group's share of the "
                f"step in flight + the shares of {run.uncommitted_steps} uncommitted survivor step(s)"
                if run.lost_samples is not None
                else f"survivors crashed: {run.observed[:80]}",
            ]
        )
    lines.append(
        [
            "torchft (model)",
            "0",
            f">= {batch // RECOVERY_WORKERS}",
            "-",
            "the dead group's share of the step in flight is dropped, not recomputed; the global batch shrinks "
            "until the group is back",
        ]
    )
    ddp = next((row for row in overhead if row.variant == BASELINE and row.measured), None)
    restart_s = statistics.median(ddp.first_step_s) if ddp else None
    restart = f"launch to first step, {ddp.workers} DDP workers, {ddp.model} model" if ddp else ""
    for interval in CHECKPOINT_INTERVALS:
        recomputed = interval / 2 * batch
        time_lost = None if restart_s is None or result.step_s is None else restart_s + interval / 2 * result.step_s
        lines.append(
            [
                f"checkpoint-restart, K={interval}",
                _count(recomputed),
                "0",
                _s(time_lost) if time_lost is not None else "-",
                f"model: K/2 = {interval / 2:g} steps x global batch {batch} recomputed; restart "
                + (f"{restart_s:.1f} s (measured: {restart})" if restart_s else "not measured")
                + (f" + K/2 x {result.step_s * 1e3:.0f} ms steps" if result.step_s else ""),
            ]
        )
    print_table(
        console,
        "3. Work lost per failure",
        [
            Column("approach", justify="left"),
            "sample-gradients recomputed",
            "samples lost (never trained)",
            "time lost (s)",
            Column("basis", justify="left", max_width=90),
        ],
        lines,
        caption=(
            f"Digits job, global batch {batch}, {RECOVERY_WORKERS} workers "
            f"(one worker's share: {batch // RECOVERY_WORKERS} samples)."
        ),
    )


def _ratio_range(row: OverheadRow, baseline: OverheadRow) -> str:
    """Lowest and highest ratio of ``row``'s median to the baseline's over the rounds both ran."""
    return span(round_ratios(row.round_medians, baseline.round_medians), lambda ratio: f"{ratio:.2f}")


def _parameters(spec: ModelSpec) -> int:
    return sum(param.numel() for param in build_model(spec).parameters())


def _ms(value: float) -> str:
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def _ms_or_dash(values: Sequence[float]) -> str:
    return _ms(statistics.median(values)) if values else "-"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _count(value: float) -> str:
    return f"{value:g}"


def run_all(
    settings: Settings, device: str, run_dir: Path, console: Console
) -> tuple[list[OverheadRow], RecoveryResult | None, list[TorchftKill]]:
    """The three measurements and torchft's SIGKILL runs (only the first without recovery), under a progress display."""
    recovery_units = 2 * settings.failures_per_signal if settings.recovery else 0
    trials = ("ddp", "allreduce") if settings.recovery and settings.torchft_kill_trial and not torchft_missing() else ()
    with progress_display(console) as progress:
        task = progress.add_task("starting", total=overhead_runs(settings) + recovery_units + len(trials))
        overhead = measure_overhead(settings, device, run_dir, progress, task)
        recovery = measure_recovery(settings, run_dir, progress, task) if settings.recovery else None
        torchft_runs = []
        for mode in trials:
            progress.update(task, description=f"torchft ({mode}): SIGKILL of a peer")
            torchft_runs.append(torchft_kill_trial(mode, run_dir, progress.refresh))
            progress.advance(task)
    return overhead, recovery, torchft_runs


def _choices(text: str, choices: Sequence[str]) -> tuple[str, ...]:
    values = tuple(value.strip() for value in text.split(",") if value.strip())
    unknown = [value for value in values if value not in choices]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}, got {text!r}")
    return values


def _worker_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(value) for value in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of worker counts >= 2, got {text!r}")
    return counts


def parse_settings(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    """The run's settings: full or ``--quick``, with the command line's models, worker counts and rounds."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 workers, one failure of each kind")
    parser.add_argument("--models", type=lambda text: _choices(text, tuple(MODELS)), help="e.g. 1m,10m,50m")
    parser.add_argument("--workers", type=_worker_counts, help="worker counts of table 1, e.g. 2,4")
    add_rounds(parser, "rounds of table 1")
    parser.add_argument(
        "--variants", type=lambda text: _choices(text, tuple(VARIANTS)), help=f"rows of table 1, of {list(VARIANTS)}"
    )
    parser.add_argument("--skip-recovery", action="store_true", help="table 1 only (no recovery, no work lost)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per worker")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep worker logs and step records here")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = dataclasses.replace(
        settings,
        models=args.models or settings.models,
        workers=args.workers or settings.workers,
        rounds=args.rounds or settings.rounds,
        variants=args.variants or settings.variants,
        recovery=not args.skip_recovery,
    )
    if args.device == "cuda" and torch.cuda.device_count() < max(settings.workers):
        parser.error(f"--device cuda needs a GPU per worker: {torch.cuda.device_count()} for {settings.workers}")
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its tables and the goals; return the exit status (0 unless it crashed)."""
    settings, args = parse_settings(argv)
    console = make_console()
    torchft_note = "torchft not installed" if torchft_missing() else f"torchft {_torchft_version()}"
    machine_line(console, args.quick, f"torch {torch.__version__}", torchft_note, forked=settings.forked_workers)
    with run_directory(args.run_dir, "stalwart-bench-runtime-") as run_dir:
        overhead, recovery, torchft_runs = run_all(settings, args.device, run_dir, console)
    if args.run_dir is not None:
        console.print(f"worker logs and step records: {args.run_dir}", highlight=False)
    print_overhead(console, overhead, settings, args.device)
    if recovery is not None:
        print_recovery(console, recovery, torchft_runs)
        print_work_lost(console, recovery, overhead, torchft_runs)
    print_goals(console, [*overhead_goals(overhead), *recovery_goals(recovery)])
    return 0


def _torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


if __name__ == "__main__":
    raise SystemExit(main())
