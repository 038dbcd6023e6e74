"""Rendered manifests: valid for Kubernetes 1.31-1.37 (strict), safe by policy, wired, and up to date."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_pipeline import load_run_config, parse_run_config, render_documents
from dflash_pipeline.render.base import GENERATED, base_files
from dflash_pipeline.render.namespace_setup import PLACEHOLDER, example_secret, setup_documents
from dflash_pipeline.render.pods import HOME_DIR, RUN_AS, SCRATCH_DIR
from dflash_pipeline.render.yaml_out import dump_all
from dflash_pipeline.run.config import read_run_file
from dflash_pipeline.run.stages import (
    EVALUATE,
    EXPORT,
    GENERATE,
    IMAGE_ENTRYPOINT,
    IMPORT_COMPLETIONS,
    IMPORT_PROMPTS,
    TOKENIZE,
    TRAIN,
)
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from tests.pipeline.k8s_support import (
    EXAMPLE_RUN,
    REPO_ROOT,
    containers,
    env_of,
    failure_action,
    jobs,
    schema_errors,
)
from tests.pipeline.pod_emulation import image_env, image_files


def example(**changes: Any) -> dict[str, Any]:
    """The example run file's data with top-level tables updated."""
    data = read_run_file(EXAMPLE_RUN)
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key != "stages" else value
    return data


def everything_set() -> dict[str, Any]:
    """A run using every optional knob: workload identity, MinIO, GPU types, pull secrets, limits, ..."""
    stages = read_run_file(EXAMPLE_RUN)["stages"]
    stages["generate"] = {**stages["generate"], "gpus": 2, "gpu_types": ["NVIDIA-H100-80GB-HBM3"],
                          "runtime_class_name": "nvidia", "priority_class_name": "batch-high",
                          "max_failed_shards": 1, "active_deadline_seconds": 86400, "cpu_limit": "16",
                          "memory_limit": "80Gi", "env": {"VLLM_LOGGING_LEVEL": "INFO"}}
    return example(
        storage={"credentials": "workload_identity", "secret_name": None, "endpoint_url": "http://minio.minio:9000",
                 "service_account_annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/x"},
                 "checksum_when_required": True},
        images={"pull_secrets": ["regcred"], "pull_policy": "Always"},
        stages=stages,
        create_namespace=False,
    )


RUNS = {
    "example-prompts": lambda: read_run_file(EXAMPLE_RUN),
    "completions": lambda: example(source={"kind": "completions", "uri": "s3://b/sources"}),
    "everything-set": everything_set,
}


@pytest.fixture(params=sorted(RUNS))
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render_documents(parse_run_config(RUNS[request.param](), request.param))


def test_every_document_passes_strict_validation_for_1_31_to_1_37() -> None:
    rendered = [doc for make in RUNS.values() for doc in render_documents(parse_run_config(make()))]
    run = load_run_config(EXAMPLE_RUN)
    assert schema_errors([*rendered, example_secret(run)]) == []


def test_strict_validation_catches_a_misspelt_field() -> None:
    job = copy.deepcopy(jobs(render_documents(load_run_config(EXAMPLE_RUN)))["generate"])
    pod = job["spec"]["template"]["spec"]
    pod["nodeSelektor"] = pod.pop("nodeSelector")
    errors = schema_errors([job], ["1.31"])
    assert len(errors) == 1 and "nodeSelektor" in errors[0]


