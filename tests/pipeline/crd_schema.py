"""Offline validation of a custom resource against its CustomResourceDefinition's openAPIV3Schema, strictly.

A CRD's schema is OpenAPI v3 with Kubernetes extensions. The API server prunes (drops) unknown fields of a
structural schema unless `x-kubernetes-preserve-unknown-fields` says otherwise, so a misspelt field is lost
without an error; here every object schema that lists its properties gets `additionalProperties: false`
instead, and the misspelling fails the test. `x-kubernetes-int-or-string` becomes "integer or string";
CEL rules (`x-kubernetes-validations`) are not evaluated (they need the API server's CEL environment).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
JOBSET_CRD = SCHEMAS / "jobset.x-k8s.io_jobsets-v0.12.0.yaml"


def strict(schema: Any) -> Any:
    """The schema as JSON Schema that refuses fields the CRD does not declare."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(path: Path, version: str) -> jsonschema.Draft7Validator:
    # libyaml's loader where PyYAML has it: the CRD is 800 KB, which the pure-Python loader takes ~0.5 s over.
    crd = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(served["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict[str, Any], path: Path = JOBSET_CRD) -> list[str]:
    """Every schema error of `doc` against the CRD version its apiVersion names, as readable lines."""
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    errors = crd_validator(path, version).iter_errors(doc)
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '(document)'}: {e.message}" for e in errors)
