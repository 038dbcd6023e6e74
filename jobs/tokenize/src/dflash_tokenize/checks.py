"""The tokenize stage's checks, one list (`build_preflight`): `run` starts with it on every worker and `preflight`
runs it alone. Everything that can be checked before the first record is read."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dflash_shared.chat_render import fetch_tokenizer
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import ManifestError
from dflash_shared.preflight import CheckError, Preflight, manifest_check_error
from dflash_shared.storage import ObjectStore, is_s3, join
from dflash_tokenize.chat import ChatFormat, ChatFormatError
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import STAGE, open_source

REQUIRED = ["dflash_tokenize", "dflash_shared", "tokenizers", "jinja2", "pyarrow", "orjson"]
# The origin pipeline's tokenizer died importing a torch it never used: this image must not have it.
FORBIDDEN = ["torch", "vllm", "triton"]


def tokenizer_files(store: ObjectStore, location: str) -> str:
    """Check that `location` holds tokenizer.json and a chat template, without loading either.

    A path that does not exist or lacks the files is a setting to fix (USAGE); a path that exists but cannot
    be read is the node's access (ENVIRONMENT).
    """
    if is_s3(location):
        if not store.exists(join(location, "tokenizer.json")):
            raise CheckError(f"no tokenizer.json under {location}: point --tokenizer at the target model's "
                             "directory", ExitCode.USAGE)
        return f"{location}: tokenizer.json present"
    directory = Path(location)
    try:
        ChatFormat.check_dir(directory)
        with open(directory / "tokenizer.json", "rb") as handle:
            handle.read(1)
    except ChatFormatError as err:
        raise CheckError(str(err), ExitCode.USAGE) from err
    return f"{location}: tokenizer.json and a chat template present"


def build_preflight(config: TokenizeConfig, store: ObjectStore | None = None) -> Preflight:
    store = store or ObjectStore()
    checks = Preflight(STAGE, store).imports(REQUIRED, FORBIDDEN)
    # One credentials line is enough: every S3 location is read with the same credential chain.
    s3_uris = [uri for uri in (config.input, config.output, config.tokenizer) if is_s3(uri)]
    if s3_uris:
        checks.credentials(s3_uris[0])
    checks.storage_write(config.output)
    checks.disk(config.scratch_dir or tempfile.gettempdir(), int(config.disk_need_gib * 2**30))
    loaded: list[ChatFormat] = []

    def tokenizer() -> str:
        with tempfile.TemporaryDirectory(dir=config.scratch_dir) as scratch:
            loaded.append(ChatFormat.from_dir(fetch_tokenizer(store, config.tokenizer, scratch)))
        chat = loaded[0]
        return f"{config.tokenizer}: tokenizer {chat.tokenizer_sha256[:12]}, template {chat.chat_template_sha256[:12]}"

    def input_manifest() -> str:
        if not loaded:
            raise CheckError("skipped: the tokenizer could not be loaded", ExitCode.ENVIRONMENT)
        try:
            source, thinking = open_source(store, config, loaded[0])
        except ManifestError as err:
            raise manifest_check_error(err) from err
        m = source.manifest
        return (f"completions {source.uri}: run {m.run_id}, {len(m.shards)} shard(s), {m.total_records:,} records, "
                f"thinking {thinking}, compatible with the tokenizer")

    return checks.add("tokenizer", tokenizer).add("input_manifest", input_manifest)
