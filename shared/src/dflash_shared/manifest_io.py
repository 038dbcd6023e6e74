"""Reading and writing manifests with every check a stage boundary needs.

`load_manifest` refuses, with one message naming the exact field, a manifest that is missing, of another
schema version or kind, malformed, pointing at shards whose bytes no longer match their checksums, or made
for a different target/tokenizer/template/thinking mode than the reading stage is configured for. Doing
this before loading a 27B model or starting 1,000 pods is the cheapest bug fix there is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast, overload

from pydantic import ValidationError

from dflash_shared.manifests import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    CompletionsSection,
    DrafterSection,
    EvaluationSection,
    InputRef,
    Kind,
    Manifest,
    PromptsSection,
    TokenizedSection,
)
from dflash_shared.storage import ObjectStore, StorageError, join, relative_location, resolve_location

log = logging.getLogger(__name__)


class ManifestError(ValueError):
    """A manifest cannot be used; `field` names what disagrees when one field is to blame."""

    def __init__(self, uri: str, message: str, field: str | None = None) -> None:
        self.uri = uri
        self.field = field
        super().__init__(f"manifest {uri}: {message}")


AnySection = PromptsSection | CompletionsSection | TokenizedSection | DrafterSection | EvaluationSection
SectionT = TypeVar("SectionT", bound=AnySection, covariant=True)


@dataclass(frozen=True)
class LoadedManifest(Generic[SectionT]):
    """A manifest read and checked; `section` is typed by the kind it was loaded as (`load_manifest`'s overloads)."""

    uri: str
    sha256: str
    manifest: Manifest

    @property
    def section(self) -> SectionT:
        # load_manifest refused any other kind, and the manifest's own validator ties kind to the section's type.
        return cast(SectionT, self.manifest.section)

    def as_input(self) -> InputRef:
        """How an output manifest names this one among its inputs (lineage)."""
        return InputRef(uri=self.uri, sha256=self.sha256, kind=self.manifest.kind)


def manifest_uri(prefix_or_uri: str) -> str:
    """Accept either a stage prefix or the manifest URI itself."""
    return prefix_or_uri if prefix_or_uri.endswith(".json") else join(prefix_or_uri, MANIFEST_NAME)


def committed(store: ObjectStore, output: str, stage: str, given: Mapping[str, object] | None = None) -> str | None:
    """The output's manifest URI when it exists (the stage's output is committed: a rerun does nothing), else None.

    The one "already done" test of every single-manifest stage: the CLI entry (dflash_shared.commands) asks it
    before any work, and each stage's run asks it again for callers that use the run function directly. With
    `given` (the settings this process runs with) a committed output whose manifest records other values is
    named in a warning, with the ways to redo it: the output stays as it was made."""
    done = manifest_uri(output)
    if not store.exists(done):
        return None
    log.info("%s exists: %s is committed, nothing to do", done, stage)
    if given is not None and (changed := recorded_otherwise(store, done, given)):
        log.warning("%s: its committed output was made with other settings than this run's (%s), and stays as it was. "
                    "To make it with these: write to a new output prefix (a new run_id), or delete %s and the later "
                    "stages' outputs, which were made from it, and run again", stage, "; ".join(changed), output)
    return done


def recorded_otherwise(store: ObjectStore, manifest: str, given: Mapping[str, object]) -> list[str]:
    """Each of the `given` settings whose value the committed manifest's producer records otherwise ("max_steps 400
    there, 707 now"); a setting the manifest does not record is not compared. A nested setting is given whole or
    as `parent__child` (the run file's and the environment's spelling)."""
    try:
        recorded = json.loads(store.read_bytes(manifest))["producer"]["config"]
    except (KeyError, TypeError, ValueError) as err:
        log.warning("%s: no settings recorded to compare with this run's (%s)", manifest, err)
        return []
    changed = []
    for key, now in sorted(given.items()):
        there: object = recorded
        for part in key.split("__"):
            there = there.get(part, _NOT_RECORDED) if isinstance(there, dict) else _NOT_RECORDED
        if there is not _NOT_RECORDED and _canonical(there) != _canonical(now):
            changed.append(f"{key} {_canonical(there)} there, {_canonical(now)} now")
    return changed


_NOT_RECORDED = object()


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _map_locations(manifest: Manifest, move: Callable[[str], str]) -> Manifest:
    """The manifest with every location it names (shards, inputs, the section's *_uri fields) passed through `move`."""
    section_updates: dict[str, Any] = {
        name: move(value)
        for name, value in manifest.section
        if name.endswith("_uri") and isinstance(value, str)
    }
    return manifest.model_copy(
        update={
            "shards": [s.model_copy(update={"uri": move(s.uri)}) for s in manifest.shards],
            "inputs": [i.model_copy(update={"uri": move(i.uri)}) for i in manifest.inputs],
            "section": manifest.section.model_copy(update=section_updates),
        }
    )


def manifest_prefix(uri: str) -> str:
    """The prefix a manifest's relative locations are resolved against: the folder holding it."""
    return posixpath.dirname(uri) or "."


def parse_manifest(uri: str, raw: bytes) -> Manifest:
    """Validate a manifest's bytes; relative locations come back resolved against where it was read."""
    manifest = _validate(uri, raw)
    prefix = manifest_prefix(uri)
    return _map_locations(manifest, lambda ref: resolve_location(prefix, ref))


def _validate(uri: str, raw: bytes) -> Manifest:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(uri, f"is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ManifestError(uri, "is not a JSON object")
    # Checked before model validation so an old or newer manifest gets a version message, not 20 field errors.
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ManifestError(
            uri, f"schema_version is {version!r}, this build reads {SCHEMA_VERSION}", field="schema_version"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ManifestError(uri, f"field {field!r}: {first['msg']}", field=field) from err


def lookup(manifest: Manifest, path: str) -> Any:
    """Resolve a dotted path against the manifest's section (e.g. 'target.tokenizer_sha256')."""
    node: Any = manifest.section
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return None
    return node


def check_compatible(uri: str, manifest: Manifest, expected: Mapping[str, Any]) -> None:
    """Each key of `expected` is a dotted path into the section; None values are not checked."""
    for path, want in expected.items():
        if want is None:
            continue
        have = lookup(manifest, path)
        if have != want:
            raise ManifestError(
                uri,
                f"{manifest.kind.value} manifest has {path} = {have!r}, but this stage is configured "
                f"with {want!r}",
                field=path,
            )


def verify_shards(uri: str, manifest: Manifest, store: ObjectStore, workers: int = 8) -> None:
    """Re-hash every shard; any missing or changed object fails the load with its URI."""

    def check(shard: Any) -> None:
        try:
            size = store.size(shard.uri)
        except StorageError as err:
            raise ManifestError(uri, f"shard {shard.uri} cannot be read: {err}", field="shards") from err
        if size != shard.bytes:
            raise ManifestError(
                uri, f"shard {shard.uri} has {size} bytes, the manifest says {shard.bytes}", field="shards"
            )
        digest = store.sha256(shard.uri)
        if digest != shard.sha256:
            raise ManifestError(
                uri,
                f"shard {shard.uri} sha256 is {digest}, the manifest says {shard.sha256} (corrupted or replaced)",
                field="shards",
            )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(check, manifest.shards))


@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Literal[Kind.prompts],
                  expected: Mapping[str, Any] | None = ..., verify: bool = ...) -> LoadedManifest[PromptsSection]: ...
@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Literal[Kind.completions],
                  expected: Mapping[str, Any] | None = ...,
                  verify: bool = ...) -> LoadedManifest[CompletionsSection]: ...
