"""Multi-node training as a JobSet (`[stages.train] gang = "jobset"`): validated offline against JobSet's CRD
(tests/pipeline/schemas, strict), its child Job against Kubernetes' own schemas, and its failure policy evaluated
the way the Job and JobSet controllers would for each way a pod of the gang can fail."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.render.base import base_files
from dflash_pipeline.render.rendezvous import RENDEZVOUS_PORT
from dflash_pipeline.run.config import read_run_file
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from tests.pipeline.crd_schema import crd_errors
from tests.pipeline.k8s_support import EXAMPLE_RUN, failure_action, schema_errors

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def run_data(**train: Any) -> dict[str, Any]:
    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], "nodes": 4, "gpus": 8, "gang": "jobset", **train}
    return data


def jobset_of(data: dict[str, Any]) -> dict[str, Any]:
    (jobset,) = [d for d in render_documents(parse_run_config(data, "jobset run")) if d["kind"] == "JobSet"]
    return jobset


def replicated(jobset: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def as_job(jobset: dict[str, Any], name: str) -> dict[str, Any]:
    """The child Job the JobSet controller creates from a replicatedJob (job index 0)."""
    template = replicated(jobset)[name]["template"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-{name}-0",
                         "namespace": jobset["metadata"]["namespace"], **template["metadata"]},
            "spec": template["spec"]}


def jobset_action(jobset: dict[str, Any], replicated_job: str, reason: str, message: str = "") -> str:
    """The JobSet controller's choice for a failed child Job: the first rule matching its replicatedJob, failure
    reason and message (regular expressions, searched as Go's regexp.MatchString does); RestartJobSet if none."""
    for rule in jobset["spec"]["failurePolicy"].get("rules", []):
        if rule.get("targetReplicatedJobs") and replicated_job not in rule["targetReplicatedJobs"]:
            continue
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return str(rule["action"])
    return "RestartJobSet"


def exit_message(code: int) -> str:
    """The Job controller's failure message for a pod that matched a FailJob rule on its exit code."""
    return f"Container train for pod dflash/dflash-example-train-node-0-1-x7k2p failed with exit code {code} " \
           "matching FailJob rule at index 0"


def test_the_jobset_matches_the_jobset_crd_strictly_and_its_jobs_the_kubernetes_schemas() -> None:
    jobset = jobset_of(run_data())
    assert crd_errors(jobset) == []
    assert schema_errors([as_job(jobset, "node"), as_job(jobset, "wait-for-input")]) == []
    # The validation is strict: a misspelt field anywhere is an error, not silently pruned.
    broken = {**jobset, "spec": {**jobset["spec"], "failurePolcy": {}}}
    assert crd_errors(broken) == ["spec: Additional properties are not allowed ('failurePolcy' was unexpected)"]


def test_a_multi_node_jobset_replaces_the_job_and_its_service() -> None:
    docs = render_documents(parse_run_config(run_data(), "jobset run"))
    kinds = [(d["kind"], d["metadata"]["labels"].get("app.kubernetes.io/component")) for d in docs]
    assert ("JobSet", "train") in kinds and ("Service", "train") not in kinds
    jobset = jobset_of(run_data())
    name = jobset["metadata"]["name"]
    node = replicated(jobset)["node"]
    spec = node["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]["spec"]
    # JobSet's own headless Service, named after the JobSet (the subdomain's default); pod 0 of the node Job is
    # <jobset>-node-0-0.<jobset>, both from the JobSet's name as the pod's label gives it, so a namePrefix
    # overlay that renames the JobSet renames the endpoint with it.
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert "subdomain" not in pod
    args = pod["containers"][0]["args"]
    assert f"--rdzv-endpoint=$(JOBSET_NAME)-node-0-0.$(JOBSET_NAME):{RENDEZVOUS_PORT}" in args
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["JOBSET_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}}
    assert "RENDEZVOUS_SERVICE" not in env and name == "dflash-example-train"
    assert "--nnodes=4" in args and "--nproc-per-node=8" in args and "--node-rank=$(JOB_COMPLETION_INDEX)" in args
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    # No GPU pod before the data: the gang's Job is created once the wait Job has completed.
    assert node["dependsOn"] == [{"name": "wait-for-input", "status": "Complete"}]
    wait = replicated(jobset)["wait-for-input"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert wait["command"][:4] == ["dflash-pipeline", "wait", "--manifest", f"{data_root()}/tokenized/manifest.json"]
    assert "nvidia.com/gpu" not in wait["resources"].get("limits", {})
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}


def data_root() -> str:
    return f"{read_run_file(EXAMPLE_RUN)['root'].rstrip('/')}/example"


@pytest.mark.parametrize(
    ("code", "child_action", "reason", "expected"),
    [
        (int(ExitCode.BAD_INPUT), "FailJob", "PodFailurePolicy", "FailJobSet"),
        (int(ExitCode.USAGE), "FailJob", "PodFailurePolicy", "FailJobSet"),
        (int(ExitCode.PREEMPTED), "FailJob", "PodFailurePolicy", "RestartJobSetAndIgnoreMaxRestarts"),
        # A rank's own retryable failure: the pod counts, backoffLimit 0 fails the Job, the gang restarts.
        (int(ExitCode.RETRYABLE), "Count", "BackoffLimitExceeded", "RestartJobSet"),
        (int(ExitCode.ENVIRONMENT), "Count", "BackoffLimitExceeded", "RestartJobSet"),
    ],
)
def test_each_pod_failure_fails_the_child_job_and_the_jobset_restarts_or_fails_the_whole_gang(
    code: int, child_action: str, reason: str, expected: str
) -> None:
    jobset = jobset_of(run_data())
    node = as_job(jobset, "node")
    assert node["spec"]["backoffLimit"] == 0 and "backoffLimitPerIndex" not in node["spec"]
    assert failure_action(node, code) == child_action
    assert jobset_action(jobset, "node", reason, exit_message(code) if child_action == "FailJob" else "") == expected


def test_disruptions_deadlines_and_a_wait_that_never_ends() -> None:
    jobset = jobset_of(run_data(retries_per_shard=5))
    node = as_job(jobset, "node")
    assert failure_action(node, condition="DisruptionTarget") == "FailJob"
    disrupted = "Pod dflash/dflash-example-train-node-0-2-abcde has condition DisruptionTarget matching FailJob " \
                "rule at index 1"
    assert jobset_action(jobset, "node", "PodFailurePolicy", disrupted) == "RestartJobSetAndIgnoreMaxRestarts"
    assert jobset_action(jobset, "node", "DeadlineExceeded") == "FailJobSet"
    assert jobset_action(jobset, "wait-for-input", "PodFailurePolicy", exit_message(65)) == "FailJobSet"
    assert jobset_action(jobset, "wait-for-input", "BackoffLimitExceeded") == "FailJobSet"
    wait = as_job(jobset, "wait-for-input")
    assert failure_action(wait, int(ExitCode.ENVIRONMENT)) == "FailJob" and failure_action(wait, 1) == "Count"
    policy = jobset["spec"]["failurePolicy"]
    # The old gang is gone before the new one starts: a checkpoint never has two sets of writers.
    assert policy["maxRestarts"] == 5 and policy["restartStrategy"] == "BlockingRecreate"


def test_kueue_admits_the_jobset_as_one_workload() -> None:
    data = run_data()
    data["scheduling"] = {**data.get("scheduling", {}), "queue_name": "gpu-team"}
    jobset = jobset_of(data)
    assert jobset["metadata"]["labels"][QUEUE_LABEL] == "gpu-team"
    for name in ("node", "wait-for-input"):
        assert QUEUE_LABEL not in replicated(jobset)[name]["template"]["metadata"]["labels"]
    assert crd_errors(jobset) == []


def test_the_base_lists_the_jobset_file() -> None:
    files = base_files(parse_run_config(run_data()), "multi-node.toml")
    assert "jobset-train.yaml" in files and "- jobset-train.yaml" in files["kustomization.yaml"]
    assert "service-train.yaml" not in files


@pytest.mark.parametrize(
    ("stage", "settings", "message"),
    [
        ("train", {"nodes": 1, "gpus": 8}, r'stages.train.gang = "jobset" with nodes = 1'),
        ("tokenize", {"gang": "jobset"}, r'stages.tokenize.gang = "jobset": only a torchrun stage'),
    ],
)
def test_a_jobset_where_it_makes_no_sense_is_refused(stage: str, settings: dict[str, Any], message: str) -> None:
    data = run_data()
    data["stages"][stage] = {**data["stages"][stage], **settings}
    with pytest.raises(ConfigError, match=message):
        render_documents(parse_run_config(data))


def test_the_default_stays_the_indexed_job() -> None:
    data = run_data()
    del data["stages"]["train"]["gang"]
    docs = render_documents(parse_run_config(data))
    assert not [d for d in docs if d["kind"] == "JobSet"]
    assert [d for d in docs if d["kind"] == "Service"]


def test_every_pod_of_the_jobset_pulls_with_the_run_files_pull_secrets() -> None:
    # The wait pod pulls the orchestration image from the same private registry as the gang's pods: without the
    # secret it would sit in ImagePullBackOff and the gang would never start.
    data = run_data()
    data["images"]["pull_secrets"] = ["regcred"]
    jobs = replicated(jobset_of(data))
    for name, job in jobs.items():
        spec = job["template"]["spec"]["template"]["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], name
