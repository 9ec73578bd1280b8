"""A TorchX component: a stalwart job as one lighthouse role and one role per replica group.

``torchx run -s local_cwd src/stalwart/torchx.py:job --groups 2 ...`` (or
``-s kubernetes``) launches it; :func:`job` builds the same ``AppDef`` in
Python. The scheduler replaces processes; stalwart keeps the job's data and
state consistent across those replacements:

- the first role, ``lighthouse``, runs ``stalwart lighthouse`` with its state
  in an SQLite file (on a persistent volume on Kubernetes: ``state_claim``),
  so a restarted lighthouse resumes the ledger;
- roles ``group-0`` ... ``group-{groups-1}`` each run one ``torchrun`` launch
  of ``nproc_per_group`` worker processes, one lighthouse member. torchrun
  restarts a group whose process died (``max_restarts``, the only restarts
  TorchX's local scheduler has); a scheduler with retries (Kubernetes through
  Volcano) also replaces a failed role's pod, only that one
  (``RetryPolicy.REPLICA``, ``max_retries``). Either way the group asks the
  lighthouse to join again and is healed from a live group. A preempted
  role's SIGTERM reaches torchrun (``exec``: no shell in between), which
  forwards it to the group's processes and gives them ``shutdown_timeout``
  seconds: the group finishes its step and leaves the quorum announced
  (:meth:`~stalwart.runtime.manager.Manager.request_departure`). TorchX's
  Kubernetes pods keep the default 30 s grace period, so ``shutdown_timeout``
  stays below it.

Workers reach the lighthouse at ``host`` when it is given (``127.0.0.1``: a
job on one machine); otherwise at the lighthouse role's host name, which
TorchX hands each role in the variable named by ``macros.rank0_env`` (on
Kubernetes Volcano's per-job Service gives it a DNS name), and they
advertise their pod's address (``hostname -i``) for the collectives. With
``lighthouse_url`` the app has no lighthouse role and the groups join that
one (e.g. the Service of ``deploy/kubernetes/lighthouse.yaml``).

The shared token is read here from the environment variable ``token_env``
and handed to every role as ``STALWART_LIGHTHOUSE_TOKEN``, never on a
command line. A lighthouse role that other pods reach (``host`` not loopback)
serves plain HTTP only when told ``insecure=True`` (a pod network you trust):
the lighthouse refuses such a bind without TLS; for TLS, run the lighthouse of
``deploy/kubernetes/lighthouse.yaml`` and join it with ``lighthouse_url``.
This module sits at the launch layer; nothing imports it.
Its annotations stay real types (no ``from __future__ import annotations``):
``torchx run`` reads them to parse the component's arguments.
"""

import math
import os
import shlex
from pathlib import PurePosixPath

import torchx.specs as specs

from stalwart._validate import check_int
from stalwart.coord.tls import is_loopback

TOKEN_VARIABLE = "STALWART_LIGHTHOUSE_TOKEN"
"""Where the lighthouse and the workers read the shared token (see ``stalwart lighthouse --token``)."""
LIGHTHOUSE_ROLE = "lighthouse"
STATE_MOUNT = "/var/lib/stalwart"
"""Where ``state_claim`` is mounted in the lighthouse role."""


