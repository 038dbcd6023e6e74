"""Preflight: prove the node and its access are fit before a stage starts expensive work.

Loading a 27B model or fanning out 1,000 pods and only then discovering a missing credential, a full
disk or a manifest made for another tokenizer wastes hours. A stage lists what it needs, `run()` checks
it all (a failure does not stop the others, so the operator sees every problem at once), and each check
writes exactly one line::

    preflight tokenize OK imports: required pyarrow, tokenizers present; forbidden torch, vllm absent
    preflight tokenize FAIL disk: need 500.0 GiB at /scratch, 120.3 GiB free
    preflight tokenize FAIL input_manifest: manifest s3://b/c/manifest.json: ... (field: target.enable_thinking)
    preflight train WARN kernels: hybrid target on the PyTorch reference kernels on a GPU: ...

A check that raises `CheckWarning` passes with a WARN line (logged at WARNING): the stage can run, but
the operator should know (e.g. it will run much slower than it could).

`run()` returns 0, USAGE (64) when a setting is wrong (a configured path that does not exist), BAD_INPUT
(65) when an input manifest is unusable (a retry cannot help either way), else ENVIRONMENT (69) (another
node might do). The same checks run from the command line,
`python -m dflash_shared.preflight --stage generate --min-gpus 1 --read-prefix s3://...`, e.g. as an
init container.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dflash_shared import gpu_driver
from dflash_shared.errors import BadInputError, ConfigError, PreflightError, describe_os_error, exit_code_for
from dflash_shared.exit_codes import ExitCode, describe
from dflash_shared.logs import redact
from dflash_shared.manifest_io import ManifestError, load_manifest
from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.settings import StageSettings, parse_settings
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, is_s3, join

logger = logging.getLogger("dflash.preflight")
GIB = 2**30


def _gib(n: float) -> str:
    return f"{n / GIB:,.{2 if n < 10 * GIB else 1}f} GiB"


class CheckError(Exception):
    """Raised by a check to fail with `detail`; `code` says whether a retry elsewhere could help."""

    def __init__(self, detail: str, code: ExitCode = ExitCode.ENVIRONMENT) -> None:
        super().__init__(detail)
        self.code = code


class CheckWarning(Exception):  # noqa: N818 - a passing check's signal, not an error
    """Raised by a check that passes with a warning: `detail` is logged as a WARN line."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    code: ExitCode
    warning: bool = False

    def line(self, stage: str) -> str:
        verdict = "FAIL" if not self.ok else "WARN" if self.warning else "OK"
        return f"preflight {stage} {verdict} {self.name}: {self.detail}"


def _importable(module: str) -> bool:
    # find_spec locates a module without executing it (a parent package of a dotted name is imported).
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torch_build() -> tuple[str, str | None] | None:
    """(torch version, the CUDA runtime it was built for or None for a CPU build); None without torch."""
    if not _importable("torch"):
        return None
    torch: Any = importlib.import_module("torch")  # lazily: the tokenizer image has no torch
    return str(torch.__version__), torch.version.cuda


