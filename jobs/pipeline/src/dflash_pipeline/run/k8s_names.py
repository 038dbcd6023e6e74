"""Kubernetes names a run file may set: label and annotation keys and values, extended resource names.

The schema validator checks neither label syntax nor quantities, so a bad key would only fail at `kubectl
apply`, or worse, be accepted and never match (a Kueue queue label with a typo is a Job that never starts).
These checks run when the run file is read, and each error names the offending key.

Keys under the project's own prefixes (`app.kubernetes.io/`, `dflash-pipeline/`) are refused: the overlays,
`pipeline status` and the rendezvous Service select pods by them. So are the keys the Job controller sets on
its pods (`batch.kubernetes.io/*`, `job-name`, `controller-uid`): the rendezvous Service selects by job-name.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

# The name part of a qualified name: 63 characters, alphanumeric at both ends, '-', '_' and '.' inside.
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# The prefix: a DNS subdomain (lowercase labels joined by dots), at most 253 characters.
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_NAME = 63
MAX_PREFIX = 253
# The API server refuses an object whose annotations (keys and values) exceed this many bytes together.
MAX_ANNOTATION_BYTES = 256 * 1024

PROJECT_PREFIXES = ("app.kubernetes.io", "dflash-pipeline")
CONTROLLER_PREFIXES = ("batch.kubernetes.io",)
CONTROLLER_KEYS = ("job-name", "controller-uid")
# Resources the pipeline renders from its own settings; an extra resource of this name would fight them.
NATIVE_RESOURCES = ("cpu", "memory", "ephemeral-storage", "storage")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes qualified name ([prefix/]name), or None when it is one."""
    if key.count("/") > 1:
        return "a key holds at most one '/'"
    prefix, slash, name = key.rpartition("/")
    if slash and not prefix:
        return "the prefix before '/' is empty"
    if slash and (len(prefix) > MAX_PREFIX or not _SUBDOMAIN.match(prefix)):
        return (f"the prefix {prefix!r} must be a DNS subdomain (lowercase letters, digits, '-' and '.', at most "
                f"{MAX_PREFIX} characters)")
    if not name or len(name) > MAX_NAME or not _NAME.match(name):
        return (f"the name {name!r} must be 1-{MAX_NAME} characters: letters, digits, '-', '_' and '.', beginning "
                "and ending with a letter or digit")
    return None


def reserved_problem(key: str) -> str | None:
    """Why `key` may not be set from a run file (the project's or the Job controller's own), or None."""
    prefix, _, _ = key.rpartition("/")
    if prefix in PROJECT_PREFIXES:
        return f"keys under {prefix}/ are the pipeline's own (the overlays and `pipeline status` select by them)"
    if prefix in CONTROLLER_PREFIXES or key in CONTROLLER_KEYS:
        return "the Job controller sets this key on its pods"
    return None


def _check_keys(values: dict[str, str], what: str) -> None:
    for key in values:
        problem = qualified_name_problem(key) or reserved_problem(key)
        if problem:
            raise ValueError(f"{what} key {key!r}: {problem}")


def _value_problem(value: str) -> str | None:
    if value and (len(value) > MAX_NAME or not _NAME.match(value)):
        return (f"the value {value!r} must be at most {MAX_NAME} characters of letters, digits, '-', '_' and '.', "
                "beginning and ending with a letter or digit (or empty)")
    return None


def _check_labels(values: dict[str, str]) -> dict[str, str]:
    _check_keys(values, "label")
    for key, value in values.items():
        if problem := _value_problem(value):
            raise ValueError(f"label {key!r}: {problem}")
    return values


def _check_label_value(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if problem := _value_problem(value):
        raise ValueError(problem)
    return value


def _check_annotations(values: dict[str, str]) -> dict[str, str]:
    _check_keys(values, "annotation")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in values.items())
    if size > MAX_ANNOTATION_BYTES:
        raise ValueError(f"annotations hold {size} bytes; the API server takes at most {MAX_ANNOTATION_BYTES}")
    return values


def _check_extra_resources(values: dict[str, int | str]) -> dict[str, int | str]:
    for name, count in values.items():
        if name in NATIVE_RESOURCES or name.startswith("hugepages-"):
            raise ValueError(f"extra resource {name!r} is not an extended resource; set it with the stage's own "
                             "settings (cpu, memory, scratch_size) instead")
        prefix, slash, _ = name.rpartition("/")
        problem = qualified_name_problem(name)
        if problem is None and not slash:
            problem = "an extended resource name needs a domain prefix (e.g. 'rdma/ib', 'nvidia.com/mig-1g.10gb')"
        if problem is None and (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io")):
            problem = "the kubernetes.io domain is reserved for Kubernetes' own resources"
        if problem:
            raise ValueError(f"extra resource {name!r}: {problem}")
        # Extended resources are whole devices and cannot be overcommitted: requests equal limits, integers.
        text = str(count)
        if not re.fullmatch(r"[1-9][0-9]*", text):
            raise ValueError(f"extra resource {name!r}: the count {count!r} must be a whole number of at least 1")
    return values


LabelMap = Annotated[dict[str, str], AfterValidator(_check_labels)]
AnnotationMap = Annotated[dict[str, str], AfterValidator(_check_annotations)]
ExtraResources = Annotated[dict[str, int | str], AfterValidator(_check_extra_resources)]
# A name that is rendered as a label value (Kueue's queue and priority class names).
LabelValue = Annotated[str, AfterValidator(_check_label_value)]