def test_optional_settings_reach_the_manifests() -> None:
    docs = render_documents(parse_run_config(everything_set()))
    # No Job is applied directly: the stages are templates the run driver (the one Job) instantiates.
    assert [d["kind"] for d in docs] == (["CronJob"] * 7 + ["ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                                                           "Job"])
    # The driver reads and writes the run's prefix too: its own account carries the same cloud identity as
    # the stages' account of the namespace setup.
    run = parse_run_config(everything_set())
    for account in [d for d in [*docs, *setup_documents(run)] if d["kind"] == "ServiceAccount"]:
        assert account["metadata"]["annotations"] == {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/x"}
    generate = jobs(docs)["generate"]
    pod = generate["spec"]["template"]["spec"]
    assert generate["spec"]["maxFailedIndexes"] == 1 and generate["spec"]["activeDeadlineSeconds"] == 86400
    assert pod["runtimeClassName"] == "nvidia" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]
    for container in containers(generate):
        assert "envFrom" not in container
        assert env_of(container)["AWS_ENDPOINT_URL"] == "http://minio.minio:9000"
        assert env_of(container)["AWS_REQUEST_CHECKSUM_CALCULATION"] == "when_required"
    main = pod["containers"][0]
    assert main["resources"]["limits"] == {"memory": "80Gi", "cpu": "16", "nvidia.com/gpu": 2,
                                           "ephemeral-storage": "59Gi"}
    assert env_of(main)["VLLM_LOGGING_LEVEL"] == "INFO"
    assert env_of(main)["DFLASH_GENERATE_TENSOR_PARALLEL_SIZE"] == "2"


def test_jobs_are_indexed_with_one_pod_per_shard(docs: list[dict[str, Any]]) -> None:
    for stage, job in jobs(docs).items():
        spec = job["spec"]
        shards = spec["completions"]
        assert spec["completionMode"] == "Indexed" and spec["parallelism"] == shards
        assert spec["backoffLimitPerIndex"] >= 1 and spec["ttlSecondsAfterFinished"] > 0
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        main = spec["template"]["spec"]["containers"][0]
        if stage in ("train", "export", "evaluate", "serve-check"):
            # One process group: a pod per node (test_k8s_train.py), never shards.
            assert "DFLASH_NUM_SHARDS" not in env_of(main)
        else:
            assert env_of(main)["DFLASH_NUM_SHARDS"] == str(shards)


def test_pod_failure_policy_follows_the_exit_codes(docs: list[dict[str, Any]]) -> None:
    for job in jobs(docs).values():
        assert failure_action(job, int(ExitCode.BAD_INPUT)) == "FailJob"
        assert failure_action(job, int(ExitCode.USAGE)) == "FailJob"
        assert failure_action(job, int(ExitCode.PREEMPTED)) == "Ignore"
        assert failure_action(job, condition="DisruptionTarget") == "Ignore"
        for retried in (ExitCode.RETRYABLE, ExitCode.ENVIRONMENT, 137):
            assert failure_action(job, int(retried)) == "Count"


def test_pods_run_non_root_with_a_read_only_root(docs: list[dict[str, Any]]) -> None:
    for job in jobs(docs).values():
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == RUN_AS
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
        assert pod["terminationGracePeriodSeconds"] >= 30
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in containers(job):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            # Everything the process writes to (TMPDIR, HOME, /tmp) is a writable emptyDir.
            for path in (env_of(container)["TMPDIR"], env_of(container)["HOME"], "/tmp"):
                assert path in mounts and "emptyDir" in volumes[mounts[path]], (container["name"], path)
            assert all("sizeLimit" in volumes[name]["emptyDir"] for name in mounts.values())


def test_gpu_stage_requests_gpus_and_is_placed_on_gpu_nodes(docs: list[dict[str, Any]]) -> None:
    by_stage = jobs(docs)
    for stage, job in by_stage.items():
        pod = job["spec"]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        if stage not in ("generate", "train", "evaluate", "serve-check"):
            assert "nvidia.com/gpu" not in limits and "dshm" not in volumes and "nodeSelector" not in pod
            continue
        assert limits["nvidia.com/gpu"] >= 1
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
        main = pod["containers"][0]
        env = env_of(main)
        if stage == "generate":
            assert env["DFLASH_GENERATE_TENSOR_PARALLEL_SIZE"] == str(limits["nvidia.com/gpu"])
        elif stage == "serve-check":
            assert env["DFLASH_SERVE_CHECK_TENSOR_PARALLEL_SIZE"] == str(limits["nvidia.com/gpu"])
        elif stage == "evaluate":
            assert env["DFLASH_EVALUATE_DEVICE"] == "cuda" and limits["nvidia.com/gpu"] == 1
        else:
            # One training process per GPU of the pod.
            assert env["DFLASH_TRAIN_DEVICE"] == "cuda"
            assert f"--nproc-per-node={limits['nvidia.com/gpu']}" in main.get("args", ["--nproc-per-node=1"])


def test_prefixes_are_wired_stage_to_stage() -> None:
    by_stage = jobs(render_documents(load_run_config(EXAMPLE_RUN)))
    run_prefix = "s3://dflash-example-bucket/runs/example"
    imp, gen, tok, train, export, evaluate, serve = (
        env_of(by_stage[s]["spec"]["template"]["spec"]["containers"][0])
        for s in ("import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"))
    assert imp["DFLASH_IMPORT_OUTPUT"] == gen["DFLASH_GENERATE_INPUT"] == f"{run_prefix}/prompts"
    assert gen["DFLASH_GENERATE_OUTPUT"] == tok["DFLASH_TOKENIZE_INPUT"] == f"{run_prefix}/completions"
    assert tok["DFLASH_TOKENIZE_OUTPUT"] == train["DFLASH_TRAIN_INPUT"] == f"{run_prefix}/tokenized"
    assert train["DFLASH_TRAIN_OUTPUT"] == export["DFLASH_EXPORT_DRAFTER"] == f"{run_prefix}/drafter"
    assert export["DFLASH_EXPORT_OUTPUT"] == evaluate["DFLASH_EVALUATE_DRAFTER"] == f"{run_prefix}/export"
    assert evaluate["DFLASH_EVALUATE_OUTPUT"] == serve["DFLASH_SERVE_CHECK_EVALUATION"] == f"{run_prefix}/evaluation"
    assert serve["DFLASH_SERVE_CHECK_OUTPUT"] == f"{run_prefix}/serving"
    assert (train["DFLASH_TRAIN_TARGET"] == gen["DFLASH_GENERATE_MODEL"] == tok["DFLASH_TOKENIZE_TOKENIZER"]
            == export["DFLASH_EXPORT_TARGET"] == evaluate["DFLASH_EVALUATE_TARGET"]
            == serve["DFLASH_SERVE_CHECK_TARGET"])
    # The driver creates each Job once the manifest its template names as input is committed; no pod waits.
    for stage, upstream in (("generate", "prompts"), ("tokenize", "completions"), ("train", "tokenized"),
                            ("export", "drafter"), ("evaluate", "export"), ("serve-check", "evaluation")):
        assert by_stage[stage]["metadata"]["annotations"]["dflash-pipeline/input"] == (
            f"{run_prefix}/{upstream}/manifest.json")
    assert "dflash-pipeline/input" not in by_stage["import"]["metadata"]["annotations"]
    assert all("initContainers" not in job["spec"]["template"]["spec"] for job in by_stage.values())
    # The CPU request bounds the tokenizer's worker processes (a pod sees all of the node's cores).
    assert tok["DFLASH_TOKENIZE_WORKERS"] == "4"


def test_rendered_output_holds_no_credentials(docs: list[dict[str, Any]]) -> None:
    assert not [d for d in docs if d["kind"] == "Secret"]
    for job in jobs(docs).values():
        for container in containers(job):
            names = set(env_of(container))
            assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
            assert container.get("envFrom", []) in ([], [{"secretRef": {"name": "dflash-s3"}}])
    text = dump_all(docs)
    assert "stringData" not in text and "secretKeyRef" not in text
    secret = example_secret(load_run_config(EXAMPLE_RUN))
    assert all(value.startswith(PLACEHOLDER) for value in secret["stringData"].values())


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("stages", "tokenize", "config", "max_lenght"), 1, "max_lenght not a field of dflash_tokenize"),
        (("stages", "train", "config", "max_lenght"), 1, "max_lenght not a field of dflash_train"),
        (("stages", "train", "config", "target"), "s3://x/y", "train.config.target is set by the pipeline"),
        (("stages", "train", "shards"), 2, "one process group, not shards"),
        (("stages", "evaluate", "config", "num_prompt"), 8, "num_prompt not a field of dflash_train.evaluate.config"),
        (("stages", "export", "config", "drafter"), "s3://x/y", "export.config.drafter is set by the pipeline"),
        (("stages", "generate", "nodes"), 2, "only a torchrun stage"),
        (("stages", "tokenize", "config", "input"), "s3://x/y", "tokenize.config.input is set by the pipeline"),
        (("stages", "import", "config", "num_shards"), 3, "shards come from stages.import.shards"),
        (("stages", "tokenize", "memory"), "16GB", "stages.tokenize.memory"),
        (("stages", "tokenize", "config", "hub_token"), "x", "looks like a credential"),
        (("stages", "generate", "env", "HF_TOKEN"), "x", "credentials and S3 settings"),
        (("stages", "generate", "env", "DFLASH_GENERATE_MODEL"), "x", "through `config`"),
        (("stages", "tokenize", "memory_limit"), "1Gi", "below the memory request"),
        (("run_id",), "Example_Run", "run_id"),
        (("root",), "/data/runs", "pods can only exchange data through s3://"),
        (("root",), "data/runs", "must be an s3://"),
        (("storage", "credentials"), "workload_identity", "choose one"),
    ],
)
def test_bad_run_files_are_refused_with_the_field_named(path: tuple[str, ...], value: Any, message: str) -> None:
    data = read_run_file(EXAMPLE_RUN)
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        render_documents(parse_run_config(data, "bad.toml"))


