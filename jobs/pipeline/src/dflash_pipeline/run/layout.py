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

from dataclasses import dataclass

from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.storage import join

# The exported drafter: a drafter-kind manifest, beside the trained one under drafter/.
EXPORT_FOLDER = "export"
# The serving check's evaluation (offline figures plus the engine's), beside the offline one.
SERVING_FOLDER = "serving"
# The stage pods' logs, kept after their Jobs are deleted: logs/<stage>/<pod>.log.
LOGS_FOLDER = "logs"


@dataclass(frozen=True)
class RunLayout:
    """The prefixes of one run, by manifest kind."""

    run_prefix: str

    def prefix(self, kind: Kind) -> str:
        return join(self.run_prefix, kind.value)

    def folder(self, name: str) -> str:
        """The prefix <run>/<name> (a kind's value, or `export`)."""
        return join(self.run_prefix, name)

    def manifest(self, kind: Kind) -> str:
        return join(self.prefix(kind), MANIFEST_NAME)

    @property
    def prompts(self) -> str:
        return self.prefix(Kind.prompts)

    @property
    def completions(self) -> str:
        return self.prefix(Kind.completions)

    @property
    def tokenized(self) -> str:
        return self.prefix(Kind.tokenized)

    @property
    def drafter(self) -> str:
        return self.prefix(Kind.drafter)

    @property
    def export(self) -> str:
        return self.folder(EXPORT_FOLDER)

    @property
    def evaluation(self) -> str:
        return self.prefix(Kind.evaluation)

    @property
    def serving(self) -> str:
        return self.folder(SERVING_FOLDER)

    def logs(self, stage: str | None = None) -> str:
        """Where the pods of `stage` keep their logs (all stages' without one)."""
        return join(self.folder(LOGS_FOLDER), stage) if stage else self.folder(LOGS_FOLDER)


def layout(root: str, run_id: str) -> RunLayout:
    """The one place prefixes are derived: <root>/<run_id>/<kind>."""
    return RunLayout(join(root, run_id))
