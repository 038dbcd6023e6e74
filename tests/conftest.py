"""Shared test fixtures: a real S3 endpoint (moto server on 127.0.0.1) and storage roots; `gpu` tests skipped
where no CUDA device is visible (the markers are declared in pytest.ini).

Every S3 test talks HTTP to an in-process moto server; the AWS environment is pointed at it for the
whole session so no test can reach a real cloud account.
"""

from __future__ import annotations

import importlib.util
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from dflash_shared.storage import ObjectStore

# Variables that could redirect boto3 away from the test server or add real credentials.
_AWS_ISOLATE = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


def _no_cuda_device() -> str | None:
    """Why no CUDA device can run a test here, or None when torch sees one."""
    if importlib.util.find_spec("torch") is None:
        return "needs a CUDA device: this environment has no torch"
    import torch

    if not torch.version.cuda:
        return f"needs a CUDA device: torch {torch.__version__} is a CPU build"
    # device_count asks NVML first, which leaves CUDA uninitialised: engines forked later still start.
    if torch.cuda.device_count() == 0:
        return f"needs a CUDA device: torch {torch.__version__} sees none"
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests skip, with the reason, where no CUDA device is visible (CPU CI never fails on them).

    trylast: `-m` has deselected by then, so torch is imported only when a `gpu` test is still to run.
    """
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = _no_cuda_device() if gpu else None
    if reason is not None:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


# S3 API operations that AWS authorizes with an IAM action of another name (the Service Authorization Reference
# for Amazon S3; e.g. ListObjectsV2 and HeadBucket need s3:ListBucket, and there is no s3:ListObjectsV2 action).
# moto 5.2.6 checks an S3 request's policy against the operation's own name (its request routing no longer reads
# the action its S3 handlers set), so a policy written for real AWS is denied these calls; _s3_iam_actions gives
# the server AWS's rule back. On a moto that already asks for the IAM action the table matches nothing.
_S3_IAM_ACTION = {
    "ListObjects": "ListBucket",
    "ListObjectsV2": "ListBucket",
    "HeadBucket": "ListBucket",
    "HeadObject": "GetObject",
    "ListObjectVersions": "ListBucketVersions",
    "ListMultipartUploads": "ListBucketMultipartUploads",
    "ListParts": "ListMultipartUploadParts",
    "CreateMultipartUpload": "PutObject",
    "UploadPart": "PutObject",
    "CompleteMultipartUpload": "PutObject",
    "DeleteObjects": "DeleteObject",
    "ListBuckets": "ListAllMyBuckets",
}


def _s3_iam_actions() -> None:
    """Make the moto server authorize each S3 request by the IAM action AWS checks for it (once per process)."""
    from moto.iam import access_control

    request_cls = access_control.S3IAMRequest
    if getattr(request_cls, "_dflash_iam_actions", False):
        return
    init = request_cls.__init__

    def init_with_iam_action(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        service, _, operation = self._action.partition(":")
        if service == "s3" and operation in _S3_IAM_ACTION:
            self._action = f"s3:{_S3_IAM_ACTION[operation]}"

    request_cls.__init__ = init_with_iam_action
    request_cls._dflash_iam_actions = True


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start a moto S3 server on a free local port and point the AWS environment at it."""
    # One access-log line per request would bury real failures in the captured output.
    werkzeug_log = logging.getLogger("werkzeug")
    previous_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)
    _s3_iam_actions()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    empty = tmp_path_factory.mktemp("aws-config")
    mp = pytest.MonkeyPatch()
    for name in _AWS_ISOLATE:
        mp.delenv(name, raising=False)
    mp.setenv("AWS_ENDPOINT_URL", url)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_REGION", "us-east-1")
    # A developer's ~/.aws files must not leak profiles or endpoints into the tests.
    mp.setenv("AWS_CONFIG_FILE", str(empty / "config"))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    try:
        yield url
    finally:
        mp.undo()
        server.stop()
        werkzeug_log.setLevel(previous_level)


@pytest.fixture
def s3_bucket(moto_endpoint: str) -> Iterator[str]:
    """A fresh, uniquely named bucket on the moto server, emptied and removed afterwards."""
    name = f"test-{uuid.uuid4().hex[:20]}"
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    yield f"s3://{name}"
    # Keeps the session-wide server's memory flat; large test objects would otherwise pile up.
    try:
        for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            if page.get("Contents"):
                client.delete_objects(
                    Bucket=name,
                    Delete={"Objects": [{"Key": o["Key"]} for o in page["Contents"]]},
                )
        client.delete_bucket(Bucket=name)
    except Exception as exc:  # noqa: BLE001 - cleanup must not turn a pass into an error
        logging.getLogger(__name__).warning(
            "could not clean up bucket %s: %s", name, exc
        )


@pytest.fixture
def store(moto_endpoint: str) -> ObjectStore:
    """An ObjectStore whose S3 side can only reach the moto server."""
    return ObjectStore()


@pytest.fixture(params=["local", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A base URI on each backend in turn: a temp directory, then a fresh S3 bucket prefix."""
    if request.param == "local":
        return str(tmp_path / "root")
    bucket: str = request.getfixturevalue("s3_bucket")
    return f"{bucket}/root"