def test_a_partial_stage_table_keeps_the_stage_defaults() -> None:
    run = parse_run_config(example(stages={"generate": {"shards": 8}}))
    generate = run.stages.for_stage("generate")
    assert generate.shards == 8 and generate.gpus == 1 and generate.shm_size == "16Gi"
    assert run.stages.for_stage("tokenize").shards == 1


@pytest.mark.parametrize("folder", ["base", "namespace"])
def test_committed_base_is_what_the_renderer_makes(folder: str) -> None:
    run = load_run_config(EXAMPLE_RUN)
    expected = base_files(run, EXAMPLE_RUN.name, setup=folder != "base")
    committed = {p.name: p.read_text(encoding="utf-8") for p in (REPO_ROOT / "k8s" / folder).glob("*.yaml")}
    stale = sorted(set(committed) ^ set(expected)) or sorted(n for n in expected if committed[n] != expected[n])
    assert not stale, f"k8s/{folder} is out of date ({', '.join(stale)}); run make k8s-base"


def test_yaml_writer_round_trips_through_a_yaml_parser(docs: list[dict[str, Any]]) -> None:
    assert list(yaml.safe_load_all(dump_all(docs, ["header"]))) == docs
    tricky = {"k": ["yes", "no", "on", "null", "~", "", "1.0", "0x1F", "2024-01-01", "- a", "a: b", "#c",
                    "*x", "!t", "ünï ✓", "line\nbreak", 'q"uote', "/opt/x", "a/b.c-d_e", "64Gi", "500m"],
              "nvidia.com/gpu": 1, "f": 0.5, "t": True, "n": None, "e": {}, "l": [[1, 2], {"a": [{"b": 1}]}]}
    assert yaml.safe_load(dump_all([tricky])) == tricky


