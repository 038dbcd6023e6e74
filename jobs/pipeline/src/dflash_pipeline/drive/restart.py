"""`pipeline restart --config RUN --stage NAME`: start a stage's output over, with every later stage's.

An output holds the work of one configuration (`dflash_shared.stage_identity`): a shard or a resume under other
settings than the output was made with refuses (exit 64) and names this command as the way to start over under
the new ones. It deletes the stage's output prefix and the output prefix of every stage after it in the run
(their manifests name the deleted one as their input, so they would describe data that no longer exists);
nothing else of the run (its pods' logs, the run driver's state) and nothing outside it.

Each prefix loses its manifest first, so a reader never finds a committed output whose data is going: an
interrupted restart leaves prefixes without manifests, which the stages redo, and running the command again
finishes it. Stop the run's Jobs of those stages first (a pod still writing would leave its shard behind):
`cancel` stops the whole run; the run driver then recreates each stage when the run is submitted again, and
`local` reruns them directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import selected_stages
from dflash_shared.errors import ConfigError
from dflash_shared.manifests import MANIFEST_NAME
from dflash_shared.storage import ObjectStore, join

log = logging.getLogger("dflash.pipeline.restart")


@dataclass(frozen=True)
class Cleared:
    """One stage's output prefix and the objects deleted from it (or that would be, in a dry run)."""

    stage: str
    prefix: str
    objects: int


def restart_prefixes(run: RunConfig, stage: str) -> list[tuple[str, str]]:
    """(stage, output prefix) of `stage` and every stage after it, upstream first; one prefix once."""
    stages = selected_stages(run)
    names = [s.name for s in stages]
    if stage not in names:
        raise ConfigError(f"restart --stage {stage}: this run has the stages {', '.join(names)}")
    lay = layout(run.root, run.run_id)
    out: list[tuple[str, str]] = []
    for each in stages[names.index(stage):]:
        prefix = each.output_prefix(lay)
        if prefix not in (p for _, p in out):
            out.append((each.name, prefix))
    return out


def restart_stage(store: ObjectStore, run: RunConfig, stage: str, *, dry_run: bool = False) -> list[Cleared]:
    """Delete the outputs of `stage` and the stages after it (see the module docstring)."""
    cleared = []
    for name, prefix in restart_prefixes(run, stage):
        manifest = join(prefix, MANIFEST_NAME)
        objects = store.list(prefix)
        if not dry_run:
            # The commit point first: the prefix stops being a stage output before its data goes.
            for uri in sorted(objects, key=lambda u: u != manifest):
                store.delete(uri)
        log.info("%s %d object(s) under %s (%s)", "would delete" if dry_run else "deleted", len(objects), prefix,
                 name)
        cleared.append(Cleared(name, prefix, len(objects)))
    return cleared
