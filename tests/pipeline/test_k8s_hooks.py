"""Scheduler and node hooks from the run file: labels and annotations (Kueue, workload identity), priority,
ephemeral-storage sized from the target copy, deadlines, and RDMA devices with NCCL's environment.

Rendered Jobs are checked for their effect and validated strictly for Kubernetes 1.31-1.37; a base rendered
with every hook set is built with kubectl's kustomize through both overlays and validated again.
"""

from __future__ import annotations

import copy
import shutil
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import ValidationError

from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.render.base import write_base
from dflash_pipeline.render.jobs import stage_jobs
from dflash_pipeline.render.scheduling import PRIORITY_LABEL, QUEUE_LABEL, TMP_SIZE, target_disk_bytes
from dflash_pipeline.run.config import quantity_value, read_run_file
from dflash_shared.errors import ConfigError
from tests.pipeline.k8s_support import EXAMPLE_RUN, OVERLAYS, env_of, jobs, kustomize_build, schema_errors

GPU_STAGES = ("generate", "train", "evaluate", "serve-check")
AZURE_LABEL = "azure.workload.identity/use"


def run_data(**tables: Any) -> dict[str, Any]:
    """The example run file's data with top-level tables replaced and stage tables updated."""
    data = read_run_file(EXAMPLE_RUN)
    for key, value in tables.items():
        if key == "stages":
            for stage, settings in value.items():
                data["stages"][stage] = {**data["stages"].get(stage, {}), **settings}
        else:
            data[key] = value
    return data


