"""The tokenizer image doing its real job: preflight, then tokenise from a moto S3 endpoint, in the container."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, TokenizedSection
from dflash_shared.storage import ObjectStore, join
from tests.images.image_support import RunInImage
from tests.support.qwen_assets import build_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, write_completions

pytestmark = [pytest.mark.image, pytest.mark.slow]


@pytest.fixture
def s3_inputs(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> dict[str, str]:
    """A tokenizer directory and a small completions manifest, both on the S3 endpoint."""
    tokenizer = build_tokenizer_dir(tmp_path / "tok", "qwen3")
    model_prefix = join(s3_bucket, "models", "qwen3")
    for path in tokenizer.iterdir():
        store.upload_from(str(path), join(model_prefix, path.name))
    records = [completion(conversation(i)) for i in range(40)]
    completions = write_completions(store, join(s3_bucket, "run", "completions"), records, shards=2)
    return {"tokenizer": model_prefix, "completions": completions, "bucket": s3_bucket}


def stage_env(moto_container_env: dict[str, str], inputs: dict[str, str], output: str) -> dict[str, str]:
    return {
        **moto_container_env,
        "DFLASH_TOKENIZE_INPUT": inputs["completions"],
        "DFLASH_TOKENIZE_OUTPUT": output,
        "DFLASH_TOKENIZE_TOKENIZER": inputs["tokenizer"],
        "DFLASH_TOKENIZE_MIN_CONTENT_TOKENS": "4",
    }


def test_default_command_tokenizes_from_s3(
    tokenizer_image: str, run_in_image: RunInImage, moto_container_env: dict[str, str],
    s3_inputs: dict[str, str], store: ObjectStore,
) -> None:
    output = join(s3_inputs["bucket"], "run", "tokenized")
    proc = run_in_image(tokenizer_image, [], env=stage_env(moto_container_env, s3_inputs, output))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for check in ("imports", "storage_write", "disk", "tokenizer", "input_manifest"):
        assert f"preflight tokenize OK {check}" in log, log[-3000:]
    loaded = load_manifest(store, output, Kind.tokenized)  # re-hashes every shard on the host
    manifest = loaded.manifest
    assert manifest.accounting.succeeded == 40
    assert isinstance(manifest.section, TokenizedSection) and manifest.section.loss_tokens > 0
    assert manifest.producer.image and manifest.producer.image.startswith("localhost/dflash-tokenizer")
    assert manifest.producer.git_revision not in (None, "unknown")
    # The resolved config is recorded, credentials are not.
    text = store.read_bytes(loaded.uri).decode()
    assert "DFLASH_TOKENIZE" not in text and "testing" not in json.dumps(manifest.producer.config)


def test_bad_input_exits_65_and_writes_no_manifest(
    tokenizer_image: str, run_in_image: RunInImage, moto_container_env: dict[str, str],
    s3_inputs: dict[str, str], store: ObjectStore,
) -> None:
    empty = [completion(conversation(i, answer="")) for i in range(20)]
    s3_inputs = dict(s3_inputs, completions=write_completions(store, join(s3_inputs["bucket"], "bad"), empty))
    output = join(s3_inputs["bucket"], "bad-tokenized")
    proc = run_in_image(tokenizer_image, [], env=stage_env(moto_container_env, s3_inputs, output))
    assert proc.returncode == 65, proc.stderr[-3000:]
    assert "20 of 20 records are unusable" in proc.stderr
    assert not store.exists(join(output, "manifest.json"))


def test_preflight_without_credentials_fails_cleanly(
    tokenizer_image: str, run_in_image: RunInImage, moto_container_env: dict[str, str],
    s3_inputs: dict[str, str],
) -> None:
    env = stage_env(moto_container_env, s3_inputs, join(s3_inputs["bucket"], "out"))
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    proc = run_in_image(tokenizer_image, [], env=env)
    assert proc.returncode == 69, proc.stderr[-3000:]
    # The default command runs the stage, which starts with its checks: their failures are its one error line.
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "preflight tokenize failed: credentials: no AWS credentials" in errors[0], errors
    assert "Traceback" not in proc.stderr