@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Literal[Kind.tokenized],
                  expected: Mapping[str, Any] | None = ..., verify: bool = ...) -> LoadedManifest[TokenizedSection]: ...
@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Literal[Kind.drafter],
                  expected: Mapping[str, Any] | None = ..., verify: bool = ...) -> LoadedManifest[DrafterSection]: ...
@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Literal[Kind.evaluation],
                  expected: Mapping[str, Any] | None = ...,
                  verify: bool = ...) -> LoadedManifest[EvaluationSection]: ...
@overload
def load_manifest(store: ObjectStore, prefix_or_uri: str, kind: Kind,
                  expected: Mapping[str, Any] | None = ..., verify: bool = ...) -> LoadedManifest[AnySection]: ...


def load_manifest(
    store: ObjectStore,
    prefix_or_uri: str,
    kind: Kind,
    expected: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> LoadedManifest[Any]:
    """The manifest of `kind` at a prefix, checked (see the module's docstring); its `section` has that kind's type."""
    uri = manifest_uri(prefix_or_uri)
    try:
        raw = store.read_bytes(uri)
    except StorageError as err:
        raise ManifestError(uri, f"cannot be read ({err}); has the producing stage finished?") from err
    manifest = parse_manifest(uri, raw)
    if manifest.kind != kind:
        raise ManifestError(uri, f"is a {manifest.kind.value} manifest, expected {kind.value}", field="kind")
    check_compatible(uri, manifest, expected or {})
    if verify:
        verify_shards(uri, manifest, store)
    return LoadedManifest(uri=uri, sha256=hashlib.sha256(raw).hexdigest(), manifest=manifest)


def write_manifest(store: ObjectStore, prefix: str, manifest: Manifest) -> tuple[str, bool]:
    """Write the manifest exactly once; returns (uri, created). A second writer does not overwrite.

    Locations inside the run root are written relative to `prefix`, so the manifest stays valid wherever
    the run root is moved or read from; `parse_manifest` resolves them back.
    """
    portable = _map_locations(manifest, lambda location: relative_location(prefix, location))
    uri = join(prefix, MANIFEST_NAME)
    return uri, store.put_if_absent(uri, portable.to_json())