STAGE_IMAGES = sorted({s.image for s in (IMPORT_COMPLETIONS, IMPORT_PROMPTS, GENERATE, TOKENIZE, TRAIN, EXPORT,
                                         EVALUATE)
                       if (REPO_ROOT / "docker" / s.image / "Dockerfile").is_file()})


@pytest.mark.parametrize("image", STAGE_IMAGES)
def test_image_contract_matches_the_manifests(image: str) -> None:
    """The paths, user and entrypoint the Jobs rely on are the ones each stage image sets up."""
    ref = f"localhost/dflash-{image}:latest"
    env = image_env(ref)
    assert env["TMPDIR"] == SCRATCH_DIR and env["HOME"] == HOME_DIR
    assert IMAGE_ENTRYPOINT in image_files(ref)
    dockerfile = (REPO_ROOT / "docker" / image / "Dockerfile").read_text(encoding="utf-8")
    assert f"USER {RUN_AS}:{RUN_AS}" in dockerfile and f'ENTRYPOINT ["{IMAGE_ENTRYPOINT}"]' in dockerfile


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_pipeline", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=60, check=False)


@pytest.mark.slow
def test_render_and_submit_command_line(tmp_path: Path) -> None:
    as_json = _cli("render", "--config", str(EXAMPLE_RUN), "--format", "json", "--stage", "tokenize")
    assert as_json.returncode == 0, as_json.stderr
    decoder, text, found = json.JSONDecoder(), as_json.stdout, []
    while text.strip():
        doc, end = decoder.raw_decode(text.lstrip())
        found.append(doc)
        text = text.lstrip()[end:]
    driver = ["ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job"]
    assert [d["kind"] for d in found] == ["CronJob", *driver]
    assert found[0]["metadata"]["annotations"]["dflash-pipeline/job-name"] == "dflash-example-tokenize"

    # A stand-in for kubectl that records what it is given: submit must pipe exactly the rendered stream.
    fake = tmp_path / "fake-kubectl"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat > {tmp_path}/stdin\n', encoding="utf-8")
    fake.chmod(0o755)
    submitted = _cli("submit", "--config", str(EXAMPLE_RUN), "--kubectl", str(fake))
    rendered = _cli("render", "--config", str(EXAMPLE_RUN))
    dry = _cli("submit", "--config", str(EXAMPLE_RUN), "--dry-run")
    assert submitted.returncode == 0, submitted.stderr
    assert (tmp_path / "args").read_text().split() == ["apply", "-f", "-"]
    assert (tmp_path / "stdin").read_text() == rendered.stdout == dry.stdout
    assert [d["kind"] for d in yaml.safe_load_all(rendered.stdout)] == [*["CronJob"] * 7, *driver]
    # The namespace's one-time setup is its own stream, never part of the run's.
    setup = _cli("render", "--setup", "--config", str(EXAMPLE_RUN))
    assert setup.returncode == 0, setup.stderr
    assert [d["kind"] for d in yaml.safe_load_all(setup.stdout)] == ["Namespace", "ServiceAccount"]
    both = _cli("render", "--setup", "--stage", "train", "--config", str(EXAMPLE_RUN))
    assert both.returncode == ExitCode.USAGE and "leave out --stage" in both.stderr

    unknown = _cli("render", "--config", str(EXAMPLE_RUN), "--stage", "trian")
    assert unknown.returncode == ExitCode.USAGE and "unknown stage(s) trian" in unknown.stderr
    with pytest.raises(ConfigError, match="cannot read run config .*nope.toml"):
        load_run_config(tmp_path / "nope.toml")