def hooked() -> dict[str, Any]:
    """A run on a Kueue cluster with Azure workload identity and RDMA between the training nodes."""
    return run_data(
        scheduling={
            "queue_name": "dflash-batch",
            "workload_priority_class": "research",
            "priority_class_name": "batch-low",
            "job_labels": {"team": "speculative-decoding", "cost-center": "ml-42"},
            "job_annotations": {"example.com/owner": "ml-platform@example.com"},
            "pod_labels": {AZURE_LABEL: "true"},
            "pod_annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        },
        stages={
            "train": {
                "nodes": 2, "queue_name": "dflash-gpu-train", "priority_class_name": "batch-high",
                "job_labels": {"team": "drafters"},
                "extra_resources": {"rdma/ib": "1"},
                "env": {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0"},
                "shm_size": "64Gi",
                "pod_annotations": {"k8s.v1.cni.cncf.io/networks": "ib-sriov"},
                "active_deadline_seconds": 3 * 86400,
            },
            "tokenize": {"active_deadline_seconds": 0},
        },
    )


def by_stage(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Stage name -> its Job, from the Job builder's output."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs}


def rendered(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return by_stage(stage_jobs(parse_run_config(data, "run.toml")))


def pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_kueue_labels_priority_and_pod_labels_reach_every_job() -> None:
    docs = rendered(hooked())
    assert len(docs) == 7
    for stage, job in docs.items():
        labels, pod_meta = job["metadata"]["labels"], job["spec"]["template"]["metadata"]
        # Kueue reads its labels from the Job; webhooks (workload identity) read theirs from the pod.
        assert labels[QUEUE_LABEL] == ("dflash-gpu-train" if stage == "train" else "dflash-batch")
        assert labels[PRIORITY_LABEL] == "research"
        assert labels["team"] == ("drafters" if stage == "train" else "speculative-decoding")
        assert labels["cost-center"] == "ml-42"
        assert QUEUE_LABEL not in pod_meta["labels"] and "team" not in pod_meta["labels"]
        assert pod_meta["labels"][AZURE_LABEL] == "true" and AZURE_LABEL not in labels
        # The project's own labels stay as they were: overlays and `status` select by them.
        assert labels["app.kubernetes.io/component"] == stage == pod_meta["labels"]["app.kubernetes.io/component"]
        assert labels["app.kubernetes.io/part-of"] == "dflash-pipeline"
        assert job["metadata"]["annotations"]["example.com/owner"] == "ml-platform@example.com"
        assert job["metadata"]["annotations"]["dflash-pipeline/output"].startswith("s3://")
        annotations = pod_meta["annotations"]
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        assert ("k8s.v1.cni.cncf.io/networks" in annotations) == (stage == "train")
        assert pod_spec(job)["priorityClassName"] == ("batch-high" if stage == "train" else "batch-low")
    assert schema_errors(list(docs.values())) == []


def test_the_jobs_the_driver_creates_carry_the_kueue_labels() -> None:
    # What `kubectl apply` gets holds each stage's Job as a template; the Job made from it is what Kueue sees.
    created = jobs(render_documents(parse_run_config(hooked())))
    assert set(created) == {"import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"}
    for stage, job in created.items():
        assert job["metadata"]["labels"][QUEUE_LABEL] == ("dflash-gpu-train" if stage == "train" else "dflash-batch")
        assert job["spec"]["template"]["metadata"]["labels"][AZURE_LABEL] == "true"


def test_without_scheduling_settings_nothing_is_added() -> None:
    docs = rendered(read_run_file(EXAMPLE_RUN))
    for job in docs.values():
        assert not [k for k in job["metadata"]["labels"] if not k.startswith(("app.kubernetes.io/", "dflash-"))]
        assert "annotations" not in job["spec"]["template"]["metadata"]
        assert "priorityClassName" not in pod_spec(job)


@pytest.mark.parametrize(
    ("where", "mapping", "message"),
    [
        ("scheduling", {"job_labels": {"app.kubernetes.io/name": "x"}}, "keys under app.kubernetes.io/"),
        ("scheduling", {"pod_labels": {"dflash-pipeline/accelerator": "cpu"}}, "the pipeline's own"),
        ("scheduling", {"job_annotations": {"dflash-pipeline/output": "s3://x"}}, "the pipeline's own"),
        ("scheduling", {"pod_labels": {"batch.kubernetes.io/job-name": "x"}}, "the Job controller sets"),
        ("scheduling", {"pod_labels": {"job-name": "x"}}, "the Job controller sets"),
        ("scheduling", {"job_labels": {"team name": "x"}}, "label key 'team name': the name"),
        ("scheduling", {"job_labels": {"x" * 64: "y"}}, "1-63 characters"),
        ("scheduling", {"job_labels": {"Example.COM/team": "y"}}, "the prefix 'Example.COM' must be a DNS"),
        ("scheduling", {"job_labels": {"/team": "y"}}, "the prefix before '/' is empty"),
        ("scheduling", {"job_labels": {"a/b/c": "y"}}, "at most one '/'"),
        ("scheduling", {"pod_labels": {AZURE_LABEL: True}}, "pod_labels"),
        ("scheduling", {"job_labels": {"team": "a/b"}}, "label 'team': the value 'a/b'"),
        ("scheduling", {"job_labels": {"team": "v" * 64}}, "at most 63 characters"),
        ("scheduling", {"job_annotations": {"note": "x" * (256 * 1024)}}, "the API server takes at most"),
        ("scheduling", {"queue_name": "team queue"}, "scheduling.queue_name"),
        ("scheduling", {"queue_name": ""}, "must not be empty"),
        ("train", {"job_labels": {"app.kubernetes.io/instance": "x"}}, "stages.train.job_labels"),
        ("train", {"pod_annotations": {"dflash-pipeline/input": "x"}}, "stages.train.pod_annotations"),
        ("train", {"workload_priority_class": "High!"}, "stages.train.workload_priority_class"),
    ],
)
def test_bad_labels_and_annotations_are_refused_naming_the_key(
    where: str, mapping: dict[str, Any], message: str
) -> None:
    data = run_data(scheduling=mapping) if where == "scheduling" else run_data(stages={where: mapping})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as caught:
        parse_run_config(data, "bad.toml")
    assert "bad.toml" in str(caught.value)


def test_a_kueue_label_set_twice_is_refused() -> None:
    data = run_data(scheduling={"queue_name": "dflash-batch"},
                    stages={"export": {"job_labels": {QUEUE_LABEL: "other"}}})
    with pytest.raises(ConfigError, match=r"stages\.export: the Job label kueue\.x-k8s\.io/queue-name is set both"):
        stage_jobs(parse_run_config(data))


def test_ephemeral_storage_covers_the_scratch_with_the_target_copy_and_the_other_volumes() -> None:
    run = parse_run_config(read_run_file(EXAMPLE_RUN))
    target = target_disk_bytes(run)
    # Qwen/Qwen3-8B: 8 B weights x 2 bytes (bf16) + 10% (the id rounds the count; tokenizer and index files).
    assert target == Decimal("17.6e9")
    for stage, job in by_stage(stage_jobs(run)).items():
        settings = run.stages.for_stage(stage)
        spec = pod_spec(job)
        volumes = {v["name"]: v["emptyDir"] for v in spec["volumes"]}
        scratch = quantity_value(volumes["scratch"]["sizeLimit"])
        expected_scratch = quantity_value(settings.scratch_size) + (target if stage in GPU_STAGES else 0)
        assert expected_scratch <= scratch < expected_scratch + 2**30, stage
        disk_backed = sum(quantity_value(v["sizeLimit"]) for v in volumes.values() if v.get("medium") != "Memory")
        assert disk_backed == scratch + quantity_value(TMP_SIZE) + quantity_value(settings.home_size)
        for container in spec["containers"]:
            resources = container["resources"]
            request = quantity_value(resources["requests"]["ephemeral-storage"])
            assert resources["limits"]["ephemeral-storage"] == resources["requests"]["ephemeral-storage"]
            # The emptyDirs, plus room for the container's logs.
            assert disk_backed < request <= disk_backed + 2 * 2**30, stage
    assert schema_errors(stage_jobs(run), ["1.31", "1.37"]) == []


@pytest.mark.parametrize(
    ("target", "expected_bytes"),
    [
        ({"model_id": "Qwen/Qwen3.6-27B"}, Decimal("59.4e9")),
        ({"model_id": "Qwen/Qwen3-30B-A3B"}, Decimal("66e9")),  # every expert is copied: the total count
        ({"model_id": "meta-llama/Llama-3.1-70B-Instruct"}, Decimal("154e9")),
        ({"model_id": "openai/gpt-oss-120b"}, Decimal("264e9")),
        ({"model_id": "Qwen/Qwen3-0.6B"}, Decimal("1.32e9")),
        ({"model_id": "my-org/house-model", "disk_size": "60Gi"}, Decimal(60 * 2**30)),
        ({"model_id": "Qwen/Qwen3-8B", "disk_size": "20G"}, Decimal("20e9")),
    ],
)
def test_target_size_from_the_run_file_or_the_model_id(target: dict[str, str], expected_bytes: Decimal) -> None:
    data = run_data(target={**read_run_file(EXAMPLE_RUN)["target"], **target})
    run = parse_run_config(data)
    assert target_disk_bytes(run) == expected_bytes
    train = by_stage(stage_jobs(run))["train"]
    scratch = {v["name"]: v for v in pod_spec(train)["volumes"]}["scratch"]["emptyDir"]["sizeLimit"]
    assert quantity_value(scratch) >= expected_bytes + quantity_value(run.stages.for_stage("train").scratch_size)


def test_a_target_of_unknown_size_needs_target_disk_size() -> None:
    data = run_data(target={**read_run_file(EXAMPLE_RUN)["target"], "model_id": "my-org/house-model"})
    with pytest.raises(ConfigError, match="set target.disk_size"):
        stage_jobs(parse_run_config(data))
    data["target"]["disk_size"] = "60 GB"
    with pytest.raises(ConfigError, match=r"target\.disk_size: .*not a Kubernetes quantity"):
        parse_run_config(data)


def test_every_stage_has_a_deadline_of_hours_or_days_and_a_run_file_can_change_it() -> None:
    defaults = {s: j["spec"]["activeDeadlineSeconds"] for s, j in rendered(read_run_file(EXAMPLE_RUN)).items()}
    day = 86400
    assert set(defaults) == {"import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"}
    for stage in ("import", "tokenize", "export"):
        assert 3600 <= defaults[stage] < day
    assert defaults["generate"] >= 2 * day and defaults["train"] >= 7 * day
    assert defaults["train"] >= defaults["generate"]
    changed = rendered(hooked())
    assert changed["train"]["spec"]["activeDeadlineSeconds"] == 3 * day
    assert "activeDeadlineSeconds" not in changed["tokenize"]["spec"]  # 0: none
    assert changed["generate"]["spec"]["activeDeadlineSeconds"] == defaults["generate"]


def test_rdma_devices_nccl_environment_and_shared_memory_reach_the_training_pods() -> None:
    train = rendered(hooked())["train"]
    spec = pod_spec(train)
    (container,) = spec["containers"]
    assert container["resources"]["requests"]["rdma/ib"] == "1"
    assert container["resources"]["limits"]["rdma/ib"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(container)
    assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    shm = {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # One pod per node, each with its own RDMA device.
    assert train["spec"]["completions"] == train["spec"]["parallelism"] == 2
    assert schema_errors([train]) == []


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"ib": "1"}, "needs a domain prefix"),
        ({"kubernetes.io/ib": "1"}, "reserved for Kubernetes"),
        ({"nvidia.com/gpu": 2}, "set `gpus` instead"),
        ({"memory": "1Gi"}, "not an extended resource"),
        ({"hugepages-2Mi": "1Gi"}, "not an extended resource"),
        ({"rdma/ib": "0.5"}, "whole number"),
        ({"rdma/ib": "0"}, "whole number"),
        ({"rdma/IB net": "1"}, "extra resource 'rdma/IB net'"),
    ],
)
def test_bad_extra_resources_are_refused(resources: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"stages\.train\b.*extra.resource.*{message.replace('`', '.')}"):
        parse_run_config(run_data(stages={"train": {"extra_resources": resources}}), "bad.toml")


@pytest.mark.parametrize("name", ["NCCL IB", "1NCCL", "NCCL-IB"])
def test_bad_environment_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="not a valid environment variable name"):
        parse_run_config(run_data(stages={"train": {"env": {name: "x"}}}))


def test_fast_validation_agrees_with_kubernetes_validate() -> None:
    # k8s_support keeps one validator per (version, kind); it must say what the library's own call says.
    train = rendered(hooked())["train"]
    broken = copy.deepcopy(train)
    broken["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    for doc, fails in ((train, False), (broken, True)):
        for version in ("1.31", "1.37"):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                library_fails = False
            except ValidationError:
                library_fails = True
            assert library_fails == fails == bool(schema_errors([doc], [version]))


def test_a_base_with_every_hook_builds_through_both_overlays_and_validates(tmp_path: Path) -> None:
    # The overlays patch the generated base; pod annotations, extra devices and the bigger scratch must not
    # move anything their JSON 6902 `test` operations guard.
    k8s = tmp_path / "k8s"
    shutil.copytree(OVERLAYS, k8s / "overlays")
    write_base(parse_run_config(hooked()), "hooked.toml", k8s / "base")
    base = kustomize_build(k8s / "base")
    assert schema_errors(base) == []
    for overlay in sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()):
        docs = kustomize_build(k8s / "overlays" / overlay)
        assert schema_errors(docs) == [], overlay
        text = repr(docs)
        assert QUEUE_LABEL in text and AZURE_LABEL in text and "k8s.v1.cni.cncf.io/networks" in text
        # local-cpu replaces every container's resources with a laptop's; the GPU cluster keeps them.
        assert ("rdma/ib" in text and "ephemeral-storage" in text) == (overlay == "gpu-cluster")
