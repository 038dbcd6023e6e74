"""The pod that waits in the cluster for a stage's input manifest, for a workload that is applied with the run
instead of created by the run driver once its input is there: a JobSet's `wait-for-input` replicatedJob, on
which its gang of GPU pods depends (`jobset`).

It is one small CPU pod of the orchestration image (dflash_pipeline, its `wait` command; no stage image carries
it), so it may wait long: generation of a headline run takes days. It runs as the stages' account, with the run's
storage settings and credentials like every pod of the run (`pods.pod_spec`).
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.render.pods import HOME_DIR, Container, pod_spec, small_dirs
from dflash_pipeline.run.config import RunConfig

WAIT_JOB = "wait-for-input"
# The waiting pod costs 50m CPU, so it may wait long: generation of a headline run takes days.
WAIT_FOR_INPUT_S = 14 * 86400
WAIT_IMAGE = "pipeline"
WAIT_RESOURCES = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
WAIT_VOLUME_SIZE = "64Mi"


def wait_pod(run: RunConfig, manifest: str) -> dict[str, Any]:
    """The spec of a pod that exits 0 once `manifest` is committed (65 when it times out, 69 when storage
    refuses it)."""
    volumes, mounts = small_dirs(WAIT_VOLUME_SIZE)
    command = ["dflash-pipeline", "wait", "--manifest", manifest, "--timeout-seconds", str(WAIT_FOR_INPUT_S)]
    env = [{"name": "HOME", "value": HOME_DIR}, {"name": "TMPDIR", "value": "/tmp"}]
    return pod_spec(run, Container(WAIT_JOB, run.images.ref(WAIT_IMAGE), command, env, WAIT_RESOURCES, mounts),
                    volumes)
