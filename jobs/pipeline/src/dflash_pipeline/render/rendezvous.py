"""How a torchrun stage is launched (`launch_args`), and where the torchruns of several nodes meet: pod 0's address,
and what a pod needs to resolve it.

An Indexed Job's pod i is named <job>-i; with `subdomain` set to a headless Service of the Job's pods
(`headless_service`), <job>-0.<service> resolves to pod 0 as soon as it has an address (`job_rendezvous`). A
JobSet makes that Service itself, named after the JobSet, and pod 0 of its node Job is <jobset>-node-0-0
(`gang_rendezvous`). Either way the kubelet expands the names from the container's environment, so an overlay
that renames the objects (namePrefix, nameSuffix) keeps the endpoint resolvable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_pipeline.run.config import JobSettings
from dflash_pipeline.run.stages import StageDef

RENDEZVOUS_PORT = 29500
# The headless Service's name, as the container sees it: a literal that kustomize renames with the Service (the
# base's kustomizeconfig.yaml), so a namePrefix or nameSuffix overlay keeps the rendezvous endpoint resolvable.
RENDEZVOUS_SERVICE_ENV = "RENDEZVOUS_SERVICE"
# The JobSet's name as its pods see it (JobSet labels every pod with it): a namePrefix overlay renames the
# JobSet, and with it the pods' hostnames and the headless Service, so the endpoint is built from the label.
JOBSET_NAME_ENV = "JOBSET_NAME"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# The JobSet's replicatedJob that holds the gang.
NODE_JOB = "node"


@dataclass(frozen=True)
class Rendezvous:
    """Where the torchruns of a multi-node stage meet, and what a pod needs to resolve that address."""

    endpoint: str  # pod 0's host:port for --rdzv-endpoint; the kubelet expands its $(VAR) from `env`
    env: dict[str, Any]  # the container variable the endpoint names
    subdomain: str | None  # the pods' subdomain (a headless Service of our own); None where a controller sets it


def stage_rendezvous(job_name: str, settings: JobSettings) -> Rendezvous | None:
    """Where the stage's ranks meet: under JobSet's Service for a gang, under the Job's own Service for an
    Indexed Job of several nodes; None for a stage in one pod."""
    if settings.gang == "jobset":
        return gang_rendezvous()
    return job_rendezvous(job_name) if settings.nodes > 1 else None


def launch_args(run_id: str, stage: StageDef, settings: JobSettings, rendezvous: Rendezvous | None) -> list[str]:
    """Arguments of the image entrypoint: none (one process), or torchrun over the pod's GPUs and the Job's nodes.

    The entrypoint runs the preflight once per pod before torchrun. `$(JOB_COMPLETION_INDEX)` is expanded by
    the kubelet from the variable the Job controller gives each pod of an Indexed Job. `rendezvous` is where the
    torchruns of several nodes meet; None for a stage in one pod.
    """
    if stage.rank_command is None or (settings.gpus <= 1 and settings.nodes == 1):
        return []
    per_node = f"--nproc-per-node={max(settings.gpus, 1)}"
    if rendezvous is None:
        return ["torchrun", "--standalone", per_node, *stage.rank_command]
    return [
        "torchrun", f"--nnodes={settings.nodes}", per_node, "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous.endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf=join_timeout={settings.rendezvous_timeout_seconds}", *stage.rank_command,
    ]


def job_rendezvous(job_name: str) -> Rendezvous:
    """Pod 0 of the Job under the Job's own headless Service.

    Pod 0's hostname is the Job's name (the driver creates it under that name, whatever an overlay calls the
    template) and its index; the kubelet expands the Service's name from the container's environment.
    """
    return Rendezvous(endpoint=f"{job_name}-0.$({RENDEZVOUS_SERVICE_ENV}):{RENDEZVOUS_PORT}",
                      env={"name": RENDEZVOUS_SERVICE_ENV, "value": job_name}, subdomain=job_name)


def node_pod_name() -> str:
    """Hostname of pod 0 of a JobSet's node Job, <jobset>-<replicatedJob>-<job index>-<pod index>, for the kubelet
    to expand."""
    return f"$({JOBSET_NAME_ENV})-{NODE_JOB}-0-0"


def gang_rendezvous() -> Rendezvous:
    """Pod 0 of the node Job under the Service JobSet makes, named after the JobSet (network.subdomain left to
    its default); JobSet sets the pods' subdomain itself."""
    return Rendezvous(
        endpoint=f"{node_pod_name()}.$({JOBSET_NAME_ENV}):{RENDEZVOUS_PORT}",
        env={"name": JOBSET_NAME_ENV,
             "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_NAME_LABEL}']"}}},
        subdomain=None,
    )


def headless_service(job_name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """Headless Service giving each pod of a multi-node Job a DNS name (<job>-<index>.<service>)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job_name, "namespace": namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            # The Job controller labels every pod with its Job's name.
            "selector": {"batch.kubernetes.io/job-name": job_name},
            # Names must resolve before the pods are Ready: the rendezvous happens during start-up.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }
