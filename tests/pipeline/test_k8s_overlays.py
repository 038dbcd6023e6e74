"""The kustomize overlays, built by kubectl's own kustomize exactly as `kubectl apply -k` builds them.

Every patch must match and apply to the generated base (its JSON 6902 `test` operations included), and the
result must pass strict schema validation for Kubernetes 1.31-1.37 and have the intended effect.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.pipeline.k8s_support import (
    BASE_DIR,
    OVERLAYS,
    SETUP_DIR,
    KustomizeError,
    containers,
    env_of,
    jobs,
    schema_errors,
)
from tests.pipeline.k8s_support import kustomize_build as build


@pytest.mark.parametrize("overlay", sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()))
def test_overlay_builds_and_validates(overlay: str) -> None:
    docs = build(OVERLAYS / overlay)
    # The stage Jobs are templates (suspended CronJobs); the one Job applied is the run driver. No Namespace
    # and no shared ServiceAccount: a run's objects are the run's alone (the namespace setup is k8s/namespace).
    assert sorted(d["kind"] for d in docs) == (["ConfigMap"] + ["CronJob"] * 7
                                               + ["Job", "Role", "RoleBinding", "ServiceAccount"])
    assert all(d["metadata"]["labels"]["dflash-pipeline/run"] == "example" for d in docs)
    assert schema_errors(docs) == []
    # No image of a shipped overlay moves with every build.
    images = [c["image"] for d in docs if d["kind"] in ("CronJob", "Job") for c in containers(
        d["spec"]["jobTemplate"] if d["kind"] == "CronJob" else d)]
    assert images and not any(i.endswith(":latest") or ":" not in i.rsplit("/", 1)[-1] for i in images)
    assert "latest" not in (OVERLAYS / overlay / "kustomization.yaml").read_text()


def test_the_namespace_setup_builds_and_holds_only_what_runs_share() -> None:
    docs = build(SETUP_DIR)
    assert sorted(d["kind"] for d in docs) == ["Namespace", "ServiceAccount"]
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # Nothing of the setup carries a run's label: deleting a run by its label never selects it.
    assert not any("dflash-pipeline/run" in d["metadata"]["labels"] for d in docs)
    assert "Secret" not in {d["kind"] for d in docs}
    assert schema_errors(docs) == []


def test_base_builds_and_validates_without_the_example_secret() -> None:
    docs = build(BASE_DIR)
    assert "Secret" not in {d["kind"] for d in docs}
    assert schema_errors(docs) == []


def test_local_cpu_overlay_drops_gpus_and_runs_one_pod_at_a_time() -> None:
    base = jobs(build(BASE_DIR))
    local = jobs(build(OVERLAYS / "local-cpu"))
    for stage, job in local.items():
        pod = job["spec"]["template"]["spec"]
        assert job["spec"]["parallelism"] == 1
        assert job["spec"]["completions"] == base[stage]["spec"]["completions"]
        if stage not in ("train", "export", "evaluate", "serve-check"):  # one process group each, not shards
            assert env_of(pod["containers"][0])["DFLASH_NUM_SHARDS"] == str(job["spec"]["completions"])
        assert "nodeSelector" not in pod and "tolerations" not in pod
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
        assert job["metadata"]["labels"]["dflash-pipeline/accelerator"] == "cpu"
        assert [c["image"] for c in containers(job)] == [c["image"] for c in containers(base[stage])]
    for stage in ("generate", "train", "evaluate", "serve-check"):
        shm = {v["name"]: v for v in local[stage]["spec"]["template"]["spec"]["volumes"]}["dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    # Training becomes one process on the CPU: the entrypoint alone, no torchrun, device cpu.
    train = local["train"]["spec"]["template"]["spec"]["containers"][0]
    assert train["command"] == ["/opt/dflash/entrypoint.sh"] and "args" not in train
    assert env_of(train)["DFLASH_TRAIN_DEVICE"] == "cpu"
    assert env_of(local["evaluate"]["spec"]["template"]["spec"]["containers"][0])["DFLASH_EVALUATE_DEVICE"] == "cpu"
    assert "args" in base["train"]["spec"]["template"]["spec"]["containers"][0]


def test_gpu_cluster_overlay_places_gpu_pods_and_uses_the_registry_placeholder() -> None:
    docs = jobs(build(OVERLAYS / "gpu-cluster"))
    for job in docs.values():
        assert all(c["image"].startswith("registry.invalid/dflash/dflash-") for c in containers(job))
    for stage, gpus in (("generate", 1), ("train", 8), ("evaluate", 1), ("serve-check", 1)):
        pod = docs[stage]["spec"]["template"]["spec"]
        # The GPU product is the run file's (gpu_types), where `plan` checks it; the overlay pins none.
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {t.get("key") for t in pod["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert "nodeSelector" not in docs["tokenize"]["spec"]["template"]["spec"]


def test_a_patch_that_no_longer_fits_the_base_fails_the_build(tmp_path: Path) -> None:
    # The overlays guard their patches with `test` operations; a base that changed under them must stop
    # the build rather than patch the wrong container or volume.
    shutil.copytree(OVERLAYS.parent, tmp_path / "k8s")
    broken = tmp_path / "k8s" / "overlays" / "broken"
    broken.mkdir()
    (broken / "kustomization.yaml").write_text("""\