def job(
    *worker_args: str,
    groups: int = 2,
    nproc_per_group: int = 1,
    max_steps: int = 1000,
    dataset_size: int = 1797,
    global_batch: int = 64,
    min_replicas: int = 1,
    start_replicas: int = 0,
    join_timeout: float = 30.0,
    host: str = "",
    port: int = 29510,
    lighthouse_url: str = "",
    state: str = "lighthouse.sqlite",
    state_claim: str = "",
    run_dir: str = "run",
    module: str = "stalwart.launch.worker",
    image: str = "stalwart:latest",
    python: str = "python",
    max_retries: int = 3,
    max_restarts: int = 3,
    shutdown_timeout: int = 25,
    cpu: int = 2,
    memMB: int = 4096,
    token_env: str = TOKEN_VARIABLE,
    insecure: bool = False,
) -> specs.AppDef:
    """A stalwart job: a lighthouse role and ``groups`` replica-group roles, each a torchrun launch with retries.

    Args:
        worker_args: more options for the worker module (e.g. ``--hold-file PATH``)
        groups: replica groups, each one role and one lighthouse member (``group-I``)
        nproc_per_group: worker processes torchrun starts per group
        max_steps: steps the job commits before it ends
        dataset_size: samples in the dataset (the lighthouse's plan)
        global_batch: samples per step, whatever the number of live groups
        min_replicas: fewest groups a quorum may have
        start_replicas: groups the first quorum waits for (0: all of them)
        join_timeout: seconds a quorum waits for groups that have not asked (the first one: for start_replicas)
        host: the address every role binds and is reached on (127.0.0.1 on one machine); empty: the pods' own
        port: the lighthouse's HTTP port (the quorum store is served there too)
        lighthouse_url: join this lighthouse instead of running one (e.g. http://stalwart-lighthouse:29510)
        state: the lighthouse's SQLite state file (under the mount of state_claim when given)
        state_claim: a PersistentVolumeClaim to mount for the state (Kubernetes)
        run_dir: where the workers write their step records, events and results
        module: the worker entry point (python -m MODULE), with the options of stalwart.launch.worker
        image: the container image (ignored by the local schedulers)
        python: the Python interpreter in the image
        max_retries: times the scheduler replaces a failed role (its replica only)
        max_restarts: times torchrun restarts a group whose process failed, inside the role
        shutdown_timeout: seconds torchrun gives a SIGTERMed group to leave at its step boundary (< the pod's grace)
        cpu: CPUs per role
        memMB: memory per role in MB
        token_env: the environment variable (here) holding the lighthouse's shared token
        insecure: let a lighthouse role that other pods reach serve plain HTTP (a network you trust)
    """
    check_int("groups", groups, minimum=1)
    check_int("nproc_per_group", nproc_per_group, minimum=1)
    check_int("max_steps", max_steps, minimum=1)
    check_int("dataset_size", dataset_size, minimum=1)
    check_int("global_batch", global_batch, minimum=1)
    check_int("min_replicas", min_replicas, minimum=1, maximum=groups)
    check_int("start_replicas", start_replicas, minimum=0, maximum=groups)
    check_int("port", port, minimum=1, maximum=65535)
    check_int("max_retries", max_retries, minimum=0)
    check_int("max_restarts", max_restarts, minimum=0)
    check_int("shutdown_timeout", shutdown_timeout, minimum=1)
    check_int("cpu", cpu, minimum=1)
    check_int("memMB", memMB, minimum=1)
    if not isinstance(join_timeout, (int, float)) or isinstance(join_timeout, bool) or not 0 < join_timeout < math.inf:
        raise ValueError(f"join_timeout must be a number of seconds in (0, inf), got {join_timeout!r}")
    texts = {"host": host, "lighthouse_url": lighthouse_url, "state_claim": state_claim, "image": image}
    texts.update({"state": state, "run_dir": run_dir, "module": module, "python": python, "token_env": token_env})
    for name, value in {**texts, **{f"worker_args[{i}]": arg for i, arg in enumerate(worker_args)}}.items():
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
    if lighthouse_url and not lighthouse_url.startswith(("http://", "https://")):
        raise ValueError(f"lighthouse_url must be an http:// or https:// URL, got {lighthouse_url!r}")
    for name, value in {"state": state, "run_dir": run_dir, "module": module, "python": python}.items():
        if not value.strip():
            raise ValueError(f"{name} must not be empty, got {value!r}")
    token = os.environ.get(token_env, "")
    if not token.strip():
        raise ValueError(
            f"token_env names the variable holding the lighthouse's token, but ${token_env} is unset or empty; "
            'set it, e.g. to the output of: python -c "import secrets; print(secrets.token_urlsafe(32))"'
        )
    if not isinstance(insecure, bool):
        raise TypeError(f"insecure must be a bool, got {insecure!r} ({type(insecure).__name__})")
    if not lighthouse_url and not is_loopback(host) and not insecure:
        raise ValueError(
            f"the lighthouse role would bind {host or '0.0.0.0 (its pod addresses)'}, which other machines "
            "reach, over plain HTTP, which the lighthouse refuses: say insecure=True (--insecure) on a pod network "
            "you trust, or run a lighthouse with TLS (deploy/kubernetes/lighthouse.yaml) and give lighthouse_url"
        )
    env = {TOKEN_VARIABLE: token}
    resource = specs.Resource(cpu=cpu, gpu=0, memMB=memMB)
    replicas = ["--min-replicas", str(min_replicas), "--start-replicas", str(start_replicas or groups)]
    replicas += ["--join-timeout", str(join_timeout)]
    roles = []
    if not lighthouse_url:
        roles.append(
            _lighthouse_role(
                image=image,
                python=python,
                host=host,
                port=port,
                state=state,
                state_claim=state_claim,
                plan=["--dataset-size", str(dataset_size), "--global-batch", str(global_batch)],
                replicas=replicas,
                env=env,
                resource=resource,
                max_retries=max_retries,
                insecure=insecure,
            )
        )
    url = lighthouse_url or _lighthouse_url(host, port)
    advertise = shlex.quote(host) if host else '"$(hostname -i)"'
    for index in range(groups):
        name = f"group-{index}"
        torchrun = [
            python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc_per_group),
            "--max-restarts", str(max_restarts), "--shutdown-timeout", str(shutdown_timeout),
            "-m", module, "--member", name, "--run-dir", run_dir, "--max-steps", str(max_steps), *worker_args,
        ]  # fmt: skip
        command = f"exec {shlex.join(torchrun)} --lighthouse {url} --host {advertise}"
        roles.append(
            specs.Role(
                name=name,
                image=image,
                entrypoint="bash",
                args=["-c", command],
                env=dict(env),
                resource=resource,
                max_retries=max_retries,
                retry_policy=specs.RetryPolicy.REPLICA,
            )
        )
    return specs.AppDef(name="stalwart", roles=roles)