def _detect_gpus() -> tuple[list[tuple[str, int]], str]:
    """(name, memory bytes) per visible GPU, and how they were found."""
    if _importable("torch"):
        torch: Any = importlib.import_module("torch")
        if not torch.cuda.is_available():
            return [], f"torch {torch.__version__}, CUDA not available"
        found = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found.append((str(props.name), int(props.total_memory)))
        return found, f"torch {torch.__version__}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no torch and no nvidia-smi on PATH"
    out = subprocess.run(
        [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if out.returncode != 0:
        return [], f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
    found = []
    for row in out.stdout.strip().splitlines():
        name, _, mib = row.rpartition(",")
        found.append((name.strip(), int(float(mib)) * 2**20))
    return found, "nvidia-smi"


class Preflight:
    """Collects checks for one stage; every method returns self so checks can be chained."""

    def __init__(self, stage: str, store: ObjectStore | None = None) -> None:
        self.stage = stage
        self._store = store
        self._checks: list[tuple[str, Callable[[], str]]] = []
        self.results: list[CheckResult] = []

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = ObjectStore()
        return self._store

    def add(self, name: str, check: Callable[[], str]) -> Preflight:
        """Register a check: it returns the OK detail, or raises `CheckError` (or any error) to fail."""
        self._checks.append((name, check))
        return self

    # ------------------------------------------------------------------ checks

    def imports(self, required: Sequence[str] = (), forbidden: Sequence[str] = ()) -> Preflight:
        """Required modules are installed; forbidden ones (e.g. torch in a CPU image) are not."""

        def check() -> str:
            problems = [f"required module {m} is not installed" for m in required if not _importable(m)]
            problems += [f"{m} is importable but this image must not contain it" for m in forbidden if _importable(m)]
            if problems:
                raise CheckError("; ".join(problems))
            parts = []
            if required:
                parts.append(f"required {', '.join(required)} present")
            if forbidden:
                parts.append(f"forbidden {', '.join(forbidden)} absent")
            return "; ".join(parts) or "nothing to check"

        return self.add("imports", check)

    def storage_read(self, prefix: str, allow_empty: bool = False) -> Preflight:
        """The prefix can be listed and its manifest (else its first object) read."""

        def check() -> str:
            objects = self.store.list(prefix)
            if not objects:
                if allow_empty:
                    return f"listed {prefix}: empty"
                raise CheckError(f"nothing under {prefix} (the listing worked but found no objects)")
            manifest = join(prefix, MANIFEST_NAME)
            target = manifest if manifest in objects else objects[0]
            with self.store.open_read(target) as fh:
                fh.read(4096)
            return f"listed {len(objects):,} object(s) under {prefix}, read {target}"

        return self.add("storage_read", check)

    def storage_write(self, prefix: str) -> Preflight:
        """A probe object can be written below the prefix and deleted again."""

        def check() -> str:
            probe = join(prefix, "_preflight", f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                self.store.write_bytes(probe, f"preflight {self.stage}\n".encode())
            except OSError as err:
                if not err.strerror:
                    raise
                raise CheckError(f"the output {prefix} cannot be written: {describe_os_error(err)}") from err
            try:
                self.store.delete(probe)
            except StorageError as err:
                raise CheckError(f"wrote {probe} but cannot delete it: {err}") from err
            if not is_s3(probe):
                # An empty directory left behind would show up in listings of the prefix's parent.
                try:
                    os.rmdir(os.path.dirname(probe))
                except OSError:
                    pass
            return f"wrote and deleted a probe object under {join(prefix, '_preflight')}"

        return self.add("storage_write", check)

    def disk(self, path: str, need_bytes: int) -> Preflight:
        """The filesystem holding `path` (or its nearest existing parent) has `need_bytes` free."""

        def check() -> str:
            probe = os.path.abspath(path)
            while not os.path.exists(probe):
                probe = os.path.dirname(probe)
            free = shutil.disk_usage(probe).free
            detail = f"need {_gib(need_bytes)} at {path}, {_gib(free)} free"
            if free < need_bytes:
                raise CheckError(detail)
            return detail

        return self.add("disk", check)

    def gpus(self, min_count: int, min_memory_gib: float = 0.0) -> Preflight:
        """At least `min_count` GPUs with `min_memory_gib` each; min_count 0 (a CPU stage) skips it.

        With none visible the line says why: no driver loaded, a driver too old for the CUDA runtime of this
        image's torch (both versions), or no device visible to the process (gpu_driver).
        """

        def check() -> str:
            if min_count <= 0:
                return "none required (CPU stage)"
            found, source = _detect_gpus()
            fit = [g for g in found if g[1] >= min_memory_gib * GIB]
            seen = ", ".join(f"{name} {_gib(mem)}" for name, mem in found)
            each = f" with >= {min_memory_gib:g} GiB" if min_memory_gib else ""
            detail = f"need {min_count} GPU(s){each}, found {len(found)} ({source}{': ' + seen if seen else ''})"
            build = _torch_build()
            runtime = build[1] if build else None
            driver = gpu_driver.read_driver()
            if not found:
                reason = gpu_driver.no_gpu_reason(driver, runtime, os.environ, build[0] if build else None)
                raise CheckError(f"{detail}: {reason}")
            if len(fit) < min_count:
                raise CheckError(detail)
            return f"{detail}; {gpu_driver.describe(driver, runtime)}"

        return self.add("gpus", check)

    def input_manifest(
        self,
        store: ObjectStore | None,
        uri: str,
        kind: Kind,
        expected: Mapping[str, Any] | None = None,
        name: str = "input_manifest",
    ) -> Preflight:
        """The input manifest exists, parses, is of `kind` and agrees with `expected` (shards not re-hashed)."""

        def check() -> str:
            try:
                loaded = load_manifest(store or self.store, uri, kind, expected, verify=False)
            except ManifestError as err:
                raise manifest_check_error(err) from err
            m = loaded.manifest
            checked = f", {len(expected)} field(s) agree" if expected else ""
            return (
                f"{kind.value} manifest {loaded.uri}: run {m.run_id}, {len(m.shards):,} shard(s), "
                f"{m.total_records:,} records{checked}"
            )

        return self.add(name, check)

    def credentials(self, uri: str) -> Preflight:
        """For s3:// URIs, the standard AWS chain yields credentials (never printed beyond 4 key chars)."""

        def check() -> str:
            if not is_s3(uri):
                return f"not needed for local path {uri}"
            import boto3

            creds = boto3.session.Session().get_credentials()
            if creds is None:
                raise CheckError(
                    f"no AWS credentials found for {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                    "AWS_PROFILE, or a workload identity (service account role)"
                )
            frozen = creds.get_frozen_credentials()
            if not frozen.access_key or not frozen.secret_key:
                raise CheckError(f"incomplete AWS credentials for {uri} (from {creds.method})")
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            where = f", endpoint {endpoint}" if endpoint else ""
            return f"found via {creds.method}, access key id ...{frozen.access_key[-4:]}{where}"

        return self.add("credentials", check)

    def shm(self, min_bytes: int, path: str = "/dev/shm") -> Preflight:
        """Shared memory for torch/vLLM worker processes (container runtimes default to 64 MiB)."""

        def check() -> str:
            if not os.path.isdir(path):
                raise CheckError(f"{path} does not exist; need {_gib(min_bytes)}")
            total = shutil.disk_usage(path).total
            detail = f"{path} is {_gib(total)}, need {_gib(min_bytes)}"
            if total < min_bytes:
                raise CheckError(detail + " (mount an emptyDir with medium: Memory and a sizeLimit there)")
            return detail

        return self.add("shm", check)

    # ------------------------------------------------------------------ running

    def _run_one(self, name: str, check: Callable[[], str]) -> CheckResult:
        try:
            return CheckResult(name, True, redact(check()), ExitCode.OK)
        except CheckError as err:
            return CheckResult(name, False, redact(str(err)), err.code)
        except CheckWarning as err:
            return CheckResult(name, True, redact(str(err)), ExitCode.OK, warning=True)
        except Exception as err:  # one broken check must not hide the others
            # The one exit-code table decides: a wrong setting stays USAGE, anything else here is the node's.
            code = exit_code_for(err)
            code = code if code in (ExitCode.USAGE, ExitCode.BAD_INPUT) else ExitCode.ENVIRONMENT
            plain = describe_os_error(err) if isinstance(err, OSError) and err.strerror else str(err)
            return CheckResult(name, False, redact(plain) or f"failed ({type(err).__name__})", code)

    def run(self, fold_failures: bool = False) -> int:
        """Run every check, log one line each, return 0, USAGE, BAD_INPUT or ENVIRONMENT.

        `fold_failures` logs the failed checks' lines and the failure summary at DEBUG level only: a stage that
        checks before its work (`check(fold_failures=True)`) reports them in its one error line instead, while
        the passed checks and warnings are logged as `preflight` logs them.
        """
        self.results = []
        for name, check in self._checks:
            result = self._run_one(name, check)
            self.results.append(result)
            level = logging.ERROR if not result.ok else logging.WARNING if result.warning else logging.INFO
            logger.log(logging.DEBUG if fold_failures and not result.ok else level, result.line(self.stage))
        failed = [r for r in self.results if not r.ok]
        if not failed:
            warned = [r.name for r in self.results if r.warning]
            logger.log(logging.INFO, "preflight %s: all %d check(s) passed%s",
                       self.stage, len(self.results),
                       f" ({len(warned)} with a warning: {', '.join(warned)})" if warned else "")
            return ExitCode.OK
        # A wrong setting or bad input wins: moving to another node cannot fix either, so the Job should
        # not retry; a wrong setting comes first, since fixing it may change what the input is checked against.
        codes = {r.code for r in failed}
        code = next((c for c in (ExitCode.USAGE, ExitCode.BAD_INPUT) if c in codes), ExitCode.ENVIRONMENT)
        logger.log(
            logging.DEBUG if fold_failures else logging.ERROR,
            "preflight %s: %d of %d check(s) failed (%s); exit %s",
            self.stage,
            len(failed),
            len(self.results),
            ", ".join(r.name for r in failed),
            describe(code),
        )
        return code

    def check(self, fold_failures: bool = False) -> None:
        """`run()`, raising ConfigError, BadInputError or PreflightError on failure (for use inside a stage)."""
        code = self.run(fold_failures)
        if code == ExitCode.OK:
            return
        failed = "; ".join(f"{r.name}: {r.detail}" for r in self.results if not r.ok)
        if code == ExitCode.USAGE:
            raise ConfigError(f"preflight {self.stage} failed: {failed}")
        if code == ExitCode.BAD_INPUT:
            raise BadInputError(f"preflight {self.stage} failed: {failed}")
        raise PreflightError(f"preflight {self.stage} failed: {failed}")


def manifest_check_error(err: ManifestError) -> CheckError:
    """A manifest that could not be used, as a check's failure: bad input (65) when it is missing, malformed or of
    another run; the environment's (69) when storage failed to answer (no credentials, an unreachable endpoint, a
    missing bucket), which another node or a fixed Secret can cure."""
    cause = err.__cause__
    transient = isinstance(cause, StorageError) and not isinstance(cause, ObjectNotFoundError)
    field = f" (field: {err.field})" if err.field else ""
    return CheckError(f"{err}{field}", ExitCode.ENVIRONMENT if transient else ExitCode.BAD_INPUT)


def io_checks(stage: str, store: ObjectStore, output: str, inputs: Mapping[str, tuple[str, Kind]],
              locations: Sequence[str] = ()) -> Preflight:
    """A stage's start checks (dflash_shared.commands): what its run needs before any work, each failing in a
    second with the exit code of its kind: credentials for its s3:// locations (69), each input manifest present,
    parsed and of its kind (65; a storage fault 69), and a probe written and deleted under the output (69).

    `inputs` maps a check name (e.g. "drafter_manifest") to (prefix or manifest URI, kind); `locations` are other
    places the run reads (a target model), listed only for the credentials check."""
    checks = Preflight(stage, store)
    s3_uris = [uri for uri in (*(uri for uri, _ in inputs.values()), output, *locations) if is_s3(uri)]
    if s3_uris:
        checks.credentials(s3_uris[0])
    for name, (uri, kind) in inputs.items():
        checks.input_manifest(store, uri, kind, name=name)
    return checks.storage_write(output)


# ---------------------------------------------------------------------- command line


class PreflightSettings(StageSettings):
    """The checks to run from the command line; each unset option skips its check."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_PREFLIGHT_")

    stage: str = Field(default="preflight", description="Stage name printed on every line.")
    require: list[str] = Field(default_factory=list, description="Modules that must be importable.")
    forbid: list[str] = Field(default_factory=list, description="Modules that must NOT be importable.")
    read_prefix: list[str] = Field(default_factory=list, description="Prefixes that must be listable and readable.")
    write_prefix: list[str] = Field(default_factory=list, description="Prefixes that must accept a probe write.")
    disk_path: str = Field(default=".", description="Where local scratch data will be written.")
    need_disk_gib: float = Field(default=0.0, ge=0, description="Free space needed at disk_path (0 skips).")
    min_gpus: int = Field(default=0, ge=0, description="GPUs needed (0: CPU stage, check skipped).")
    min_gpu_memory_gib: float = Field(default=0.0, ge=0, description="Memory needed on each of those GPUs.")
    min_shm_gib: float = Field(default=0.0, ge=0, description="Size needed of /dev/shm (0 skips).")
    input_manifest: str | None = Field(default=None, description="Input manifest (or its prefix) to check.")
    input_kind: Kind | None = Field(default=None, description="Kind the input manifest must have.")
    expect: dict[str, Any] = Field(
        default_factory=dict,
        description='Section fields the input manifest must have, as JSON: {"target.enable_thinking": true}.',
    )


def build_preflight(config: PreflightSettings, store: ObjectStore | None = None) -> Preflight:
    pf = Preflight(config.stage, store)
    if config.require or config.forbid:
        pf.imports(config.require, config.forbid)
    s3_uris = [u for u in [*config.read_prefix, *config.write_prefix, config.input_manifest or ""] if is_s3(u)]
    if s3_uris:
        pf.credentials(s3_uris[0])
    for prefix in config.read_prefix:
        pf.storage_read(prefix)
    for prefix in config.write_prefix:
        pf.storage_write(prefix)
    if config.need_disk_gib:
        pf.disk(config.disk_path, int(config.need_disk_gib * GIB))
    pf.gpus(config.min_gpus, config.min_gpu_memory_gib)
    if config.min_shm_gib:
        pf.shm(int(config.min_shm_gib * GIB))
    if config.input_manifest:
        if config.input_kind is None:
            raise ConfigError("--input-manifest needs --input-kind (prompts, completions, tokenized, ...)")
        pf.input_manifest(None, config.input_manifest, config.input_kind, config.expect)
    return pf


def main(argv: Sequence[str] | None = None) -> NoReturn:
    from dflash_shared.cli import run_stage_main

    run_stage_main(
        "preflight", lambda: build_preflight(parse_settings(PreflightSettings, argv, prog="preflight")).run()
    )


if __name__ == "__main__":
    main()
