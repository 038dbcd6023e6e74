"""Preflight checks: each one fails cleanly, with one line naming the problem, and passes when all is well.

S3 access is checked against the real moto server with IAM enforcement switched on, using the keys of
IAM users whose policies allow only reading (or reading and writing) one bucket.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest

from dflash_shared.errors import BadInputError, PreflightError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import (
    Accounting,
    Kind,
    Manifest,
    Producer,
    Shard,
    SpecialTokens,
    TargetIdentity,
    TokenizedSection,
)
from dflash_shared.preflight import CheckResult, CheckWarning, Preflight
from dflash_shared.storage import ObjectStore, join

TOKENIZER_SHA = "a" * 64
_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def only(pf: Preflight) -> tuple[int, CheckResult]:
    code = pf.run()
    assert len(pf.results) == 1
    return code, pf.results[0]


def tokenized_manifest(shard_uri: str) -> Manifest:
    target = TargetIdentity(
        model_id="Qwen/Qwen3-8B",
        tokenizer_sha256=TOKENIZER_SHA,
        chat_template_sha256="c" * 64,
        enable_thinking=False,
        special_tokens=SpecialTokens(end_of_turn=151645),
    )
    return Manifest(
        kind=Kind.tokenized,
        run_id="run-1",
        producer=Producer(stage="tokenize"),
        shards=[Shard(uri=shard_uri, bytes=3, sha256="0" * 64, records=2, tokens=40)],
        accounting=Accounting(input_records=2, succeeded=2, failed=0, skipped=0),
        section=TokenizedSection(
            target=target,
            mode="token_exact",
            mask_policy="final_turn",
            max_length=4096,
            total_tokens=40,
            loss_tokens=20,
        ),
    )


# ---------------------------------------------------------------------- credentials


@pytest.fixture
def no_aws_credentials(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Nothing in the environment, the config files or instance metadata can supply credentials."""
    for name in _CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in ("config", "credentials"):
        (tmp_path / name).write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto_endpoint


def test_missing_credentials_fail_every_s3_check(no_aws_credentials: str) -> None:
    pf = Preflight("tokenize", ObjectStore(max_attempts=1))
    uri = "s3://some-bucket/completions"
    pf.credentials(uri).storage_read(uri).storage_write(uri).input_manifest(None, uri, Kind.completions)
    assert pf.run() == ExitCode.ENVIRONMENT
    assert [r.ok for r in pf.results] == [False, False, False, False]
    creds, read, write, manifest = pf.results
    assert creds.detail.startswith(f"no AWS credentials found for {uri}")
    assert "no S3 credentials found" in read.detail
    assert "no S3 credentials found" in write.detail
    # Unreadable because of access, not because the input is bad: another node (or a fix) may help.
    assert manifest.code is ExitCode.ENVIRONMENT


def test_credentials_found_without_revealing_the_secret(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY7Q2Z")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-super-secret-value")
    code, result = only(Preflight("tokenize").credentials("s3://b/x"))
    assert code == 0
    assert result.ok
    assert "...7Q2Z" in result.detail
    assert "AKIAEXAMPLEKEY" not in result.detail
    assert "wJalrXUtnFEMI" not in result.detail
    assert only(Preflight("tokenize").credentials("/data/local"))[1].detail == "not needed for local path /data/local"


# ---------------------------------------------------------------------- S3 permissions (real IAM checks)


@dataclass(frozen=True)
class IamBucket:
    bucket: str
    reader: tuple[str, str]
    writer: tuple[str, str]


def _reset_auth(endpoint: str, count: str) -> None:
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


@pytest.fixture
def iam_bucket(moto_endpoint: str) -> Iterator[IamBucket]:
    """A bucket with one input object, a read-only and a read-write IAM user; IAM enforced meanwhile."""
    bucket = f"iam-{uuid.uuid4().hex[:16]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="input/part-0000.jsonl", Body=b'{"id": 1}\n')
    read = [
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{bucket}"},
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"arn:aws:s3:::{bucket}/*"},
    ]
    write = [{"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject"], "Resource": f"arn:aws:s3:::{bucket}/*"}]
    keys = {}
    for role, statements in (("reader", read), ("writer", read + write)):
        user = f"{role}-{bucket}"
        iam.create_user(UserName=user)
        policy = json.dumps({"Version": "2012-10-17", "Statement": statements})
        iam.put_user_policy(UserName=user, PolicyName=f"{role}-policy", PolicyDocument=policy)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[role] = (key["AccessKeyId"], key["SecretAccessKey"])
    # The switch is process-wide in moto: it is turned back off before any other test runs.
    _reset_auth(moto_endpoint, "0")
    try:
        yield IamBucket(f"s3://{bucket}", keys["reader"], keys["writer"])
    finally:
        _reset_auth(moto_endpoint, "inf")
        for obj in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
        s3.delete_bucket(Bucket=bucket)


