"""The node's NVIDIA driver against the CUDA runtime an image's torch was built for.

A CUDA 13 build of torch on a node with a 550 driver reports only "CUDA not available", the same words as
a pod that asked for no GPU or a node without a driver at all; Kubernetes then retries it on the same kind
of node. Preflight names which of the three it is, with both versions:

    driver 550.54.14 supports CUDA up to 12.4; this image's torch needs CUDA 13.0, driver >= 580

Where the version comes from: the kernel module's own file, /proc/driver/nvidia/version. It exists exactly
when the driver is loaded on the node (so its absence means "no driver", not "no device visible"), /proc/driver
is not namespaced, so a container sees it whether or not the NVIDIA container toolkit injected GPUs into it,
and reading it loads no library and runs no program (libcuda and nvidia-smi are mounted into a container only
when it was given GPUs, and the tokenizer image has neither torch nor nvidia-smi). The user-space driver the
toolkit mounts is the host's, of the same version as its kernel module, so this is the driver version
cuDriverGetVersion would answer for. One case it does not see: a CUDA forward-compatibility package
(cuda-compat) inside an image would let an older driver run a newer runtime; these images carry none.

Nothing here imports torch: the caller passes `torch.version.cuda` in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
# Only the tests set this: it points the reader at a fixture file in place of the kernel module's.
DRIVER_VERSION_FILE_ENV = "DFLASH_NVIDIA_DRIVER_VERSION_FILE"

Version = tuple[int, ...]

# Newest CUDA toolkit release each driver runs natively: NVIDIA CUDA Toolkit Release Notes, Table 3 "CUDA
# Toolkit and Corresponding Driver Versions" (Linux x86_64, the GA release of each minor version), newest first.
TOOLKIT_MIN_DRIVER: tuple[tuple[tuple[int, int], Version], ...] = (
    ((13, 0), (580, 65, 6)),
    ((12, 9), (575, 51, 3)),
    ((12, 8), (570, 26)),
    ((12, 6), (560, 28, 3)),
    ((12, 5), (555, 42, 2)),
    ((12, 4), (550, 54, 14)),
    ((12, 3), (545, 23, 6)),
    ((12, 2), (535, 54, 3)),
    ((12, 1), (530, 30, 2)),
    ((12, 0), (525, 60, 13)),
    ((11, 8), (520, 61, 5)),
    ((11, 7), (515, 43, 4)),
    ((11, 6), (510, 39, 1)),
    ((11, 0), (450, 36, 6)),
)
# Least driver that runs ANY runtime of a CUDA major version (CUDA minor version compatibility): the same
# release notes, Table 2 "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
# Compatibility": CUDA 13.x >= 580, 12.x >= 525.60.13, 11.x >= 450.80.02. torch's CUDA wheels rely on it.
MAJOR_MIN_DRIVER: dict[int, Version] = {13: (580,), 12: (525, 60, 13), 11: (450, 80, 2)}

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024" (proprietary)
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@...)" (open)
_NVRM = re.compile(r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)\b")


def _dotted(version: Version) -> str:
    return ".".join(str(part) if i == 0 else f"{part:02d}" for i, part in enumerate(version))


@dataclass(frozen=True)
class DriverReading:
    """What the driver version file said: `version` when it could be read, else `problem` says why not."""

    path: str
    version: Version | None = None
    problem: str | None = None  # None with no version: the file does not exist (no driver loaded)

    @property
    def loaded(self) -> bool:
        """Whether a driver is loaded (the file exists, read or not)."""
        return self.version is not None or self.problem is not None

    @property
    def text(self) -> str:
        return _dotted(self.version) if self.version else "unknown"


def read_driver(path: str | None = None) -> DriverReading:
    """The loaded NVIDIA driver's version from its kernel module's version file (see the module docstring)."""
    path = path or os.environ.get(DRIVER_VERSION_FILE_ENV) or DRIVER_VERSION_FILE
    if not os.path.lexists(path):
        return DriverReading(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(4096)
    except OSError as err:
        return DriverReading(path, problem=f"{path} cannot be read ({type(err).__name__}: {err.strerror or err})")
    for line in text.splitlines():
        match = _NVRM.match(line.strip())
        if match:
            return DriverReading(path, version=tuple(int(p) for p in match.group(1).split(".")))
    first = text.strip().splitlines()[0][:120] if text.strip() else "(empty)"
    return DriverReading(path, problem=f"{path} names no driver version (first line: {first!r})")


def parse_runtime(runtime: str) -> tuple[int, int] | None:
    """(major, minor) of a CUDA version string such as torch.version.cuda ("13.0", "12.8")."""
    match = re.match(r"^(\d+)\.(\d+)", runtime.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def newest_cuda(driver: Version) -> tuple[tuple[int, int], bool] | None:
    """(newest CUDA release in the table this driver runs, whether the driver is past the table's newest row)."""
    for i, (release, least) in enumerate(TOOLKIT_MIN_DRIVER):
        if driver >= least:
            return release, i == 0
    return None


def supports(driver: Version) -> str:
    """'supports CUDA up to 12.4' (or '13.0 or newer' past the table, 'no CUDA 11+' below it)."""
    found = newest_cuda(driver)
    if found is None:
        return "supports no CUDA 11 or newer runtime"
    (major, minor), newest = found
    return f"supports CUDA {major}.{minor} or newer" if newest else f"supports CUDA up to {major}.{minor}"


def min_driver(runtime: str) -> Version | None:
    """Least driver a CUDA runtime of this version runs on (minor version compatibility), None if unknown."""
    parsed = parse_runtime(runtime)
    return MAJOR_MIN_DRIVER.get(parsed[0]) if parsed else None


def driver_too_old(reading: DriverReading, runtime: str | None) -> str | None:
    """Both versions, when the loaded driver cannot run this CUDA runtime; None when it can or either is unknown."""
    if reading.version is None or not runtime:
        return None
    least = min_driver(runtime)
    if least is None or reading.version >= least:
        return None
    return (f"driver {reading.text} {supports(reading.version)}; this image's torch needs CUDA {runtime}, "
            f"driver >= {_dotted(least)}")


def describe(reading: DriverReading, runtime: str | None) -> str:
    """One phrase for an OK line: the driver, what it supports, and the runtime it serves."""
    if reading.version is None:
        driver = (f"driver version unknown ({reading.problem})" if reading.problem
                  else f"no driver version file ({reading.path})")
    else:
        driver = f"driver {reading.text} ({supports(reading.version)})"
    least = min_driver(runtime) if runtime else None
    need = f", torch built for CUDA {runtime}" + (f" (needs driver >= {_dotted(least)})" if least else "")
    return driver + (need if runtime else "")


def _visibility(env: Mapping[str, str]) -> str:
    return ", ".join(f"{name}={env[name]!r}" if name in env else f"{name} unset"
                     for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"))


def no_gpu_reason(reading: DriverReading, runtime: str | None, env: Mapping[str, str],
                  torch_version: str | None = None) -> str:
    """Why no GPU is visible although some were asked for: no driver loaded, driver too old, or no device visible."""
    if torch_version is not None and not runtime:
        return (f"this image's torch {torch_version} is a CPU build (torch.version.cuda is None): it cannot use a "
                "GPU; run the image's CUDA build")
    if not reading.loaded:
        return (f"no NVIDIA driver loaded: {reading.path} does not exist (a node without the driver, or the pod "
                "is not on a GPU node: check its nodeSelector / tolerations)")
    too_old = driver_too_old(reading, runtime)
    if too_old:
        return f"driver too old: {too_old} (upgrade the node's driver or schedule onto nodes that have it)"
    if reading.version is None:
        return f"no device visible, and the driver version is unknown: {reading.problem} ({_visibility(env)})"
    enough = " and new enough" if runtime and min_driver(runtime) else ""
    return (f"no device visible: driver {reading.text} is loaded{enough}, but this process sees no GPU "
            f"({_visibility(env)}; request nvidia.com/gpu in the pod's resources, and do not hide devices with "
            "CUDA_VISIBLE_DEVICES)")
