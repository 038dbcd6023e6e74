"""The GPU preflight check against the real CUDA build of torch (2.13.0+cu130 in .venv-generate).

Without a GPU: the driver version is read from fixture copies of the kernel module's version file
(DFLASH_NVIDIA_DRIVER_VERSION_FILE); the CUDA runtime is the one this torch was built for, torch.version.cuda.
A GPU stage asking for one GPU must exit 69 (ENVIRONMENT) and say why none is visible: a driver too old for
the runtime (both versions named), a driver new enough but no device visible, or a version file it cannot read.
On a GPU machine (`pytest -m gpu`) the same check passes and names the device it found.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_shared import gpu_driver
from dflash_shared.exit_codes import ExitCode
from dflash_shared.preflight import Preflight

torch = pytest.importorskip("torch", reason="needs the CUDA build of torch (the generate environment)")

OLD = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
NEW = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"


@pytest.fixture
def driver_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not torch.version.cuda or not torch.version.cuda.startswith("13."):
        pytest.skip(f"torch {torch.__version__} is not a CUDA 13 build")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would pass on it")
    path = tmp_path / "nvidia-version"
    monkeypatch.setenv(gpu_driver.DRIVER_VERSION_FILE_ENV, str(path))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "void")
    return path


def gpu_check() -> tuple[int, str]:
    pf = Preflight("generate").gpus(1)
    code = pf.run()
    return code, pf.results[0].line("generate")


def test_an_old_driver_is_named_with_both_versions(driver_file: Path) -> None:
    driver_file.write_text(OLD)
    code, line = gpu_check()
    assert code == ExitCode.ENVIRONMENT == 69
    assert line.startswith(f"preflight generate FAIL gpus: need 1 GPU(s), found 0 (torch {torch.__version__}, "
                           "CUDA not available): driver too old: ")
    assert ("driver 550.54.14 supports CUDA up to 12.4; this image's torch needs CUDA 13.0, driver >= 580"
            in line)


def test_a_new_enough_driver_passes_the_driver_check_and_names_visibility(driver_file: Path) -> None:
    driver_file.write_text(NEW)
    code, line = gpu_check()
    assert code == ExitCode.ENVIRONMENT  # still no device on this machine
    assert "driver too old" not in line
    assert "no device visible: driver 580.65.06 is loaded and new enough" in line
    assert "NVIDIA_VISIBLE_DEVICES='void'" in line


def test_an_unreadable_version_file_is_named(driver_file: Path) -> None:
    driver_file.mkdir()
    code, line = gpu_check()
    assert code == ExitCode.ENVIRONMENT
    assert f"the driver version is unknown: {driver_file} cannot be read (IsADirectoryError" in line


@pytest.mark.gpu
def test_a_visible_gpu_passes_and_is_named() -> None:
    code, line = gpu_check()
    assert code == ExitCode.OK, line
    assert line.startswith(f"preflight generate OK gpus: need 1 GPU(s), found {torch.cuda.device_count()} "
                           f"(torch {torch.__version__}: {torch.cuda.get_device_name(0)} "), line
