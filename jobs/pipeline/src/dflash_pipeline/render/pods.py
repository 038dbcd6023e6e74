"""The pod every workload of a run is built from: the stage Jobs, a JobSet's pods and the run driver.

Every image keeps one contract (docker/*/Dockerfile): it runs as user 10001 on a read-only root filesystem,
with HOME and TMPDIR on emptyDirs. Every container reaches S3 the same way: endpoint, region and checksum
settings as plain variables, the credentials Secret's keys through envFrom (secret mode only), so no
credential is ever written into a manifest. What differs from pod to pod (command, environment, resources,
volumes, placement, the driver's API token) is passed in by the builder of that workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.run.config import RunConfig

PART_OF = "dflash-pipeline"
# Every object of a run carries this label, and the run driver, `cancel` and `status` select by it. Not
# app.kubernetes.io/instance: Argo CD writes that label for its own tracking (its default before v3), so
# under Argo CD it would name the Argo application, not the run.
RUN_LABEL = "dflash-pipeline/run"
# The image contract: user 10001, TMPDIR and HOME at these paths.
RUN_AS = 10001
SCRATCH_DIR = "/work/scratch"
HOME_DIR = "/home/dflash"

POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def storage_env(run: RunConfig) -> list[dict[str, str]]:
    """The S3 settings every container of the run gets as plain variables (no credentials)."""
    env = []
    if run.storage.endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": run.storage.endpoint_url})
    if run.storage.region:
        env.append({"name": "AWS_REGION", "value": run.storage.region})
    if run.storage.checksum_when_required:
        env += [{"name": "AWS_REQUEST_CHECKSUM_CALCULATION", "value": "when_required"},
                {"name": "AWS_RESPONSE_CHECKSUM_VALIDATION", "value": "when_required"}]
    return env


@dataclass(frozen=True)
class Container:
    """What a workload's builder says of its one container; `pod_spec` adds what every container of a run has."""

    name: str
    image: str  # a full reference (`ImageSettings.ref`)
    command: list[str]
    env: list[dict[str, Any]]
    resources: dict[str, Any]
    mounts: list[dict[str, Any]]
    args: list[str] = field(default_factory=list)
    # After the run's storage settings, so that the run file's own `env` may override them; `env` comes before.
    env_after_storage: list[dict[str, Any]] = field(default_factory=list)


def _container(run: RunConfig, main: Container) -> dict[str, Any]:
    """The container as applied: the run's storage settings between the builder's two parts of the environment
    (their order is kept: an overlay's JSON patch names variables by index), the hardened security context, and
    the credentials Secret's keys where the run uses one."""
    out: dict[str, Any] = {"name": main.name, "image": main.image, "imagePullPolicy": run.images.pull_policy,
                           "command": main.command}
    if main.args:
        out["args"] = main.args
    out |= {"env": [*main.env, *storage_env(run), *main.env_after_storage], "resources": main.resources,
            "securityContext": CONTAINER_SECURITY, "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": main.mounts}
    if run.storage.secret:
        out["envFrom"] = [{"secretRef": {"name": run.storage.secret}}]
    return out


def pod_spec(
    run: RunConfig,
    main: Container,
    volumes: list[dict[str, Any]],
    *,
    service_account: str | None = None,
    api_token: bool = False,
    grace_seconds: int | None = None,
    subdomain: str | None = None,
) -> dict[str, Any]:
    """A pod of the run with one container, that runs once (restartPolicy Never; the Job replaces it) as the
    non-root user, and pulls with the run file's imagePullSecrets.

    `service_account` defaults to the stages' account, which has no Kubernetes API access: only the run
    driver asks for its token (`api_token`). `subdomain` names the headless Service the pod resolves under.
    """
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": service_account or run.storage.service_account,
        # The stages never call the Kubernetes API; workload identity webhooks mount their own token.
        "automountServiceAccountToken": api_token,
        # Service links inject *_SERVICE_HOST variables, and the stage configs refuse unknown DFLASH_* ones.
        "enableServiceLinks": False,
    }
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    spec["securityContext"] = POD_SECURITY
    if subdomain is not None:
        spec["subdomain"] = subdomain
    spec["containers"] = [_container(run, main)]
    spec["volumes"] = volumes
    if run.images.pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in run.images.pull_secrets]
    return spec


def small_dirs(size: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of a pod without scratch (the run driver, a JobSet's wait pod): /tmp and HOME."""
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": size}}, {"name": "home", "emptyDir": {"sizeLimit": size}}]
    return volumes, [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": HOME_DIR}]
