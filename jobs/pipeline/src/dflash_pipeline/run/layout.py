"""Where a run keeps its data: one prefix per stage output under <root>/<run_id>/, named by its manifest kind.

    s3://bucket/runs/<run_id>/prompts/       import (prompts source)      -> generate
    s3://bucket/runs/<run_id>/completions/   generate, or import (completions source) -> tokenize
    s3://bucket/runs/<run_id>/tokenized/     tokenize                     -> train
    s3://bucket/runs/<run_id>/drafter/       train                        -> export
    s3://bucket/runs/<run_id>/export/        export (a drafter manifest naming the serving files) -> evaluate
    s3://bucket/runs/<run_id>/evaluation/    evaluate                     -> serve-check
    s3://bucket/runs/<run_id>/serving/       serve-check (the evaluation with the engine's own tau)
    s3://bucket/runs/<run_id>/logs/<stage>/  each stage pod's log, <pod>.log (`dflash_shared.pod_log`)

Every prefix ends in a manifest.json written last; a stage's input is its upstream's manifest. The export
writes a second drafter manifest and the serving check a second evaluation manifest, so their prefixes are
named after the stage rather than the kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.storage import join

# The exported drafter: a drafter-kind manifest, beside the trained one under drafter/.
EXPORT_FOLDER = "export"
# The serving check's evaluation (offline figures plus the engine's), beside the offline one.
SERVING_FOLDER = "serving"
# The stage pods' logs, kept after their Jobs are deleted: logs/<stage>/<pod>.log.
LOGS_FOLDER = "logs"


# The run's folders that stages read and write, or keep their logs in: their prefixes are worked out once.
FOLDERS = (*(kind.value for kind in Kind), EXPORT_FOLDER, SERVING_FOLDER, LOGS_FOLDER)


@dataclass(frozen=True)
class RunLayout:
    """The prefixes of one run, by manifest kind, each worked out once (`layout`)."""

    run_prefix: str
    folders: Mapping[str, str]  # every name of FOLDERS -> <run>/<name>
    manifests: Mapping[str, str]  # every name of FOLDERS -> <run>/<name>/manifest.json

    def prefix(self, kind: Kind) -> str:
        return self.folders[kind.value]

    def folder(self, name: str) -> str:
        """The prefix <run>/<name> (a kind's value, `export`, or a folder of the run's own such as the driver's)."""
        return self.folders.get(name) or join(self.run_prefix, name)

    def manifest(self, kind: Kind) -> str:
        return self.manifests[kind.value]

    @property
    def prompts(self) -> str:
        return self.folders[Kind.prompts.value]

    @property
    def completions(self) -> str:
        return self.folders[Kind.completions.value]

    @property
    def tokenized(self) -> str:
        return self.folders[Kind.tokenized.value]

    @property
    def drafter(self) -> str:
        return self.folders[Kind.drafter.value]

    @property
    def export(self) -> str:
        return self.folders[EXPORT_FOLDER]

    @property
    def evaluation(self) -> str:
        return self.folders[Kind.evaluation.value]

    @property
    def serving(self) -> str:
        return self.folders[SERVING_FOLDER]

    def logs(self, stage: str | None = None) -> str:
        """Where the pods of `stage` keep their logs (all stages' without one)."""
        return join(self.folders[LOGS_FOLDER], stage) if stage else self.folders[LOGS_FOLDER]


def layout(root: str, run_id: str) -> RunLayout:
    """The one place prefixes are derived: <root>/<run_id>/<kind>."""
    run_prefix = join(root, run_id)
    folders = {name: join(run_prefix, name) for name in FOLDERS}
    return RunLayout(run_prefix, folders, {name: join(prefix, MANIFEST_NAME) for name, prefix in folders.items()})
