"""Preflight of the train stage: everything that can be checked before the target is loaded.

Imports, GPUs (when training on CUDA), S3 credentials and write access to the output, scratch disk, and
the tokenized manifest's compatibility with the target: its tokenizer and chat template hashes must be
those of the target directory (only the target's small files are copied for this check).
"""

from __future__ import annotations

import os
import tempfile

from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import ManifestError
from dflash_shared.manifests import TokenizedSection
from dflash_shared.preflight import CheckError, Preflight
from dflash_shared.storage import ObjectStore, is_s3
from dflash_train.config import TrainConfig
from dflash_train.stage import STAGE, fetch_target, open_input

REQUIRED = ["dflash_train", "dflash_shared", "torch", "transformers", "safetensors", "pyarrow", "numpy"]


def _local_gpus() -> int:
    """GPUs this pod's ranks need: torchrun's LOCAL_WORLD_SIZE, else one."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw else 1


def build_preflight(config: TrainConfig, store: ObjectStore | None = None) -> Preflight:
    store = store or ObjectStore()
    checks = Preflight(STAGE, store).imports(REQUIRED + (["tensorboard"] if config.tensorboard else []))
    checks.gpus(_local_gpus() if config.device == "cuda" else 0)
    s3_uris = [uri for uri in (config.input, config.output, config.target) if is_s3(uri)]
    if s3_uris:
        checks.credentials(s3_uris[0])
    checks.storage_write(config.output)
    checks.disk(config.scratch_dir or tempfile.gettempdir(), int(config.disk_need_gib * 2**30))

    def input_manifest() -> str:
        base = config.scratch_dir or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            try:
                target_dir = fetch_target(store, config.target, scratch, small_only=True)
            except Exception as err:  # noqa: BLE001 - reported as this check's failure
                raise CheckError(f"target {config.target} cannot be read: {err}") from err
            try:
                source = open_input(store, config, target_dir)
            except ManifestError as err:
                field = f" (field: {err.field})" if err.field else ""
                raise CheckError(f"{err}{field}", ExitCode.BAD_INPUT) from err
        m = source.manifest
        section = m.section
        assert isinstance(section, TokenizedSection)
        return (f"tokenized {source.uri}: run {m.run_id}, {len(m.shards)} shard(s), {m.total_records:,} records, "
                f"{section.total_tokens:,} tokens; tokenizer and chat template match the target {config.target}")

    return checks.add("input_manifest", input_manifest)
