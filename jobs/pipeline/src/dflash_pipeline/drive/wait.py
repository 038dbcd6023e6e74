"""Wait for a manifest from a script: `python -m dflash_pipeline wait --manifest .../evaluation/manifest.json`.

No stage Job waits any more (the run driver creates each Job once its input is committed, see `driver`);
this is for a CI step or a shell that should block until a run, or one stage of it, has committed. The
manifest is the stage's commit point, so its presence means the output is complete. "Not there yet" and
transient storage errors are retried; an error no retry can heal (access denied, no such bucket, an endpoint
nobody answers on: `StorageError.is_environment`) exits ENVIRONMENT (69) at once, naming it. Running out of
time exits BAD_INPUT (65).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore, StorageError

logger = logging.getLogger("dflash.pipeline.wait")
# How often a still-waiting pod says so in its log.
_REPORT_EVERY_S = 600.0


def wait_for_manifest(
    store: ObjectStore,
    uri: str,
    timeout_s: float,
    poll_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """0 once `uri` exists, BAD_INPUT when `timeout_s` passes first, ENVIRONMENT on a storage error of access."""
    start = clock()
    last_report = None
    while True:
        try:
            if store.exists(uri):
                logger.info("input manifest %s is present after %.0f s", uri, clock() - start)
                return ExitCode.OK
        except StorageError as err:
            if err.is_environment:
                logger.error("cannot check %s: %s; exit %d", uri, err, ExitCode.ENVIRONMENT)
                return ExitCode.ENVIRONMENT
            logger.warning("cannot check %s yet: %s", uri, err)
        waited = clock() - start
        if waited >= timeout_s:
            logger.error(
                "input manifest %s did not appear within %.0f s; has the upstream stage failed? exit %d",
                uri, timeout_s, ExitCode.BAD_INPUT,
            )
            return ExitCode.BAD_INPUT
        if last_report is None or waited - last_report >= _REPORT_EVERY_S:
            logger.info("waiting for %s (upstream stage not finished; %.0f s of %.0f s)", uri, waited, timeout_s)
            last_report = waited
        sleep(min(poll_s, max(timeout_s - waited, 0.0)))