def _use_keys(monkeypatch: pytest.MonkeyPatch, keys: tuple[str, str]) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[1])


def test_read_only_prefix_fails_the_write_check(iam_bucket: IamBucket, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_keys(monkeypatch, iam_bucket.reader)
    pf = Preflight("tokenize", ObjectStore(max_attempts=1))
    out = join(iam_bucket.bucket, "tokenized")
    pf.storage_read(join(iam_bucket.bucket, "input")).storage_write(out)
    assert pf.run() == ExitCode.ENVIRONMENT
    read, write = pf.results
    assert read.ok, read.detail
    assert read.detail.endswith(f"read {iam_bucket.bucket}/input/part-0000.jsonl")
    assert not write.ok
    assert "AccessDenied" in write.detail
    assert f"{out}/_preflight/" in write.detail
    assert iam_bucket.reader[1] not in write.detail


def test_read_write_prefix_passes_and_leaves_no_probe(iam_bucket: IamBucket, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_keys(monkeypatch, iam_bucket.writer)
    store = ObjectStore(max_attempts=1)
    out = join(iam_bucket.bucket, "tokenized")
    code, result = only(Preflight("tokenize", store).storage_write(out))
    assert code == 0, result.detail
    assert store.list(out) == []


def test_unknown_bucket_fails_the_read_check(iam_bucket: IamBucket, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_keys(monkeypatch, iam_bucket.writer)
    code, result = only(Preflight("tokenize", ObjectStore(max_attempts=1)).storage_read("s3://no-such-bucket-x/in"))
    assert code == ExitCode.ENVIRONMENT
    assert "s3://no-such-bucket-x/in" in result.detail



def test_the_server_authorizes_s3_calls_by_aws_iam_actions(moto_endpoint: str) -> None:
    """The policies above are what real AWS needs: listing and HEAD of a bucket need s3:ListBucket on it, and an
    action named after the API call (s3:ListObjectsV2, s3:HeadBucket: no such IAM actions) grants nothing. The
    moto server is held to that (tests/conftest.py), whichever way its release names the action."""
    bucket = f"iam-{uuid.uuid4().hex[:16]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    clients = {}
    for action in ("s3:ListBucket", "s3:ListObjectsV2", "s3:HeadBucket"):
        user = f"{action.split(':')[1].lower()}-{bucket}"
        iam.create_user(UserName=user)
        statement = {"Effect": "Allow", "Action": [action], "Resource": f"arn:aws:s3:::{bucket}"}
        policy = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
        iam.put_user_policy(UserName=user, PolicyName="list", PolicyDocument=policy)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        clients[action] = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                                       aws_access_key_id=key["AccessKeyId"],
                                       aws_secret_access_key=key["SecretAccessKey"])

    def allowed(client: Any, operation: str) -> bool:
        try:
            getattr(client, operation)(Bucket=bucket)
        except botocore.exceptions.ClientError:
            return False
        return True

    _reset_auth(moto_endpoint, "0")
    try:
        outcome = {
            action: (allowed(client, "list_objects_v2"), allowed(client, "head_bucket"))
            for action, client in clients.items()
        }
    finally:
        _reset_auth(moto_endpoint, "inf")
        s3.delete_bucket(Bucket=bucket)
    assert outcome == {"s3:ListBucket": (True, True), "s3:ListObjectsV2": (False, False),
                       "s3:HeadBucket": (False, False)}


# ---------------------------------------------------------------------- local storage


def test_storage_read_prefers_the_manifest_and_refuses_an_empty_prefix(tmp_path: Path) -> None:
    store = ObjectStore()
    prefix = str(tmp_path / "tokenized")
    write_manifest(store, prefix, tokenized_manifest(join(prefix, "shard-0.arrow")))
    store.write_bytes(join(prefix, "a-first-object.bin"), b"x")
    code, result = only(Preflight("train", store).storage_read(prefix))
    assert code == 0
    assert result.detail == f"listed 2 object(s) under {prefix}, read {join(prefix, 'manifest.json')}"
    code, result = only(Preflight("train", store).storage_read(str(tmp_path / "empty")))
    assert code == ExitCode.ENVIRONMENT
    assert "found no objects" in result.detail
    assert only(Preflight("train", store).storage_read(str(tmp_path / "empty"), allow_empty=True))[1].ok


# ---------------------------------------------------------------------- input manifests


def test_missing_manifest_is_bad_input(tmp_path: Path) -> None:
    code, result = only(Preflight("train").input_manifest(ObjectStore(), str(tmp_path / "nothing"), Kind.tokenized))
    assert code == ExitCode.BAD_INPUT
    assert not result.ok
    assert "has the producing stage finished?" in result.detail


def test_incompatible_manifest_names_the_field(storage_root: str) -> None:
    store = ObjectStore()
    prefix = join(storage_root, "tokenized")
    write_manifest(store, prefix, tokenized_manifest(join(prefix, "shard-0.arrow")))

    expected = {"target.tokenizer_sha256": "b" * 64, "target.enable_thinking": False}
    code, result = only(Preflight("train", store).input_manifest(store, prefix, Kind.tokenized, expected))
    assert code == ExitCode.BAD_INPUT
    assert result.detail.endswith("(field: target.tokenizer_sha256)")
    assert f"target.tokenizer_sha256 = '{TOKENIZER_SHA}'" in result.detail

    code, result = only(Preflight("train", store).input_manifest(store, prefix, Kind.completions))
    assert code == ExitCode.BAD_INPUT
    assert "is a tokenized manifest, expected completions (field: kind)" in result.detail

    expected["target.tokenizer_sha256"] = TOKENIZER_SHA
    code, result = only(Preflight("train", store).input_manifest(store, prefix, Kind.tokenized, expected))
    assert code == 0, result.detail
    assert "run run-1, 1 shard(s), 2 records, 2 field(s) agree" in result.detail


def test_corrupt_manifest_is_bad_input(tmp_path: Path) -> None:
    store = ObjectStore()
    store.write_bytes(str(tmp_path / "manifest.json"), b'{"schema_version": 1, "kind": "tokenized"')
    code, result = only(Preflight("train", store).input_manifest(None, str(tmp_path), Kind.tokenized))
    assert code == ExitCode.BAD_INPUT
    assert "is not valid JSON" in result.detail


# ---------------------------------------------------------------------- node checks


def test_forbidden_and_missing_imports() -> None:
    code, result = only(Preflight("tokenize").imports(["json", "dflash_no_such_module"], ["pyarrow"]))
    assert code == ExitCode.ENVIRONMENT
    assert result.line("tokenize") == (
        "preflight tokenize FAIL imports: required module dflash_no_such_module is not installed; "
        "pyarrow is importable but this image must not contain it"
    )
    code, result = only(Preflight("tokenize").imports(["pyarrow", "json"], ["dflash_no_such_module"]))
    assert code == 0
    assert result.detail == "required pyarrow, json present; forbidden dflash_no_such_module absent"


def test_disk_need_larger_than_free(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    missing_dir = str(tmp_path / "not" / "yet" / "created")
    code, result = only(Preflight("tokenize").disk(missing_dir, free + 2**40))
    assert code == ExitCode.ENVIRONMENT
    assert result.detail.startswith(f"need {(free + 2**40) / 2**30:,.1f} GiB at {missing_dir}, ")
    assert result.detail.endswith(" GiB free")
    assert only(Preflight("tokenize").disk(missing_dir, 2**20))[1].ok


def test_gpus_on_this_machine() -> None:
    code, result = only(Preflight("generate").gpus(1000, 80))
    assert code == ExitCode.ENVIRONMENT
    assert result.detail.startswith("need 1000 GPU(s) with >= 80 GiB, found ")
    if importlib.util.find_spec("torch") is None and shutil.which("nvidia-smi") is None:
        assert result.detail.startswith("need 1000 GPU(s) with >= 80 GiB, found 0 (no torch and no nvidia-smi on "
                                        "PATH): ")
    assert only(Preflight("tokenize").gpus(0))[1].detail == "none required (CPU stage)"


def test_shm_size(tmp_path: Path) -> None:
    code, result = only(Preflight("generate").shm(2**60))
    assert code == ExitCode.ENVIRONMENT
    assert result.detail.startswith("/dev/shm is ")
    assert "emptyDir" in result.detail
    assert only(Preflight("generate").shm(1))[1].ok
    assert "does not exist" in only(Preflight("generate").shm(1, str(tmp_path / "no-shm")))[1].detail


# ---------------------------------------------------------------------- running and reporting


def test_every_check_runs_and_logs_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> str:
        raise RuntimeError("probe exploded")

    pf = (
        Preflight("tokenize")
        .imports(forbidden=["pyarrow"])
        .add("custom", broken)
        .disk(str(tmp_path), 1)
        .input_manifest(ObjectStore(), str(tmp_path / "missing"), Kind.completions)
    )
    with caplog.at_level(logging.INFO, logger="dflash.preflight"):
        code = pf.run()
    assert code == ExitCode.BAD_INPUT  # bad input outranks node problems: a retry cannot fix it
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.preflight"]
    assert [line.split(":")[0] for line in lines[:4]] == [
        "preflight tokenize FAIL imports",
        "preflight tokenize FAIL custom",
        "preflight tokenize OK disk",
        "preflight tokenize FAIL input_manifest",
    ]
    assert lines[1] == "preflight tokenize FAIL custom: probe exploded"
    assert lines[4] == (
        "preflight tokenize: 3 of 4 check(s) failed (imports, custom, input_manifest); exit 65 (BAD_INPUT)"
    )
    with pytest.raises(BadInputError, match="input_manifest"):
        pf.check()
    with pytest.raises(PreflightError, match="imports: pyarrow is importable"):
        Preflight("tokenize").imports(forbidden=["pyarrow"]).check()
    Preflight("tokenize").disk(str(tmp_path), 1).check()


def test_a_warning_passes_with_a_warn_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def slow() -> str:
        raise CheckWarning("this node will run on the slow path")

    pf = Preflight("train").add("kernels", slow).disk(str(tmp_path), 1)
    with caplog.at_level(logging.INFO, logger="dflash.preflight"):
        assert pf.run() == ExitCode.OK
    warned = [r for r in caplog.records if r.name == "dflash.preflight" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == ["preflight train WARN kernels: this node will run on the slow path"]
    assert pf.results[0].ok and pf.results[0].warning and not pf.results[1].warning
    assert caplog.records[-1].getMessage() == "preflight train: all 2 check(s) passed (1 with a warning: kernels)"
    pf.check()  # a warning never fails the stage


# ---------------------------------------------------------------------- command line


def _run_all(**runs: tuple[list[str], dict[str, str]]) -> dict[str, tuple[int, str]]:
    """Run `python -m dflash_shared.preflight` once per entry, concurrently; (exit code, stderr) each."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "dflash_shared.preflight", *args],
            env={**clean, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, env) in runs.items()
    }
    return {name: (proc.wait(timeout=60), proc.communicate()[1]) for name, proc in procs.items()}


def _check_lines(stderr: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in stderr.splitlines() if ": preflight tokenize " in line]


def test_cli_end_to_end(tmp_path: Path) -> None:
    store = ObjectStore()
    inputs = str(tmp_path / "tokenized")
    write_manifest(store, inputs, tokenized_manifest(join(inputs, "shard-0.arrow")))
    common = ["--read-prefix", inputs, "--write-prefix", str(tmp_path / "out"), "--input-manifest", inputs]
    common += ["--input-kind", "tokenized", "--disk-path", str(tmp_path)]
    env = {"DFLASH_PREFLIGHT_STAGE": "tokenize"}

    results = _run_all(
        bad=(
            [*common, "--forbid", "pyarrow", "--need-disk-gib", "1e9", "--expect", '{"target.enable_thinking": true}'],
            env,
        ),
        node_only=([*common, "--need-disk-gib", "1e9"], env),
        good=([*common, "--require", "pyarrow", "--expect", '{"target.enable_thinking": false}'], env),
        typo=(["--min-gpu", "1"], {}),
    )
    code, stderr = results["bad"]
    assert code == ExitCode.BAD_INPUT, stderr
    lines = _check_lines(stderr)
    assert [" ".join(line.split()[2:4]) for line in lines] == [
        "FAIL imports:",
        "OK storage_read:",
        "OK storage_write:",
        "FAIL disk:",
        "OK gpus:",
        "FAIL input_manifest:",
    ]
    assert lines[-1].endswith("(field: target.enable_thinking)")
    assert "preflight tokenize: 3 of 6 check(s) failed" in stderr

    assert results["node_only"][0] == ExitCode.ENVIRONMENT, results["node_only"][1]

    code, stderr = results["good"]
    assert code == 0, stderr
    assert len(_check_lines(stderr)) == 5
    assert "preflight tokenize: all 5 check(s) passed" in stderr

    code, stderr = results["typo"]
    assert code == ExitCode.USAGE
    assert "unknown flag(s) --min-gpu (did you mean --min-gpus?);" in stderr
