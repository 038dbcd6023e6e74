"""One configuration per output: the settings a stage's output is made with, and the check that refuses others.

An output prefix holds the work of many processes: the shards of an Indexed Job, the attempts of each, a train
run and its resumes. Each records what it ran with, its `StageIdentity`: the stage's effective settings (the
resolved config, secrets masked, less the fields that may differ between those processes) and the image. A
process whose identity differs from the one recorded refuses before it does any work, with a ConfigError (exit
64) that names every field that differs, both values and the two ways out. So a prefix, and the manifest that
commits it, hold the work of one configuration, which the manifest records (`Producer.settings_sha256`).

Left out for every stage (`NOT_SETTINGS`), because they differ between the processes of one output by design
or change no byte of it:

- shard_index, num_shards: the share a process takes. The count is part of an output's identity all the same:
  the runner refuses another count by the marker names, with its own message.
- output: where the records live, the same prefix by construction; a run root that is moved, or read from
  another working directory, still matches.
- scratch_dir, disk_need_gib: a node's local disk, and how much of it preflight asks for.
- max_bad_fraction: it decides whether a shard passes, not what a passing shard writes (a shard that fails
  writes no marker), so raising it after a failed gate and running again is allowed; the manifest's gate is
  judged over every shard with the finishing process's value, which the manifest records.

Each stage leaves out a few of its own (processes and threads, engine sizing, the cadence of logs and
checkpoints), listed beside its config with the reason. The image comes from DFLASH_IMAGE, which every stage
image sets to its reference (`provenance.IMAGE_ENV`); outside an image it is None and only the settings count.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflash_shared.errors import ConfigError
from dflash_shared.provenance import IMAGE_ENV
from dflash_shared.settings import public_dict

NOT_SETTINGS = frozenset({"shard_index", "num_shards", "output", "scratch_dir", "disk_need_gib", "max_bad_fraction"})
_ABSENT = object()


class StageIdentity(BaseModel):
    """What one process of a stage ran with: recorded in every shard marker and train checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settings: dict[str, Any] = Field(description="The effective settings: the resolved config less NOT_SETTINGS "
                                     "and the stage's own exclusions, secrets masked.")
    image: str | None = Field(default=None, description="The image reference (DFLASH_IMAGE); None outside one.")
    sha256: str = Field(description="sha256 of the settings and the image, as canonical JSON.")


def _digest(settings: Mapping[str, Any], image: str | None) -> str:
    canonical = json.dumps({"settings": settings, "image": image}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def stage_identity(config: BaseModel, exclude: Iterable[str] = (), image: str | None | object = _ABSENT
                   ) -> StageIdentity:
    """The identity of a process running `config`: its public settings less NOT_SETTINGS and `exclude`."""
    left_out = NOT_SETTINGS | frozenset(exclude)
    settings = {k: v for k, v in public_dict(config).items() if k not in left_out}
    ref = (os.environ.get(IMAGE_ENV) or None) if image is _ABSENT else image
    assert ref is None or isinstance(ref, str)
    return StageIdentity(settings=settings, image=ref, sha256=_digest(settings, ref))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted leaves ({"drafter": {"block_size": 16}} -> {"drafter.block_size": 16})."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


@dataclass(frozen=True)
class Difference:
    """One setting that differs: its dotted name, the recorded value and the value now (_ABSENT: not set)."""

    field: str
    recorded: Any
    now: Any

    def describe(self, labels: tuple[str, str] = ("there", "now")) -> str:
        def shown(value: Any) -> str:
            return "(not set)" if value is _ABSENT else json.dumps(value, ensure_ascii=False)

        return f"{self.field} {shown(self.recorded)} {labels[0]}, {shown(self.now)} {labels[1]}"


def differences(recorded: StageIdentity, now: StageIdentity) -> list[Difference]:
    """The settings (and the image) that differ, by dotted field name."""
    if recorded.sha256 == now.sha256:
        return []
    before, after = _flatten(recorded.settings), _flatten(now.settings)
    found = [Difference(name, before.get(name, _ABSENT), after.get(name, _ABSENT))
             for name in sorted(set(before) | set(after)) if before.get(name, _ABSENT) != after.get(name, _ABSENT)]
    if recorded.image != now.image:
        found.append(Difference("image", recorded.image, now.image))
    return found


class SettingsChangedError(ConfigError):
    """A process was started with other settings than an output it continues was made with (exit 64)."""

    def __init__(self, message: str, changed: list[Difference]) -> None:
        super().__init__(message)
        self.changed = changed


def refuse_changed(recorded: StageIdentity | None, now: StageIdentity, head: str, ways_out: str,
                   labels: tuple[str, str] = ("there", "now")) -> None:
    """Raise SettingsChangedError unless `now` is the identity `recorded` (None: recorded before identities were).

    `head` opens the message ("s3://b/r/completions (marker shard-00000-of-00002.json) was made with other
    settings");
    `ways_out` says how to start over under the new settings, after the common first way out (restore them);
    `labels` name the two values in the message.
    """
    if recorded is None:
        return
    changed = differences(recorded, now)
    if not changed:
        return
    what = "this setting" if len(changed) == 1 else "these settings"
    raise SettingsChangedError(
        f"{head}: {'; '.join(d.describe(labels) for d in changed)}. An output holds the "
        f"work of one configuration: restore {what} and run again, or start over under the new ones: {ways_out}",
        changed,
    )
