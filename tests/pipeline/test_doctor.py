"""`doctor`: the run file against a cluster (the fake API server, over HTTP, through the official client) and the
object store (moto), one verdict per check, exit 0 or 69."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_pipeline import parse_run_config
from dflash_pipeline.doctor.command import doctor_checks, run_doctor
from dflash_pipeline.run.config import RunConfig, read_run_file
from dflash_pipeline.staging.model_listing import LISTING_NAME
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.fake_kube_api import FakeKubeApi
from tests.pipeline.k8s_support import EXAMPLE_RUN

NS = "dflash"
# What a user who runs the pipeline holds in its namespace: what `submit`, `status`, `logs` and `resume` use.
USER_ROLE = {"rules": [
    {"apiGroups": [""], "resources": ["configmaps", "services", "serviceaccounts", "secrets", "pods", "pods/log",
                                      "namespaces", "nodes"], "verbs": ["get", "list", "create", "patch", "delete"]},
    {"apiGroups": ["batch"], "resources": ["cronjobs", "jobs"], "verbs": ["get", "list", "create", "patch", "delete"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
]}


def gpu_node(name: str, gpus: int, product: str = "NVIDIA-H200", taint: bool = True) -> dict[str, Any]:
    return {"kind": "Node", "metadata": {"name": name, "labels": {
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}] if taint else []},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96"}}}


def ready_cluster(api: FakeKubeApi) -> None:
    api.add({"kind": "Namespace", "metadata": {"name": NS}})
    api.add({"kind": "ServiceAccount", "metadata": {"name": "dflash-pipeline", "namespace": NS}})
    api.add({"kind": "Secret", "metadata": {"name": "dflash-s3", "namespace": NS},
             "data": {"AWS_ACCESS_KEY_ID": "a2V5", "AWS_SECRET_ACCESS_KEY": "c2VjcmV0"}})
    api.add(gpu_node("gpu-1", 8))
    api.add({"kind": "Node", "metadata": {"name": "cpu-1", "labels": {}}, "status": {"allocatable": {"cpu": "32"}}})


def pull_images(pod: dict[str, Any], failing: str = "") -> None:
    """The kubelet, at once: the probe's image is pulled and `true` exits, or (an image named `failing`) the pull
    fails as a registry that does not have it answers."""
    image = pod["spec"]["containers"][0]["image"]
    if failing and failing in image:
        pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "probe", "state": {"waiting": {
            "reason": "ErrImagePull", "message": f'failed to pull image "{image}": not found'}}}]}
    else:
        pod["spec"]["nodeName"] = "gpu-1"
        pod["status"] = {"phase": "Succeeded", "containerStatuses": [{"name": "probe", "imageID": "sha256:ab",
                                                                      "state": {"terminated": {"exitCode": 0}}}]}


@pytest.fixture
def run(s3_bucket: str, store: ObjectStore) -> RunConfig:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{s3_bucket}/runs"
    data["target"]["uri"] = f"{s3_bucket}/models/Qwen3-8B"
    store.write_bytes(join(data["target"]["uri"], LISTING_NAME), b"{}")
    return parse_run_config(data, "test run")


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    fake = FakeKubeApi(USER_ROLE).start()
    try:
        yield fake
    finally:
        fake.stop()


def verdicts(run: RunConfig, store: ObjectStore, api: FakeKubeApi, **options: Any) -> dict[str, tuple[bool, str]]:
    checks = doctor_checks(run, store, api.api_client(), **options)
    checks.run()
    return {r.name: (r.ok and not r.warning, r.detail) for r in checks.results}


def test_a_ready_cluster_passes_every_check_and_probe_pods_are_deleted(
        run: RunConfig, store: ObjectStore, api: FakeKubeApi, caplog: pytest.LogCaptureFixture) -> None:
    ready_cluster(api)
    api.on_create = pull_images
    caplog.set_level(logging.INFO)
    assert run_doctor(run, store, api.api_client()) == 0
    got = verdicts(run, store, api)
    assert all(ok for ok, _ in got.values()), got
    assert got["nodes"][1].startswith("generate 1 node(s), room for 8 pod(s) of 1 GPU(s); train 1 node(s)")
    assert got["secret"][1] == "Secret dflash-s3 holds AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"
    images = [name for name in got if name.startswith("image ")]
    # The three stage images and the run driver's.
    assert len(images) == 4 and all("pulled on gpu-1" in got[name][1] for name in images)
    # Every probe was deleted; none was labelled as the run's (logs and cancel never see them).
    assert not [name for name in api.names("pods")]
    assert "c2VjcmV0" not in caplog.text and "a2V5" not in caplog.text  # the Secret's values never leave the API


def test_each_missing_piece_fails_its_check_naming_the_fix(run: RunConfig, store: ObjectStore,
                                                            api: FakeKubeApi) -> None:
    ready_cluster(api)
    api.delete("secrets", NS, "dflash-s3")
    api.delete("serviceaccounts", NS, "dflash-pipeline")
    api.delete("nodes", "", "gpu-1")
    api.add(gpu_node("a100", 8, product="NVIDIA-A100-SXM4-80GB", taint=False))
    api.add(gpu_node("h200-4", 4))  # too few GPUs for train's 8
    api.on_create = lambda pod: pull_images(pod, failing="generator")
    data = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    for stage in ("generate", "train"):
        data["stages"][stage]["gpu_types"] = ["NVIDIA-H200"]
    data["scheduling"] = {"queue_name": "dflash-batch"}
    pinned = parse_run_config(data, "test run")
    store.delete(join(pinned.target.uri, LISTING_NAME))
    got = verdicts(pinned, store, api)
    assert got["secret"] == (False, got["secret"][1]) and "kubectl -n dflash create secret generic dflash-s3" in \
        got["secret"][1]
    assert not got["service_account"][0] and "submit --config RUN.toml --setup" in got["service_account"][1]
    nodes = got["nodes"][1]
    assert not got["nodes"][0] and "train needs 1 node(s) with 8 allocatable nvidia.com/gpu" in nodes
    assert "generate needs" not in nodes  # h200-4 takes generate's one-GPU pods
    assert "the nodes' nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB" in nodes
    assert not got["queues"][0] and "LocalQueue dflash-batch does not exist" in got["queues"][1]
    assert not got["target"][0] and "stage-model" in got["target"][1]
    generator = next(name for name in got if "generator" in name)
    assert not got[generator][0] and "ErrImagePull" in got[generator][1] and "imagePullSecret" in got[generator][1]
    assert not api.names("pods")
    assert run_doctor(pinned, store, api.api_client(), probe_images=False) == 69


def test_rights_the_user_lacks_are_named_and_unreadable_objects_only_warn(run: RunConfig, store: ObjectStore) -> None:
    role = {"rules": [{"apiGroups": ["batch"], "resources": ["cronjobs", "jobs"], "verbs": ["get", "create"]},
                      {"apiGroups": [""], "resources": ["configmaps", "pods"], "verbs": ["get", "list", "create"]}]}
    fake = FakeKubeApi(role).start()
    try:
        ready_cluster(fake)
        got = verdicts(run, store, fake, probe_images=False)
    finally:
        fake.stop()
    ok, rights = got["rights"]
    assert not ok and rights.startswith("you may not patch configmaps, patch cronjobs.batch")
    assert "create roles.rbac.authorization.k8s.io" in rights and "get pods/log" in rights
    # Namespaces, Secrets and nodes it may not read: the checks say they cannot tell, and do not fail.
    for name in ("secret", "nodes"):
        assert got[name][1].startswith("cannot"), got[name]


def test_a_probe_no_node_takes_fails_after_its_timeout(run: RunConfig, store: ObjectStore, api: FakeKubeApi) -> None:
    ready_cluster(api)

    def unschedulable(pod: dict[str, Any]) -> None:
        pod["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."}]}

    api.on_create = unschedulable
    ticks = itertools.count(step=10.0)
    got = verdicts(run, store, api, probe_timeout_s=30, sleep=lambda _: None, clock=lambda: next(ticks))
    probes = {name: detail for name, (ok, detail) in got.items() if name.startswith("image ") and not ok}
    assert len(probes) == 4
    assert all("did not start within 30 s (Unschedulable: 0/2 nodes are available" in d for d in probes.values())
    assert not api.names("pods")
