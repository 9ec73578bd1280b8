"""The TorchX component: run under TorchX's local scheduler through a SIGKILL, and rendered for Kubernetes.

Local: TorchX starts the lighthouse role and two replica-group roles (each a
torchrun launch of two workers). A worker of group-1 is SIGKILLed; torchrun,
inside the role TorchX started, restarts the group (the local scheduler has
no role retries of its own); the group asks to join again and is healed from
group-0. The run must keep every step's global batch, train each sample
exactly once and end with the failure-free parameters on every process.

Kubernetes: ``runner.dryrun(app, "kubernetes")`` renders a Volcano Job whose
tasks are the roles, with per-task retries that replace only the failed pod,
the workers pointed at the lighthouse's host name from Volcano's Service, and
the token in the environment, never on a command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchx", reason="torchx is not installed (the dev set-up's [torchx] extra installs it)")

import torch
from torchx.runner import Runner, get_runner
from torchx.specs import AppState
from torchx.specs.builders import materialize_appdef

from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import read_status
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.loopback import free_port
from stalwart.testing.procfs import stat_fields
from stalwart.testing.waiting import wait_until
from stalwart.torchx import STATE_MOUNT, TOKEN_VARIABLE, job
from tests.kubernetes_objects import typed

STEPS = 12
HOLD_AT = 10
"""Group-0 alone from the SIGKILL (at step 3 or later) to the hold; both again for the last 2 steps, healed."""
PLAN = EpochPlan(1797, 48, seed=0)
PARAM_TOLERANCE = 1e-4
TIMEOUT = 240.0
WORKER_ARGS = ("--max-microbatch", "8", "--collective-timeout", "1.0", "--step-seconds", "0.25")


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    path = run_dir / f"events-{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def starts(run_dir: Path, name: str) -> list[int]:
    return [event["pid"] for event in events(run_dir, name) if event["event"] == "started"]


def process_info(pid: int) -> tuple[int, dict[str, str]]:
    """(parent pid, environment) of a live process."""
    parent = int(stat_fields(pid)[1])
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (entry.decode(errors="replace").partition("=") for entry in environ if b"=" in entry)
    return parent, {key: value for key, _, value in pairs}


def kill_leftovers(run_dir: Path) -> None:
    """SIGKILL worker processes of this run that are still alive (their pids are in its event logs)."""
    for path in run_dir.glob("events-*.jsonl"):
        for pid in starts(run_dir, path.stem.removeprefix("events-")):
            with contextlib.suppress(OSError):
                if str(run_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = secrets.token_urlsafe(16)
    monkeypatch.setenv(TOKEN_VARIABLE, value)
    return value


@pytest.fixture
def runner() -> Iterator[Runner]:
    with get_runner() as torchx_runner:
        yield torchx_runner


@pytest.mark.slow
def test_a_killed_group_is_restarted_in_its_role_rejoins_and_is_healed(
    tmp_path: Path, token: str, runner: Runner
) -> None:
    run_dir = tmp_path / "run"
    hold = tmp_path / "hold"
    hold.write_text(str(HOLD_AT))
    port = free_port()
    app = job(
        *WORKER_ARGS, "--hold-file", str(hold),
        groups=2, nproc_per_group=2, max_steps=STEPS, dataset_size=PLAN.dataset_size,
        global_batch=PLAN.global_batch_size, join_timeout=TIMEOUT, host="127.0.0.1", port=port,
        state=str(tmp_path / "lighthouse.sqlite"), run_dir=str(run_dir), python=sys.executable,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def status() -> dict[str, Any] | None:
        try:
            return read_status(url, token)
        except OSError:
            return None

    def both_training() -> bool:
        current = status()
        quorum = current and current["quorum"]
        return bool(quorum and set(quorum["members"]) == {"group-0", "group-1"} and current["ledger"]["step"] >= 3)

    handle = runner.run(app, "local_cwd", cfg={"log_dir": str(tmp_path / "torchx")})
    try:
        wait_until(both_training, TIMEOUT, "both groups to train in one quorum")
        victim = starts(run_dir, "group-1.1")[-1]
        agent, _ = process_info(victim)
        os.kill(victim, signal.SIGKILL)
        restarted = wait_until(
            lambda: next((pid for pid in starts(run_dir, "group-1.1") if pid != victim), None),
            TIMEOUT,
            "torchrun to restart group-1's workers",
        )
        parent, environ = process_info(restarted)  # alive: the job is held until the group has asked to join
        assert parent == agent, "the role's torchrun agent, still the same process, restarts the group"
        assert environ.get("TORCHELASTIC_RESTART_COUNT") == "1"
        wait_until(
            lambda: any(
                m["member"] == "group-1" and m["asking"] == "join" for m in (status() or {}).get("members", [])
            ),
            TIMEOUT,
            "the restarted group-1 to ask to join",
        )
        hold.unlink()
        finals = [f"final-group-{group}.{rank}.pt" for group in (0, 1) for rank in (0, 1)]
        wait_until(lambda: all((run_dir / name).exists() for name in finals), TIMEOUT, "every worker to finish")
        wait_until(
            lambda: all(
                any(e["event"] == "finished" for e in events(run_dir, n.split("-", 1)[1][:-3])) for n in finals
            ),
            TIMEOUT,
            "every worker to record its end",
        )
        final_status = status()
        assert runner.status(handle).state == AppState.RUNNING  # the lighthouse serves until the app is stopped
    finally:
        runner.cancel(handle)
        kill_leftovers(run_dir)
    assert final_status is not None
    assert any(failure["member"] == "group-1" for failure in final_status["failures"])
    for rank in (0, 1):
        life = [e["event"] for e in events(run_dir, f"group-1.{rank}")]
        second = [i for i, event in enumerate(life) if event == "started"][1]
        assert "healed" in life[second:], life
    steps = committed_steps(run_dir)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    world_sizes = [record["world_size"] for record in steps]
    assert world_sizes[0] == 2 and 1 in world_sizes and world_sizes[-1] == 2
    reference, _ = reference_run(PLAN, STEPS)
    for name in finals:
        parameters = torch.load(run_dir / name, weights_only=True)
        worst = max(float((parameters[key] - value).abs().max()) for key, value in reference.items())
        assert worst < PARAM_TOLERANCE, name


def rendered(runner: Runner, **options: Any) -> dict[str, Any]:
    app = job("--step-seconds", "0", **options)
    with pytest.warns(UserWarning, match="restarts"):  # TorchX warns about Volcano's retries on every retried role
        info = runner.dryrun(app, "kubernetes", cfg={"queue": "default", "namespace": "training"})
    resource: dict[str, Any] = json.loads(json.dumps(info.request.resource, default=_to_dict))
    return resource


def _to_dict(value: Any) -> Any:
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(value)


def test_the_kubernetes_rendering_has_the_roles_retries_service_and_secret(token: str, runner: Runner) -> None:
    resource = rendered(runner, groups=3, nproc_per_group=4, max_retries=5, state_claim="stalwart-state", insecure=True)
    assert (resource["apiVersion"], resource["kind"]) == ("batch.volcano.sh/v1alpha1", "Job")
    spec = resource["spec"]
    assert spec["queue"] == "default"
    assert "svc" in spec["plugins"]  # Volcano's per-job headless Service: each task's pod gets a DNS name
    tasks = {task["name"]: task for task in spec["tasks"]}
    assert list(tasks) == ["lighthouse-0", "group-0-0", "group-1-0", "group-2-0"]
    for task in tasks.values():
        assert task["replicas"] == 1
        assert task["maxRetry"] == 5
        assert task["policies"] == []  # RetryPolicy.REPLICA: only the failed pod is replaced, never the whole job
        template = typed(task["template"], "V1PodTemplateSpec")
        (container,) = template.spec.containers
        environment = {variable.name: variable.value for variable in container.env}
        assert environment[TOKEN_VARIABLE] == token
        assert token not in " ".join(container.command)
    lighthouse = typed(tasks["lighthouse-0"]["template"], "V1PodTemplateSpec").spec
    command = lighthouse.containers[0].command
    assert command[1:3] == ["-m", "stalwart.cli.lighthouse"]
    assert command[command.index("--host") + 1] == "0.0.0.0" and "--insecure" in command
    assert command[command.index("--state") + 1] == f"{STATE_MOUNT}/lighthouse.sqlite"
    assert command[command.index("--start-replicas") + 1] == "3"
    assert command[command.index("--join-timeout") + 1] == "30.0"
    ports = {port.name: port.container_port for port in lighthouse.containers[0].ports}
    assert ports == {"http": 29510}, "the quorum store is served on the HTTP port"
    claims = [
        volume.persistent_volume_claim.claim_name for volume in lighthouse.volumes if volume.persistent_volume_claim
    ]
    assert claims == ["stalwart-state"]
    for group in range(3):
        worker = typed(tasks[f"group-{group}-0"]["template"], "V1PodTemplateSpec").spec.containers[0]
        assert worker.command[:2] == ["bash", "-c"]
        script = worker.command[2]
        assert "--standalone --nproc-per-node 4 --max-restarts 3 --shutdown-timeout 25 -m" in script
        assert f"--member group-{group} " in script
        assert '--lighthouse "http://${VC_LIGHTHOUSE_0_HOSTS}:29510"' in script


def test_the_worker_command_expands_the_lighthouse_host_in_bash(token: str, runner: Runner) -> None:
    # the rendered script, with echo in place of the interpreter
    resource = rendered(runner, python="echo", insecure=True)
    script = resource["spec"]["tasks"][1]["template"]["spec"]["containers"][0]["command"][2]
    environ = {**os.environ, "VC_LIGHTHOUSE_0_HOSTS": "stalwart-x-lighthouse-0.stalwart-x"}
    shown = subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60).stdout
    assert "--lighthouse http://stalwart-x-lighthouse-0.stalwart-x:29510 " in shown
    assert "--member group-0 --run-dir run" in shown


def test_torchx_run_parses_the_component_arguments(token: str) -> None:
    """``torchx run ... src/stalwart/torchx.py:job --groups 3 ... -- WORKER_ARGS`` builds the same app."""
    argv = ["--groups", "3", "--nproc_per_group", "2", "--host", "127.0.0.1", "--", "--step-seconds", "0"]
    app = materialize_appdef(job, argv)
    assert [role.name for role in app.roles] == ["lighthouse", "group-0", "group-1", "group-2"]
    script = app.roles[3].args[1]
    assert "--nproc-per-node 2 " in script and "--step-seconds 0 --lighthouse http://127.0.0.1:29510 " in script


def test_an_external_lighthouse_leaves_only_the_groups(token: str) -> None:
    app = job(groups=2, lighthouse_url="http://stalwart-lighthouse:29510")
    assert [role.name for role in app.roles] == ["group-0", "group-1"]
    assert all("--lighthouse http://stalwart-lighthouse:29510 " in role.args[1] for role in app.roles)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"groups": 0}, "groups must be in [1, inf], got 0"),
        ({"groups": 2, "min_replicas": 3}, "min_replicas must be in [1, 2], got 3"),
        ({"lighthouse_url": "stalwart-lighthouse:29510"}, "lighthouse_url must be an http:// or https:// URL"),
        ({"run_dir": " "}, "run_dir must not be empty"),
        ({"join_timeout": 0}, "join_timeout must be a number of seconds in (0, inf), got 0"),
        ({"shutdown_timeout": 0}, "shutdown_timeout must be in [1, inf], got 0"),
        ({"token_env": "STALWART_NO_SUCH_TOKEN"}, "$STALWART_NO_SUCH_TOKEN is unset or empty"),
        ({"host": "10.0.0.7"}, "would bind 10.0.0.7, which other machines reach, over plain HTTP"),
        ({}, "say insecure=True (--insecure)"),
    ],
)
def test_bad_arguments_are_refused_by_name(token: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        job(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"max_retries": "3"}, "max_retries must be an int, got '3'"), ({"host": None}, "host must be a str, got None")],
)
def test_a_wrong_type_is_refused_by_name(token: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        job(**options)


def test_the_app_stops_when_cancelled(tmp_path: Path, token: str, runner: Runner) -> None:
    port = free_port()
    app = job(
        groups=1, max_steps=1, host="127.0.0.1", port=port,
        state=str(tmp_path / "lighthouse.sqlite"), run_dir=str(tmp_path / "run"), python=sys.executable,
    )  # fmt: skip
    app.roles = app.roles[:1]  # the lighthouse alone
    handle = runner.run(app, "local_cwd", cfg={"log_dir": str(tmp_path / "torchx")})
    try:
        status = wait_until(lambda: _answer(f"http://127.0.0.1:{port}", token), TIMEOUT, "the lighthouse to answer")
        assert status["plan"]["dataset_size"] == 1797
    finally:
        runner.cancel(handle)
    deadline = time.monotonic() + TIMEOUT
    while runner.status(handle).state == AppState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runner.status(handle).state in (AppState.CANCELLED, AppState.FAILED, AppState.SUCCEEDED)
    assert _answer(f"http://127.0.0.1:{port}", token) is None


def _answer(url: str, token: str) -> dict[str, Any] | None:
    try:
        return read_status(url, token)
    except OSError:
        return None
