"""The parts every image shares (docker/common) are current in each Dockerfile, and a hand edit is caught.

No engine, no build: scripts/render_dockerfiles.py compares each docker/<image>/Dockerfile with its fragments.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from image_support import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "render_dockerfiles.py"
# Parts no image may go without: the pinned base, the venv and non-root user, the build record and labels.
EVERY_IMAGE = ("base-image", "venv", "final")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_dockerfiles", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


render_dockerfiles = _load()


def _fragments(tmp_path: Path, **bodies: str) -> Path:
    (tmp_path / "docker" / "common").mkdir(parents=True)
    for name, body in bodies.items():
        (tmp_path / "docker" / "common" / f"{name}.Dockerfile").write_text(f"# {name}: a test part\n\n{body}")
    return tmp_path


def _render(text: str, repo: Path, image: str = "demo") -> str:
    return render_dockerfiles.render(text, image, {}, "docker/demo/Dockerfile", repo)


def test_every_dockerfile_is_current_with_docker_common() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", render_dockerfiles.dockerfiles(), ids=lambda p: p.parent.name)
def test_every_image_takes_the_parts_no_image_goes_without(dockerfile: Path) -> None:
    text = dockerfile.read_text(encoding="utf-8")
    for part in EVERY_IMAGE:
        assert f"# >>> docker/common/{part}.Dockerfile" in text, f"{dockerfile} lacks docker/common/{part}"


def test_a_hand_edit_inside_a_copy_is_rewritten_and_the_image_s_own_lines_are_kept(tmp_path: Path) -> None:
    repo = _fragments(tmp_path, final='LABEL title="dflash-{{name}}"\nUSER 10001:10001\n')
    current = ("FROM base\nRUN own-step\n# >>> docker/common/final.Dockerfile\n"
               'LABEL title="dflash-demo"\nUSER 10001:10001\n# <<< docker/common/final.Dockerfile\nCMD []\n')
    assert _render(current, repo) == current
    edited = current.replace("USER 10001:10001", "USER 0:0")
    assert _render(edited, repo) == current
    stale = current.replace('LABEL title="dflash-demo"\n', "")
    assert _render(stale, repo) == current


def test_marker_parameters_fill_the_placeholders(tmp_path: Path) -> None:
    repo = _fragments(tmp_path, install="RUN pip install x; {{check}}\n")
    begin = '# >>> docker/common/install.Dockerfile check="/opt/dflash/pip-check.sh --strict"\n'
    text = f"{begin}# <<< docker/common/install.Dockerfile\n"
    assert _render(text, repo) == (f"{begin}RUN pip install x; /opt/dflash/pip-check.sh --strict\n"
                                   "# <<< docker/common/install.Dockerfile\n")


@pytest.mark.parametrize(("text", "message"), [
    ("# >>> docker/common/install.Dockerfile\n# <<< docker/common/install.Dockerfile\n", "needs check=..."),
    ("# >>> docker/common/install.Dockerfile check=a extra=b\n# <<< docker/common/install.Dockerfile\n",
     "no placeholder for extra"),
    ("# >>> docker/common/install.Dockerfile check=a\nRUN x\n", "is not closed"),
    ("# >>> docker/common/install.Dockerfile check=a\n# <<< docker/common/final.Dockerfile\n", "is not closed"),
    ("# >>> docker/common/missing.Dockerfile\n# <<< docker/common/missing.Dockerfile\n", "no such fragment"),
    ("# >>> common/install\n", "names no docker/common fragment"),
])
def test_a_broken_marker_is_an_error_that_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    repo = _fragments(tmp_path, install="RUN pip install x; {{check}}\n")
    with pytest.raises(render_dockerfiles.RenderError, match=message) as caught:
        _render(text, repo)
    assert "docker/demo/Dockerfile:1" in str(caught.value) or "docker/common/missing" in str(caught.value)
