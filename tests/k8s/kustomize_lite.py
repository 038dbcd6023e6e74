"""A test aid, NOT kustomize: builds the overlays in k8s/ with the few kustomize features they use.

No kustomize binary exists where the tests run, so this applies exactly the subset the overlays are
written in, as kustomize documents it, and refuses everything else so an overlay cannot quietly start
depending on a feature nobody tested:

- `resources`: files, or directories holding a kustomization.yaml (applied recursively);
- `images`: name -> newName / newTag / digest, on every container and init container of pod templates;
- `patches` with a `target` (group, version, kind, name, labelSelector with k=v terms) and a JSON 6902
  patch (a YAML list of add / remove / replace / test operations); a patch must match at least one
  object, and a failing `test` operation fails the build.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}
TARGET_KEYS = {"group", "version", "kind", "name", "labelSelector"}


class KustomizeLiteError(AssertionError):
    """The overlay uses something this aid does not implement, or a patch does not apply."""


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeLiteError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError) as err:
            raise KustomizeLiteError(f"path {path} does not exist (at {part!r})") from err
    return node


def apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/remove/replace/test on a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        parts = _pointer(path)
        parent, last = _parent(doc, parts, path), parts[-1]
        if kind == "test":
            actual = parent[int(last)] if isinstance(parent, list) else parent.get(last, KeyError)
            if actual != op["value"]:
                raise KustomizeLiteError(f"test failed at {path}: expected {op['value']!r}, found {actual!r}")
        elif kind == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind in ("remove", "replace"):
            if isinstance(parent, list):
                if not last.isdigit() or int(last) >= len(parent):
                    raise KustomizeLiteError(f"{kind}: no element at {path}")
            elif last not in parent:
                raise KustomizeLiteError(f"{kind}: nothing at {path}")
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            else:
                parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        else:
            raise KustomizeLiteError(f"JSON 6902 op {kind!r} is not implemented by this test aid")
    return doc


def _matches(doc: dict[str, Any], target: dict[str, Any]) -> bool:
    unknown = set(target) - TARGET_KEYS
    if unknown:
        raise KustomizeLiteError(f"patch target keys {sorted(unknown)} are not implemented by this test aid")
    group, _, version = doc["apiVersion"].rpartition("/")
    checks = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    if any(key in target and target[key] != value for key, value in checks.items()):
        return False
    labels = doc["metadata"].get("labels", {})
    for term in filter(None, target.get("labelSelector", "").split(",")):
        key, sep, value = term.partition("=")
        if not sep or value.startswith("="):
            raise KustomizeLiteError(f"label selector term {term!r}: only k=v is implemented")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    head, _, tag = name.rpartition(":")
    if head and "/" not in tag:
        return head, tag, digest or None
    return name, None, digest or None


def _set_images(doc: dict[str, Any], images: list[dict[str, Any]]) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        name, tag, digest = _split_image(container["image"])
        for rule in images:
            unknown = set(rule) - {"name", "newName", "newTag", "digest"}
            if unknown:
                raise KustomizeLiteError(f"images keys {sorted(unknown)} are not implemented by this test aid")
            if rule["name"] == name:
                name = rule.get("newName", name)
                tag = str(rule.get("newTag", tag)) if "newTag" in rule or tag else None
                digest = rule.get("digest", digest)
                container["image"] = name + (f":{tag}" if tag and not digest else "") + (
                    f"@{digest}" if digest else "")
                break


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k directory` would send, for the supported subset."""
    kfile = directory / "kustomization.yaml"
    (config,) = _load_docs(kfile)
    unknown = set(config) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeLiteError(f"{kfile}: {sorted(unknown)} not implemented by this test aid")
    docs: list[dict[str, Any]] = []
    for resource in config.get("resources", []):
        path = (directory / resource).resolve()
        docs.extend(build(path) if path.is_dir() else _load_docs(path))
    for doc in docs:
        _set_images(doc, config.get("images", []))
    for patch in config.get("patches", []):
        if set(patch) - {"path", "patch", "target"} or "target" not in patch:
            raise KustomizeLiteError(f"{kfile}: patch {patch} needs path or patch, and a target")
        ops = yaml.safe_load(patch["patch"]) if "patch" in patch else yaml.safe_load(
            (directory / patch["path"]).read_text(encoding="utf-8"))
        if not isinstance(ops, list):
            raise KustomizeLiteError(f"{kfile}: {patch} is a strategic-merge patch; only JSON 6902 is implemented")
        hits = [i for i, doc in enumerate(docs) if _matches(doc, patch["target"])]
        if not hits:
            raise KustomizeLiteError(f"{kfile}: patch {patch.get('path', '(inline)')} matches no object")
        for i in hits:
            docs[i] = apply_json6902(docs[i], ops)
    return docs
