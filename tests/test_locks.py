"""The hash-pinned locks (scripts/locks.py, made by `make lock`) match their inputs, and the environments' locks
hold what the environments promise. Offline and quick: the inputs' hash is compared with each lock's header.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENTS = ("dev", "train", "generate")


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "scripts" / "locks.py"), "check"], cwd=root,
                          capture_output=True, text=True, check=False)


def _pins(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", lock.read_text(), re.M))


def test_every_lock_matches_its_inputs() -> None:
    proc = _check(REPO)
    assert proc.returncode == 0, f"a lock is stale, run `make lock`:\n{proc.stderr}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the locks are made from, and the locks."""
    patterns = ["scripts/locks.py", "docker/*/Dockerfile", "requirements/*", "shared/pyproject.toml",
                "jobs/*/pyproject.toml", "jobs/*/requirements*", "jobs/*/*requirements.in"]
    for pattern in patterns:
        for path in REPO.glob(pattern):
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return tmp_path


def test_a_changed_input_makes_its_lock_stale(tree: Path) -> None:
    assert _check(tree).returncode == 0
    test_in = tree / "jobs" / "generate" / "test-requirements.in"
    # A comment or a blank line changes no resolution.
    test_in.write_text("# a note\n\n" + test_in.read_text().replace("\n", "   # why\n", 1))
    assert _check(tree).returncode == 0, _check(tree).stderr
    test_in.write_text(test_in.read_text() + "rich\n")
    proc = _check(tree)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "requirements/generate.lock: stale, its inputs changed since it was made (make lock): "
        "requirements/generate.in, jobs/generate/requirements-cpu.lock, jobs/generate/requirements-cpu.in, "
        "jobs/generate/test-requirements.in, requirements/generate.overrides, jobs/generate/requirements-cpu.overrides"
    ]


def test_a_changed_package_dependency_makes_the_locks_that_install_it_stale(tree: Path) -> None:
    pyproject = tree / "jobs" / "train" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('  "numpy>=1.26",\n', '  "numpy>=1.26",\n  "rich",\n', 1))
    stale = sorted(line.split(":")[0] for line in _check(tree).stderr.splitlines())
    # The images list the package's dependencies themselves (their tests check that they do).
    assert stale == ["requirements/dev.lock", "requirements/generate.lock", "requirements/train.lock"]


def test_an_image_relock_makes_the_environment_built_on_it_stale(tree: Path) -> None:
    lock = tree / "jobs" / "generate" / "requirements-cpu.lock"
    lock.write_text(lock.read_text().replace("\nvllm-cpu==0.32.0 ", "\nvllm-cpu==0.32.1 ", 1))
    stale = [line.split(":")[0] for line in _check(tree).stderr.splitlines()]
    assert stale == ["requirements/generate.lock"]


def test_an_input_no_lock_covers_is_named(tree: Path) -> None:
    (tree / "jobs" / "train" / "requirements-extra.in").write_text("rich\n")
    assert _check(tree).stderr.splitlines() == [
        "jobs/train/requirements-extra.in: no image installs its lock and no requirements/*.in reads it"
    ]


def test_the_environment_locks_hold_only_hashed_pins_one_moto_and_the_right_torch() -> None:
    pins = {}
    for env in ENVIRONMENTS:
        lock = REPO / "requirements" / f"{env}.lock"
        text = lock.read_text()
        assert not re.search(r"^(-e|--editable|dflash)", text, re.M), f"{lock.name} names a project package"
        requirements = re.findall(r"^[a-z0-9].*$", text, re.M)
        assert all(r.endswith("\\") for r in requirements), f"{lock.name} has a pin without hashes"
        pins[env] = _pins(lock)
    assert {env: p["moto"] for env, p in pins.items()} == dict.fromkeys(ENVIRONMENTS, "5.2.6")
    assert "torch" not in pins["dev"]
    # .venv-train: the CPU wheel, by its local version; .venv-generate: the CPU generator image's CUDA build.
    assert pins["train"]["torch"].endswith("+cpu")
    image = _pins(REPO / "jobs" / "generate" / "requirements-cpu.lock")
    assert pins["generate"]["torch"] == image["torch"] == "2.13.0"
    assert {name: pins["generate"][name] for name in image} == image
