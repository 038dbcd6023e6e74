"""The NVIDIA driver version reader and the diagnosis of "no GPU visible", on fixture version files.

The fixtures are the kernel module's own /proc/driver/nvidia/version lines (proprietary and open modules), written
to a temp dir; the preflight's GPU check reads them through DFLASH_NVIDIA_DRIVER_VERSION_FILE. This environment
has no torch, so the CUDA runtime is passed in here; tests/generate/test_gpu_driver_preflight.py runs the same
check against the real CUDA build of torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dflash_shared import gpu_driver
from dflash_shared.exit_codes import ExitCode
from dflash_shared.preflight import Preflight

OLD = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n" \
      "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
NEW = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  " \
      "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:30 UTC 2025\nGCC version:  gcc version 13.3.0\n"


def version_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "version"
    path.write_text(text)
    return str(path)


def test_both_kernel_module_formats_parse(tmp_path: Path) -> None:
    assert gpu_driver.read_driver(version_file(tmp_path, OLD)).version == (550, 54, 14)
    reading = gpu_driver.read_driver(version_file(tmp_path, NEW))
    assert reading.version == (580, 65, 6) and reading.text == "580.65.06" and reading.loaded


@pytest.mark.parametrize(("driver", "expected"), [
    ((550, 54, 14), "supports CUDA up to 12.4"),
    ((550, 54, 13), "supports CUDA up to 12.3"),  # one patch short of 12.4's least driver
    ((570, 124, 6), "supports CUDA up to 12.8"),
    ((580, 65, 6), "supports CUDA 13.0 or newer"),
    ((440, 33, 1), "supports no CUDA 11 or newer runtime"),
])
def test_newest_cuda_of_a_driver_follows_nvidias_table(driver: tuple[int, ...], expected: str) -> None:
    assert gpu_driver.supports(driver) == expected


def test_a_cuda_13_runtime_on_a_550_driver_names_both_versions(tmp_path: Path) -> None:
    reading = gpu_driver.read_driver(version_file(tmp_path, OLD))
    assert gpu_driver.driver_too_old(reading, "13.0") == (
        "driver 550.54.14 supports CUDA up to 12.4; this image's torch needs CUDA 13.0, driver >= 580")
    # Minor version compatibility: any 12.x runtime runs on 525.60.13 or newer, so a 550 driver serves 12.8.
    assert gpu_driver.driver_too_old(reading, "12.8") is None
    assert gpu_driver.driver_too_old(gpu_driver.read_driver(version_file(tmp_path, NEW)), "13.0") is None
    assert "driver >= 525.60.13" in str(gpu_driver.driver_too_old(gpu_driver.DriverReading("x", (520, 61, 5)), "12.1"))


def test_a_missing_file_means_no_driver_and_an_unreadable_one_is_named(tmp_path: Path) -> None:
    absent = gpu_driver.read_driver(str(tmp_path / "nope"))
    assert not absent.loaded and absent.version is None and absent.problem is None
    garbage = gpu_driver.read_driver(version_file(tmp_path, "not a driver\n"))
    assert garbage.loaded and garbage.problem == f"{tmp_path / 'version'} names no driver version " \
        "(first line: 'not a driver')"
    directory = gpu_driver.read_driver(str(tmp_path))
    assert directory.loaded and directory.problem is not None
    assert directory.problem.startswith(f"{tmp_path} cannot be read (IsADirectoryError")


def test_no_gpu_reasons_tell_the_three_cases_apart(tmp_path: Path) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "void"}
    none = gpu_driver.no_gpu_reason(gpu_driver.read_driver(str(tmp_path / "nope")), "13.0", env, "2.14.1+cu130")
    assert none.startswith(f"no NVIDIA driver loaded: {tmp_path / 'nope'} does not exist")
    old = gpu_driver.no_gpu_reason(gpu_driver.read_driver(version_file(tmp_path, OLD)), "13.0", env, "2.14.1+cu130")
    assert old.startswith("driver too old: driver 550.54.14 supports CUDA up to 12.4; this image's torch needs "
                          "CUDA 13.0, driver >= 580")
    hidden = gpu_driver.no_gpu_reason(gpu_driver.read_driver(version_file(tmp_path, NEW)), "13.0", env, "2.14.1")
    assert hidden.startswith("no device visible: driver 580.65.06 is loaded and new enough")
    assert "CUDA_VISIBLE_DEVICES unset, NVIDIA_VISIBLE_DEVICES='void'" in hidden
    cpu_build = gpu_driver.no_gpu_reason(gpu_driver.read_driver(version_file(tmp_path, NEW)), None, env,
                                         "2.13.0+cpu")
    assert cpu_build.startswith("this image's torch 2.13.0+cpu is a CPU build")


def test_preflight_gpu_check_reads_the_driver_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No torch here (the torch-free environment): the runtime is unknown, so only presence and visibility count.
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("this environment has torch: tests/generate/test_gpu_driver_preflight.py covers it")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for text, expected in ((None, "no NVIDIA driver loaded"), (NEW, "no device visible: driver 580.65.06 is loaded,"),
                           ("garbage", "names no driver version")):
        path = version_file(tmp_path, text) if text else str(tmp_path / "absent")
        monkeypatch.setenv(gpu_driver.DRIVER_VERSION_FILE_ENV, path)
        pf = Preflight("train").gpus(1)
        assert pf.run() == ExitCode.ENVIRONMENT
        assert expected in pf.results[0].detail, pf.results[0].detail
        assert pf.results[0].detail.startswith("need 1 GPU(s), found 0 (")
