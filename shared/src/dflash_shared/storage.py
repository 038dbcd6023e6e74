"""One storage layer for local paths and ``s3://`` URIs.

Stages exchange data only through prefixes, so every read and write goes through :class:`ObjectStore`.
Writes are atomic on both backends: a reader either sees the complete object or nothing (local: temp
file + fsync + ``os.replace``; S3: a multipart upload that is completed on success and aborted on
failure). Endpoint, region and credentials come only from the standard AWS chain (environment, config
files, profiles, workload identity); ``AWS_ENDPOINT_URL`` points it at any S3-compatible store.
S3-compatible stores that reject botocore's default request checksums can be served by setting the
standard ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

if TYPE_CHECKING:
    # boto3 and botocore are imported where S3 is first used: they cost a third of a second of start-up,
    # which every local run and every short-lived worker would otherwise pay for nothing.
    import boto3
    from boto3.s3.transfer import TransferConfig
    from mypy_boto3_s3 import S3Client

_S3_SCHEME = "s3://"
# S3 rejects multipart parts below 5 MiB (except the last one).
_MIN_PART_SIZE = 5 * 2**20
_CHUNK = 8 * 2**20
# Temp files of in-flight local writes (".<name>.<32 hex>.tmp"); listings skip them so that a
# crashed writer never yields a half-written object.
_TMP_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_EXISTS_CODES = frozenset(
    {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
)


# Failures no retry of the same pod can heal: credentials missing or refused, a bucket that does not exist,
# an endpoint nobody answers on. They exit ENVIRONMENT (69) in every command, as preflight does.
ENVIRONMENT_CODES = frozenset(
    {
        "NoCredentials",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "403",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchBucket",
        "EndpointConnectionError",
        "InvalidBucketName",
    }
)


class StorageError(RuntimeError):
    """A storage operation failed; the message names the operation and URI, never credentials."""

    def __init__(
        self, message: str, *, uri: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.uri = uri
        self.code = code

    @property
    def is_environment(self) -> bool:
        """The store cannot be used from here at all (see ENVIRONMENT_CODES), as opposed to a transient failure."""
        return self.code in ENVIRONMENT_CODES


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist (also catchable as ``FileNotFoundError``)."""


def is_s3(uri: str) -> bool:
    """Return True for ``s3://`` URIs, False for local paths."""
    return uri.startswith(_S3_SCHEME)


def join(base: str, *parts: str) -> str:
    """Join path segments onto a local path or ``s3://`` URI without doubled slashes."""
    segments = [seg for part in parts for seg in part.split("/") if seg]
    if not segments:
        return base
    if not base:
        return "/".join(segments)
    head = base if base.endswith("://") or base == "/" else base.rstrip("/")
    sep = "" if head.endswith("/") else "/"
    return head + sep + "/".join(segments)


def relative_location(base: str, uri: str) -> str:
    """`uri` as a path relative to the prefix `base` when it lies under `base`'s parent; else `uri`.

    Manifests name their shards and sibling stage outputs this way, so a run root that is moved, copied to
    another bucket, or read from another working directory still resolves (see `resolve_location`).
    Anything further away (a user's model folder, another bucket) stays absolute: relative there would
    break exactly when a run root is moved.
    """
    if is_s3(base) != is_s3(uri):
        return uri
    if is_s3(uri):
        base_bucket, base_key = _split_s3(base)
        bucket, key = _split_s3(uri)
        if bucket != base_bucket:
            return uri
        base_path, path = "/" + base_key.strip("/"), "/" + key
    else:
        base_path, path = os.path.abspath(base), os.path.abspath(uri)
    parent = posixpath.dirname(base_path.rstrip("/")) or "/"
    if posixpath.commonpath([parent, path]) != parent or parent == "/":
        return uri if is_s3(uri) else path
    return posixpath.relpath(path, base_path)


def is_relative_location(ref: str) -> bool:
    return not is_s3(ref) and not os.path.isabs(ref)


def resolve_location(base: str, ref: str) -> str:
    """Inverse of `relative_location`: a relative `ref` joined onto the prefix `base`; absolute ones as they are."""
    if not is_relative_location(ref):
        return ref
    if is_s3(base):
        bucket, key = _split_s3(base)
        path = posixpath.normpath(posixpath.join("/" + key, ref)).lstrip("/")
        return f"{_S3_SCHEME}{bucket}/{path}"
    return os.path.normpath(os.path.join(base, ref))


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len(_S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"invalid S3 URI {uri!r}: no bucket name", uri=uri)
    return bucket, key