@pytest.mark.slow
def test_render_out_writes_the_base_and_removes_stale_files(tmp_path: Path) -> None:
    (tmp_path / "job-old.yaml").write_text(f"# {GENERATED.format(config='old-run.toml')}\nkind: Job\n")
    (tmp_path / "mine.yaml").write_text("kind: Mine\n")
    done = _cli("render", "--config", str(EXAMPLE_RUN), "--out", str(tmp_path), env={**os.environ})
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in tmp_path.glob("*.yaml"))
    assert "job-old.yaml" not in names and "mine.yaml" in names and "cronjob-tokenize.yaml" in names
    driver_files = {"job-driver.yaml", "role-driver.yaml", "rolebinding-driver.yaml", "serviceaccount-driver.yaml"}
    assert driver_files <= set(names)
    assert {"configmap-run.yaml"} <= set(names) and "namespace.yaml" not in names
    kustomization = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert all((tmp_path / name).is_file() for name in kustomization["resources"])
    # The credentials example belongs to the namespace setup, and is written beside it, unlisted.
    assert "secret.example.yaml" not in names
    setup = _cli("render", "--setup", "--config", str(EXAMPLE_RUN), "--out", str(tmp_path / "ns"))
    assert setup.returncode == 0, setup.stderr
    listed = yaml.safe_load((tmp_path / "ns" / "kustomization.yaml").read_text())["resources"]
    assert listed == ["namespace.yaml", "serviceaccount.yaml"] and (tmp_path / "ns" / "secret.example.yaml").is_file()
