"""deploy/kubernetes validated offline: every document is a well-formed typed Kubernetes object, and they agree.

Each YAML document is deserialized into the kubernetes client's model for its
kind (a missing required field raises) and serialized back: a field the
model does not know would vanish on the way, so the round trip must give the
document unchanged. Then the pieces must fit: the workers reach the
lighthouse by its Service's name and ports, the Service selects the
lighthouse's pod, the state lies on the claim, the token comes from one
Secret, the certificate from another (HTTPS, the key its owner's alone, the
workers verifying it), and failed groups are replaced one index at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="kubernetes is not installed (the dev set-up's [torchx] extra installs it)")
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (the dev set-up's [torchx] extra installs it)")

from tests.kubernetes_objects import typed  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MODELS = {
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("v1", "Service"): "V1Service",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("batch/v1", "Job"): "V1Job",
}
TOKEN_SECRET = {"name": "stalwart-lighthouse-token", "key": "token"}
TLS_SECRET = "stalwart-lighthouse-tls"


def documents(name: str) -> dict[str, Any]:
    """The typed objects of ``deploy/kubernetes/NAME``, keyed by kind."""
    objects = {}
    for document in yaml.safe_load_all((DEPLOY / name).read_text()):
        model = MODELS.get((document["apiVersion"], document["kind"]))
        assert model is not None, f"{name}: no model for {document['apiVersion']} {document['kind']}"
        objects[document["kind"]] = typed(document, model)
    return objects


def option(args: list[str], flag: str) -> str:
    """The value of ``--flag=VALUE`` in a container's arguments."""
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{flag}=")]
    assert len(values) == 1, (flag, args)
    return values[0]


def secret_of(container: Any, variable: str) -> dict[str, str]:
    (entry,) = [env for env in container.env if env.name == variable]
    assert entry.value is None, "the token is never written into a manifest"
    reference = entry.value_from.secret_key_ref
    return {"name": reference.name, "key": reference.key}


def test_a_field_the_model_does_not_know_is_caught() -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"prots": [{"port": 1}]}}
    with pytest.raises(AssertionError, match="V1Service does not know"):
        typed(service, "V1Service")


def test_a_missing_required_field_is_caught() -> None:
    with pytest.raises(ValueError, match="container_port"):
        typed({"name": "x", "ports": [{"name": "http"}]}, "V1Container")


def test_the_lighthouse_runs_alone_on_its_state_volume_behind_a_service() -> None:
    objects = documents("lighthouse.yaml")
    assert set(objects) == {"PersistentVolumeClaim", "Deployment", "Service"}
    deployment, service, claim = objects["Deployment"], objects["Service"], objects["PersistentVolumeClaim"]
    assert deployment.spec.replicas == 1
    assert deployment.spec.strategy.type == "Recreate"
    pod = deployment.spec.template
    assert service.spec.selector == deployment.spec.selector.match_labels == pod.metadata.labels
    (container,) = pod.spec.containers
    assert container.command == ["stalwart", "lighthouse"]
    ports = {port.name: port.container_port for port in container.ports}
    assert ports == {"http": int(option(container.args, "--port"))}, "one port: the quorum store is served there"
    assert {port.name: (port.port, port.target_port) for port in service.spec.ports} == {
        name: (number, name) for name, number in ports.items()
    }
    assert option(container.args, "--host") == "0.0.0.0", "other pods reach it: TLS and a token are required"
    for probe in (container.readiness_probe, container.liveness_probe):
        assert (probe.http_get.path, probe.http_get.port, probe.http_get.scheme) == ("/healthz", "http", "HTTPS")
    mounts = {mount.name: mount.mount_path for mount in container.volume_mounts}
    volumes = {volume.name: volume for volume in pod.spec.volumes}
    assert set(mounts) == set(volumes) == {"state", "tls"}
    assert option(container.args, "--state").startswith(mounts["state"] + "/")
    assert volumes["state"].persistent_volume_claim.claim_name == claim.metadata.name
    assert claim.spec.access_modes == ["ReadWriteOnce"]
    tls = volumes["tls"].secret
    assert tls.secret_name == TLS_SECRET and tls.default_mode & 0o077 == 0, "a key others may read is refused"
    assert option(container.args, "--tls-cert") == mounts["tls"] + "/tls.crt"
    assert option(container.args, "--tls-key") == mounts["tls"] + "/tls.key"
    assert secret_of(container, "STALWART_LIGHTHOUSE_TOKEN") == TOKEN_SECRET


def test_the_workers_are_indexed_groups_that_reach_the_service_and_are_replaced_per_index() -> None:
    lighthouse = documents("lighthouse.yaml")
    job = documents("workers.yaml")["Job"]
    service = lighthouse["Service"]
    lighthouse_args = lighthouse["Deployment"].spec.template.spec.containers[0].args
    spec = job.spec
    assert spec.completion_mode == "Indexed"
    assert spec.completions == spec.parallelism == int(option(lighthouse_args, "--start-replicas"))
    assert spec.backoff_limit_per_index >= 1
    assert spec.template.spec.restart_policy == "Never"
    (rule,) = spec.pod_failure_policy.rules
    assert rule.action == "Ignore" and [c.type for c in rule.on_pod_conditions] == ["DisruptionTarget"]
    (container,) = spec.template.spec.containers
    assert container.command == ["torchrun"]
    args = container.args
    assert "--standalone" in args and args[args.index("-m") + 1] == "stalwart.launch.worker"
    http = next(port.port for port in service.spec.ports if port.name == "http")
    assert option(args, "--lighthouse") == f"https://{service.metadata.name}:{http}"
    assert option(args, "--member") == "group-$(GROUP_INDEX)"
    assert option(args, "--host") == "$(POD_IP)"
    fields = {
        env.name: env.value_from.field_ref.field_path
        for env in container.env
        if env.value_from and env.value_from.field_ref
    }
    assert fields == {
        "GROUP_INDEX": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
        "POD_IP": "status.podIP",
    }
    assert secret_of(container, "STALWART_LIGHTHOUSE_TOKEN") == TOKEN_SECRET
    mounts = {mount.name: mount.mount_path for mount in container.volume_mounts}
    assert option(args, "--run-dir") == mounts["run"]
    (ca,) = [env.value for env in container.env if env.name == "STALWART_LIGHTHOUSE_CA"]
    (tls,) = [volume.secret for volume in spec.template.spec.volumes if volume.name == "tls"]
    assert tls.secret_name == TLS_SECRET and [item.key for item in tls.items] == ["tls.crt"], "no key in the workers"
    assert ca == mounts["tls"] + "/tls.crt"


def test_a_preempted_group_has_time_to_reach_its_step_boundary() -> None:
    """SIGTERM goes to torchrun itself (no shell between), which gives the workers --shutdown-timeout, within the
    pod's grace period; a preempted pod is then replaced without counting against its index."""
    job = documents("workers.yaml")["Job"]
    pod = job.spec.template.spec
    (container,) = pod.containers
    assert container.command == ["torchrun"], "a shell as PID 1 would not forward SIGTERM"
    shutdown = int(option(container.args, "--shutdown-timeout"))
    assert shutdown >= 30, "a step boundary and a checkpoint write need more than torchrun's default"
    assert pod.termination_grace_period_seconds >= shutdown + 15, "SIGKILL would come before torchrun's own"
    assert container.args.index(f"--shutdown-timeout={shutdown}") < container.args.index("-m"), "torchrun's option"