def _fsync_dir(path: str) -> None:
    # Makes the rename durable; some filesystems cannot fsync a directory, which is harmless.
    with contextlib.suppress(OSError):
        fd = os.open(path or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _local_errors(uri: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(
            f"no object at {uri}", uri=uri, code="NoSuchKey"
        ) from exc


@contextlib.contextmanager
def _local_atomic(path: str, *, exclusive: bool = False) -> Iterator[BinaryIO]:
    """Write to a temp file beside ``path`` that becomes ``path`` only if the block succeeds."""
    parent, name = os.path.split(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        # link() fails if the target exists (create-exclusive); replace() overwrites atomically.
        (os.link if exclusive else os.replace)(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(parent)


class ObjectStore:
    """Reads and writes objects under local paths or ``s3://`` URIs; safe to share between threads."""

    def __init__(
        self,
        *,
        max_attempts: int | None = None,
        part_size: int = 16 * 2**20,
        page_size: int = 1000,
    ) -> None:
        if part_size < _MIN_PART_SIZE:
            raise ValueError(
                f"part_size={part_size} is below the S3 minimum of {_MIN_PART_SIZE} bytes"
            )
        if not 1 <= page_size <= 1000:
            raise ValueError(f"page_size={page_size} must be between 1 and 1000")
        # The standard AWS variable wins over the default, as it does for every AWS SDK and the CLI.
        self.max_attempts = max_attempts or int(os.environ.get("AWS_MAX_ATTEMPTS") or 8)
        self.part_size = part_size
        self.page_size = page_size
        self._client: S3Client | None = None
        self._session: boto3.session.Session | None = None
        self._lock = threading.Lock()
        self._known_buckets: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for process pools and data-loader workers; each process makes its own client.
        return {**self.__dict__, "_client": None, "_session": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def client(self) -> S3Client:
        """The S3 client, created once on first use (clients are thread-safe, sessions not)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                self._session = boto3.session.Session()
                region = os.environ.get("AWS_REGION") or self._session.region_name
                config = Config(
                    retries={"max_attempts": self.max_attempts, "mode": "adaptive"},
                    max_pool_connections=32,
                )
                self._client = self._session.client(
                    "s3", region_name=region or "us-east-1", config=config
                )
        return self._client

    def _transfer_config(self) -> TransferConfig:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=8,
        )

    def _secrets(self) -> list[str]:
        found = [
            os.environ.get(n, "")
            for n in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        ]
        with contextlib.suppress(Exception):
            creds = self._session.get_credentials() if self._session else None
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                found += [frozen.secret_key or "", frozen.token or ""]
        return [s for s in found if len(s) >= 4]

    def _scrub(self, text: str) -> str:
        # Server messages should never echo secrets, but S3-compatible stores vary: redact defensively.
        for secret in self._secrets():
            text = text.replace(secret, "***")
        return text

    def _error(self, op: str, uri: str, exc: BaseException) -> StorageError:
        import botocore.exceptions

        if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
            return StorageError(
                f"no S3 credentials found for {uri}: set AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, a profile, or a workload identity",
                uri=uri,
                code="NoCredentials",
            )
        if not isinstance(exc, botocore.exceptions.ClientError):
            # EndpointConnectionError, ReadTimeoutError, ...: the class name is the code.
            return StorageError(
                f"S3 {op} failed for {uri}: {self._scrub(str(exc))}", uri=uri, code=type(exc).__name__
            )
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(err.get("Code") or status)
        detail = self._scrub(str(err.get("Message") or "")).strip()
        msg = f"S3 {op} failed for {uri}: {code}" + (f" ({detail})" if detail else "")
        cls = ObjectNotFoundError if code in _NOT_FOUND_CODES else StorageError
        return cls(msg, uri=uri, code=code)

    @contextlib.contextmanager
    def _s3_errors(self, op: str, uri: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            import botocore.exceptions

            # smart_open and boto3's transfer manager re-wrap botocore errors (OSError, ValueError,
            # S3UploadFailedError); find the original to report its code and keep the message clean.
            boto_errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, boto_errors):
                cause = (
                    cause.__cause__
                    or getattr(cause, "backend_error", None)
                    or cause.__context__
                )
            if cause is None:
                raise
            raise self._error(op, uri, cause) from exc

    def _head(self, uri: str) -> dict[str, Any]:
        """HEAD the object; ObjectNotFoundError if absent, StorageError if the bucket is absent."""
        bucket, key = _split_s3(uri)
        try:
            with self._s3_errors("head_object", uri):
                return cast(
                    dict[str, Any], self.client.head_object(Bucket=bucket, Key=key)
                )
        except ObjectNotFoundError:
            pass
        # HEAD answers a bare 404 for a missing bucket too; tell the two apart (once per bucket) so
        # that a typo in a bucket name is an error rather than "object absent".
        if bucket not in self._known_buckets:
            try:
                with self._s3_errors("head_bucket", uri):
                    self.client.head_bucket(Bucket=bucket)
            except ObjectNotFoundError as exc:
                raise StorageError(
                    f"S3 head_object failed for {uri}: NoSuchBucket (bucket {bucket!r} does not exist)",
                    uri=uri,
                    code="NoSuchBucket",
                ) from exc
            self._known_buckets.add(bucket)
        raise ObjectNotFoundError(f"no object at {uri}", uri=uri, code="NoSuchKey")

    def list(self, prefix: str, suffix: str = "") -> list[str]:
        """Sorted full URIs of all objects below ``prefix`` (a directory-like location), recursively.

        ``prefix`` is taken as a directory: ``s3://b/data`` lists ``s3://b/data/...`` but not
        ``s3://b/data2/...``. Locally only regular files count and in-flight temp files are skipped.
        """
        if is_s3(prefix):
            bucket, key = _split_s3(prefix)
            key_prefix = key.rstrip("/") + "/" if key.strip("/") else ""
            out: list[str] = []
            with self._s3_errors("list_objects_v2", prefix):
                pages = self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket,
                    Prefix=key_prefix,
                    PaginationConfig={"PageSize": self.page_size},
                )
                for page in pages:
                    for obj in page.get("Contents", []):
                        name = obj["Key"]
                        # "dir/" placeholder objects made by consoles are not data.
                        if not name.endswith("/") and name.endswith(suffix):
                            out.append(f"{_S3_SCHEME}{bucket}/{name}")
            return sorted(out)
        if not os.path.isdir(prefix):
            return []
        found: list[str] = []
        for dirpath, _dirs, files in os.walk(prefix):
            for name in files:
                if name.endswith(suffix) and not _TMP_RE.match(name):
                    path = os.path.join(dirpath, name)
                    if os.path.isfile(path):
                        found.append(path)
        return sorted(found)

    def exists(self, uri: str) -> bool:
        """True if an object exists at ``uri``; a missing S3 bucket is an error, not False."""
        if not is_s3(uri):
            return os.path.isfile(uri)
        try:
            self._head(uri)
        except ObjectNotFoundError:
            return False
        return True

    def size(self, uri: str) -> int:
        """Size of the object in bytes."""
        if not is_s3(uri):
            with _local_errors(uri):
                return os.stat(uri).st_size
        return int(self._head(uri)["ContentLength"])

    def stat(self, uri: str) -> tuple[int, str]:
        """(size in bytes, version tag) of the object from one HEAD; the tag changes whenever it is rewritten.

        S3's ETag (the store's own, so an object overwritten with other bytes of the same size shows up); locally
        the inode and modification time, which an atomic replace changes too.
        """
        if not is_s3(uri):
            with _local_errors(uri):
                st = os.stat(uri)
            return st.st_size, f"{st.st_ino}-{st.st_mtime_ns}"
        head = self._head(uri)
        return int(head["ContentLength"]), str(head.get("ETag") or "").strip('"')

    def read_bytes(self, uri: str) -> bytes:
        """The whole object in memory."""
        if not is_s3(uri):
            with self.open_read(uri) as fh:
                return fh.read()
        bucket, key = _split_s3(uri)
        with self._s3_errors("get_object", uri):
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    @contextlib.contextmanager
    def open_read(self, uri: str) -> Iterator[BinaryIO]:
        """A streaming binary reader (seekable; ranged GETs on S3)."""
        if not is_s3(uri):
            with _local_errors(uri):
                fh = open(uri, "rb")  # noqa: SIM115 - closed by the with-block below
            with fh:
                yield fh
            return
        import smart_open.s3  # deferred: only S3 users pay for the import

        bucket, key = _split_s3(uri)
        with self._s3_errors("get_object", uri):
            reader = smart_open.s3.open(bucket, key, "rb", client=self.client)
        with reader:
            yield cast(BinaryIO, reader)

    def sha256(self, uri: str) -> str:
        """Hex SHA-256 of the object, computed while streaming."""
        digest = hashlib.sha256()
        if is_s3(uri):
            bucket, key = _split_s3(uri)
            with self._s3_errors("get_object", uri):
                body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
                for chunk in body.iter_chunks(_CHUNK):
                    digest.update(chunk)
            return digest.hexdigest()
        with self.open_read(uri) as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    @contextlib.contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        """A binary writer whose data becomes visible at ``uri`` only when the block exits cleanly."""
        if not is_s3(uri):
            with _local_atomic(uri) as fh:
                yield fh
            return
        import smart_open.s3

        bucket, key = _split_s3(uri)
        with self._s3_errors("create_multipart_upload", uri):
            writer = smart_open.s3.open(
                bucket, key, "wb", min_part_size=self.part_size, client=self.client
            )
        try:
            yield cast(BinaryIO, writer)
            with self._s3_errors("multipart upload", uri):
                writer.close()
        except BaseException:
            # BaseException too: a SIGTERM turned into SystemExit must not leave orphan parts behind.
            with contextlib.suppress(Exception):
                writer.terminate()  # type: ignore[attr-defined]
            raise

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Atomically store ``data`` at ``uri`` (single PUT on S3)."""
        if not is_s3(uri):
            with _local_atomic(uri) as fh:
                fh.write(data)
            return
        bucket, key = _split_s3(uri)
        with self._s3_errors("put_object", uri):
            self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def put_if_absent(self, uri: str, data: bytes) -> bool:
        """Create ``uri`` with ``data`` only if nothing is there; True if this call created it.

        S3 uses a conditional PUT (``If-None-Match: *``). If a response is lost and the SDK retries a
        PUT that had in fact succeeded, the retry reports False; callers that must know who won should
        write distinguishing content and read it back.
        """
        if not is_s3(uri):
            try:
                with _local_atomic(uri, exclusive=True) as fh:
                    fh.write(data)
            except FileExistsError:
                return False
            return True
        bucket, key = _split_s3(uri)
        try:
            with self._s3_errors("put_object(If-None-Match)", uri):
                self.client.put_object(
                    Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"
                )
        except StorageError as exc:
            if exc.code in _EXISTS_CODES:
                return False
            raise
        return True

    def delete(self, uri: str) -> None:
        """Remove the object; a missing object is not an error."""
        if not is_s3(uri):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(uri)
            return
        bucket, key = _split_s3(uri)
        with self._s3_errors("delete_object", uri):
            self.client.delete_object(Bucket=bucket, Key=key)

    def remove_abandoned_writes(self, prefix: str, name_start: str = "") -> int:
        """Delete the temp files that local writes killed mid-way (kill -9, a lost node) left directly under the
        local folder `prefix` (whose names start with `name_start`), and return how many. Listings never show them;
        call it only where no write of those names can be in flight (the owner of a finished shard). Nothing on
        S3: an interrupted upload leaves no object."""
        if is_s3(prefix) or not os.path.isdir(prefix):
            return 0
        removed = 0
        for name in os.listdir(prefix):
            if _TMP_RE.match(name) and name[1:].startswith(name_start):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(prefix, name))
                    removed += 1
        return removed

    def download_to(self, uri: str, local_path: str) -> None:
        """Copy the object to a local file (parallel ranged GETs on S3), atomically."""
        with _local_atomic(local_path) as fh:
            if not is_s3(uri):
                with _local_errors(uri), open(uri, "rb") as src:
                    shutil.copyfileobj(src, fh, _CHUNK)
                return
            bucket, key = _split_s3(uri)
            try:
                with self._s3_errors("download", uri):
                    self.client.download_fileobj(
                        bucket, key, fh, Config=self._transfer_config()
                    )
            except ObjectNotFoundError:
                self._head(uri)  # the transfer's bare 404 does not say: bucket or key?
                raise

    def upload_from(self, local_path: str, uri: str) -> None:
        """Copy a local file to ``uri`` atomically (parallel multipart upload on S3 for large files)."""
        if not os.path.isfile(local_path):
            raise StorageError(
                f"cannot upload {local_path} to {uri}: not a file", uri=uri
            )
        if not is_s3(uri):
            with open(local_path, "rb") as src, _local_atomic(uri) as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            return
        bucket, key = _split_s3(uri)
        with self._s3_errors("upload", uri):
            self.client.upload_file(
                local_path, bucket, key, Config=self._transfer_config()
            )