resources:
  - ../local-cpu
patches:
  - target: {kind: CronJob, name: example-tokenize}
    patch: |-
      - op: test
        path: /spec/jobTemplate/spec/template/spec/containers/0/name
        value: not-the-tokenize-container
""")
    with pytest.raises(KustomizeError, match="test failed"):
        build(broken)
    assert build(broken.parent / "local-cpu")  # the same copy without the broken patch builds


def test_a_name_prefix_overlay_keeps_the_rendezvous_and_the_run_object_reachable(tmp_path: Path) -> None:
    """kubectl's kustomize with namePrefix/nameSuffix over a base with a multi-node train stage: the pods' subdomain
    and the name torchrun resolves follow the renamed Service, and the driver reads the renamed run object (the
    base's kustomizeconfig.yaml teaches kustomize these references)."""
    from dflash_pipeline import parse_run_config
    from dflash_pipeline.render.base import write_base
    from dflash_pipeline.run.config import read_run_file
    from tests.pipeline.k8s_support import EXAMPLE_RUN
    from tests.pipeline.pod_emulation import expand_references

    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], "nodes": 2}
    write_base(parse_run_config(data), "run.toml", tmp_path / "base")
    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "kustomization.yaml").write_text(
        "resources: [../base]\nnamePrefix: team-a-\nnameSuffix: -x\n")
    docs = build(tmp_path / "team")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["metadata"]["name"] == "team-a-dflash-example-train-x"
    train = jobs(docs)["train"]
    pod = train["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    args = [expand_references(a, env_of(pod["containers"][0])) for a in pod["containers"][0]["args"]]
    # Pod 0 is named after the Job the driver creates (its name from the template's annotation) and the
    # Service selects that Job's pods.
    assert train["metadata"]["name"] == service["spec"]["selector"]["batch.kubernetes.io/job-name"]
    assert f"--rdzv-endpoint={train['metadata']['name']}-0.{service['metadata']['name']}:29500" in args
    # The driver finds the run object under its new name, and its Role may read it.
    (driver,) = [d for d in docs if d["kind"] == "Job"]
    (run_object,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert run_object["metadata"]["name"] == "team-a-dflash-example-run-x"
    driver_env = {e["name"]: e.get("value") for e in driver["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert driver_env["DFLASH_RUN_OBJECT"] == run_object["metadata"]["name"]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (rule,) = [r for r in role["rules"] if r["resources"] == ["configmaps"]]
    assert rule["resourceNames"] == [run_object["metadata"]["name"]]
