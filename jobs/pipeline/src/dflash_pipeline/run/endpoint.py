"""The object store of a command run beside the cluster: the run file's [storage], as the run's pods get it.

The pods of a run get [storage] endpoint_url, region and the checksum setting as environment variables
(`pods.storage_env`). The commands a person runs from a laptop (status, plan, wait, restart, stage-model, local) read
the same run file, so they use the same settings wherever the environment does not set its own
(AWS_ENDPOINT_URL, AWS_REGION win: a port-forward to the store, say), and each says on stderr which endpoint it
uses and where that came from: the one line that explains a 403 or a timeout from the wrong store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_shared.storage import ObjectStore, is_s3

if TYPE_CHECKING:
    from dflash_pipeline.run.config import RunConfig

log = logging.getLogger("dflash.pipeline.endpoint")


def use_run_storage(run: RunConfig | None, run_file: Path | None) -> str:
    """Fill in the run file's [storage] where the environment has no value; returns where the endpoint is from."""
    if run is not None:
        storage = run.storage
        if storage.region and not os.environ.get("AWS_REGION"):
            os.environ["AWS_REGION"] = storage.region
        if storage.checksum_when_required:  # as the run's pods get it (pods.py)
            os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
            os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    if os.environ.get("AWS_ENDPOINT_URL"):
        return "AWS_ENDPOINT_URL"
    if run is None:
        return "the AWS configuration"
    if not run.storage.endpoint_url:
        return f"the AWS configuration ({run_file} sets no storage.endpoint_url)"
    os.environ["AWS_ENDPOINT_URL"] = run.storage.endpoint_url
    return f"storage.endpoint_url of {run_file}"


def run_store(run: RunConfig | None, run_file: Path | None, uris: Iterable[str]) -> ObjectStore:
    """The store for `uris` under the run file's [storage]; names its S3 endpoint on stderr when one is used."""
    origin = use_run_storage(run, run_file)
    store = ObjectStore()
    if any(is_s3(uri) for uri in uris):
        log.info("S3 endpoint: %s (from %s)", store.client.meta.endpoint_url, origin)
    return store
