"""The kustomize overlays, built by kubectl's own kustomize exactly as `kubectl apply -k` builds them.

Every patch must match and apply to the generated base (its JSON 6902 `test` operations included), and the
result must pass strict schema validation for Kubernetes 1.31-1.37 and have the intended effect.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.k8s.k8s_support import (
    BASE_DIR,
    OVERLAYS,
    KustomizeError,
    containers,
    env_of,
    jobs,
    schema_errors,
)
from tests.k8s.k8s_support import kustomize_build as build


@pytest.mark.parametrize("overlay", sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()))
def test_overlay_builds_and_validates(overlay: str) -> None:
    docs = build(OVERLAYS / overlay)
    # The stage Jobs are templates (suspended CronJobs); the one Job applied is the run driver.
    assert sorted(d["kind"] for d in docs) == (["CronJob"] * 7 + ["Job", "Namespace", "Role", "RoleBinding"]
                                               + ["ServiceAccount"] * 2)
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


def test_gpu_cluster_overlay_pins_gpu_nodes_and_uses_the_registry_placeholder() -> None:
    docs = jobs(build(OVERLAYS / "gpu-cluster"))
    for job in docs.values():
        assert all(c["image"].startswith("registry.invalid/dflash/dflash-") for c in containers(job))
    for stage, gpus in (("generate", 1), ("train", 8), ("evaluate", 1), ("serve-check", 1)):
        pod = docs[stage]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true",
                                       "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
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
