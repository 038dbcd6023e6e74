"""The generate stage's checks, one list (`build_preflight`): `run` starts with it on every worker and `preflight`
runs it alone. Everything that can be checked before the model is loaded:

Imports of the engine stack, S3 credentials and write access, the prompts manifest, the model files
(local directory, S3 prefix or hub repository: config, weights, tokenizer and chat template present),
disk for the scratch data plus a local copy of the model, /dev/shm for the engine's worker processes,
and, for the CUDA build of vLLM, enough visible GPUs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

from dflash_generate.config import GenerateConfig
from dflash_generate.engine import engine_flavour
from dflash_generate.model_source import ModelSource, s3_model_bytes
from dflash_generate.stage import STAGE
from dflash_shared import identity
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import ManifestError, load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.preflight import CheckError, Preflight, manifest_check_error
from dflash_shared.storage import ObjectStore, is_s3

REQUIRED = ["dflash_generate", "dflash_shared", "vllm", "torch", "transformers", "tokenizers"]
GIB = 2**30


def _missing_model_files(names: Iterable[str]) -> list[str]:
    present = {os.path.basename(n) for n in names}
    missing = [n for n in ("config.json", "tokenizer.json") if n not in present]
    if not any(n.endswith(".safetensors") for n in present):
        missing.append("*.safetensors weights")
    if "chat_template.jinja" not in present and "tokenizer_config.json" not in present:
        missing.append("a chat template (chat_template.jinja or tokenizer_config.json)")
    return missing


def build_preflight(config: GenerateConfig, store: ObjectStore | None = None) -> Preflight:
    store = store or ObjectStore()
    checks = Preflight(STAGE, store).imports(REQUIRED)
    for uri in sorted({u for u in (config.input, config.output, config.model) if is_s3(u)}):
        checks.credentials(uri)
    checks.storage_write(config.output)
    model_bytes: list[int] = []

    def input_manifest() -> str:
        try:
            loaded = load_manifest(store, config.input, Kind.prompts, verify=False)
        except ManifestError as err:
            raise manifest_check_error(err) from err
        m = loaded.manifest
        return f"prompts {loaded.uri}: run {m.run_id}, {len(m.shards)} shard(s), {m.total_records:,} prompts"

    def model() -> str:
        try:
            source = ModelSource.parse(config.model, config.model_revision)
        except ValueError as err:
            raise CheckError(str(err), ExitCode.BAD_INPUT) from err
        if source.kind == "local":
            files = [str(p) for p in os.listdir(source.location)]
            missing = _missing_model_files(files)
            if not missing:
                identity.read_chat_template(source.location)
        elif source.kind == "s3":
            files = store.list(source.location)
            missing = _missing_model_files(files)
            model_bytes.append(s3_model_bytes(store, source.location) if not missing else 0)
        else:
            import huggingface_hub

            info: Any = huggingface_hub.model_info(source.location, revision=source.revision, files_metadata=True)
            files = [s.rfilename for s in info.siblings or []]
            missing = _missing_model_files(files)
            model_bytes.append(sum(s.size or 0 for s in info.siblings or []))
        if missing:
            raise CheckError(f"model {config.model} lacks {', '.join(missing)}", ExitCode.BAD_INPUT)
        size = f", {model_bytes[0] / GIB:.2f} GiB to copy" if model_bytes else ""
        return f"{source.kind} model {source.location}: {len(files)} file(s){size}"

    def disk() -> str:
        where = config.model_cache_dir or config.scratch_dir or tempfile.gettempdir()
        probe = os.path.abspath(where)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        need = int(config.disk_need_gib * GIB) + (model_bytes[0] if model_bytes else 0)
        free = shutil.disk_usage(probe).free
        detail = f"need {need / GIB:.2f} GiB at {where} (scratch + model copy), {free / GIB:.1f} GiB free"
        if free < need:
            raise CheckError(detail)
        return detail

    checks.add("input_manifest", input_manifest).add("model", model).add("disk", disk)
    flavour = engine_flavour()
    checks.gpus(0 if flavour == "cpu" else config.tensor_parallel_size * config.data_parallel_size,
                config.min_gpu_memory_gib)
    if config.min_shm_gib:
        checks.shm(int(config.min_shm_gib * GIB))
    return checks