def _lighthouse_url(host: str, port: int) -> str:
    """The lighthouse's URL as a shell word: ``host`` when given, else the first role's host from TorchX's macro."""
    if host:
        return shlex.quote(f"http://{host}:{port}")
    # "$${" escapes the macro syntax: bash sees "${VARIABLE}", the variable TorchX names in rank0_env.
    return f'"http://$${{{specs.macros.rank0_env}}}:{port}"'


def _lighthouse_role(
    *,
    image: str,
    python: str,
    host: str,
    port: int,
    state: str,
    state_claim: str,
    plan: list[str],
    replicas: list[str],
    env: dict[str, str],
    resource: specs.Resource,
    max_retries: int,
    insecure: bool,
) -> specs.Role:
    """``stalwart lighthouse`` bound to ``host`` (all interfaces of its pod when empty), its state on the claim."""
    mounts: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount] = []
    state_path = state
    if state_claim:
        mounts.append(specs.VolumeMount(src=state_claim, dst_path=STATE_MOUNT))
        state_path = str(PurePosixPath(STATE_MOUNT) / state)
    options = ["--host", host or "0.0.0.0", "--port", str(port), *(["--insecure"] if insecure else [])]
    return specs.Role(
        name=LIGHTHOUSE_ROLE,
        image=image,
        entrypoint=python,
        args=["-m", "stalwart.cli.lighthouse", *options, "--state", state_path, *replicas, *plan],
        env=dict(env),
        port_map={"http": port},
        resource=resource,
        mounts=mounts,
        max_retries=max_retries,
        retry_policy=specs.RetryPolicy.REPLICA,
    )
