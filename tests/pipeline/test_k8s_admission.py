"""Admission in parts and placement hooks: Kueue partial admission of sharded stages, JobSet exclusive topology."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.run.config import read_run_file
from dflash_shared.errors import ConfigError
from tests.pipeline.crd_schema import crd_errors
from tests.pipeline.k8s_support import REPO_ROOT, jobs, schema_errors

HEADLINE_RUN = REPO_ROOT / "k8s" / "examples" / "qwen3.6-27b.toml"
MIN_PARALLELISM = "kueue.x-k8s.io/job-min-parallelism"


def headline(**stages: dict[str, Any]) -> list[dict[str, Any]]:
    data = read_run_file(HEADLINE_RUN)
    for name, settings in stages.items():
        data["stages"][name] = {**data["stages"].get(name, {}), **settings}
    return render_documents(parse_run_config(data))


def test_generate_may_be_admitted_with_the_gpus_that_are_free() -> None:
    docs = headline()
    generate = jobs(docs)["generate"]
    # Kueue may lower parallelism to 16 when 64 GPUs are not free; completions (the shards) stay 64.
    assert generate["metadata"]["annotations"][MIN_PARALLELISM] == "16"
    assert generate["spec"]["parallelism"] == generate["spec"]["completions"] == 64
    assert MIN_PARALLELISM not in jobs(docs)["tokenize"]["metadata"]["annotations"]
    assert schema_errors([generate]) == []


@pytest.mark.parametrize(("stage", "settings", "message"), [
    ("train", {"min_parallelism": 1}, "one process group; it cannot start with fewer pods"),
    ("train", {"max_failed_shards": 1}, "fails as a whole"),
    ("generate", {"min_parallelism": 65}, "min_parallelism 65 exceeds shards 64"),
    ("train", {"exclusive_topology": "cloud.google.com/gke-nodepool"}, "needs gang = \"jobset\""),
])
def test_what_a_gang_cannot_do_is_refused(stage: str, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        headline(**{stage: settings})


def test_a_jobset_gang_can_have_a_topology_domain_of_its_own() -> None:
    docs = headline(train={"gang": "jobset", "exclusive_topology": "cloud.google.com/gke-nodepool"})
    (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
    assert jobset["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool")
    assert crd_errors(jobset) == []


def test_the_example_admission_policy_is_valid_and_names_what_the_example_run_renders() -> None:
    import yaml

    from dflash_pipeline import load_run_config
    from dflash_pipeline.render.namespace_setup import setup_documents
    from tests.pipeline.k8s_support import EXAMPLE_RUN

    docs = list(yaml.safe_load_all((REPO_ROOT / "k8s" / "examples" / "admission-policy.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert schema_errors(docs) == []
    policy, binding = docs
    values = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    run = load_run_config(EXAMPLE_RUN)
    assert values["serviceAccount"] == f"'{run.storage.service_account}'"
    assert values["secret"] == f"'{run.storage.secret}'"
    # The binding selects the namespaces the setup labels.
    (namespace,) = [d for d in setup_documents(run) if d["kind"] == "Namespace"]
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
    assert selector.items() <= namespace["metadata"]["labels"].items()
    # The driver's account matches the policy's condition; the stages' account does not.
    import re

    (condition,) = policy["spec"]["matchConditions"]
    pattern = re.search(r"matches\('(.+)'\)", condition["expression"])
    assert pattern is not None
    assert re.match(pattern.group(1), "system:serviceaccount:dflash:dflash-example-driver")
    assert not re.match(pattern.group(1), "system:serviceaccount:dflash:dflash-pipeline")
