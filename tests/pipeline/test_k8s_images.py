"""Images by digest: the run file pins each image (inline or from the file `make build-images` writes), render
writes `name:tag@sha256:...`, and a cluster overlay that renames the images keeps the digest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline import load_run_config, parse_run_config, render_documents
from dflash_pipeline.render.base import write_base
from dflash_pipeline.run.config import read_run_file
from dflash_shared.errors import ConfigError
from tests.pipeline.k8s_support import EXAMPLE_RUN, OVERLAYS, containers, jobs, kustomize_build

DIGESTS = {name: "sha256:" + f"{i:x}" * 64 for i, name in enumerate(("tokenizer", "generator", "trainer",
                                                                      "pipeline"), start=10)}


def images_of(docs: list[dict[str, Any]]) -> set[str]:
    found = {c["image"] for job in jobs(docs).values() for c in containers(job)}
    return found | {c["image"] for d in docs if d["kind"] == "Job" for c in containers(d)}


def with_digests_file(tmp_path: Path, images: dict[str, Any]) -> Path:
    """The example run file beside a digests file as docker/build-images.sh writes it."""
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "digests.json").write_text(json.dumps({"schema": 1, "revision": "0123abc", "images": {
        name: {"ref": f"localhost/dflash-{name}:0123abc", "digest": digest} for name, digest in images.items()}}))
    text = EXAMPLE_RUN.read_text(encoding="utf-8").replace(
        'tag = "0.1.0"', 'tag = "0123abc"\ndigests_file = "build/digests.json"\nrequire_digests = true')
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_references_are_rendered_by_digest_from_the_build_record(tmp_path: Path) -> None:
    run = load_run_config(with_digests_file(tmp_path, {**DIGESTS, "base": "sha256:" + "0" * 64}))
    refs = images_of(render_documents(run))
    assert refs == {f"localhost/dflash-{name}:0123abc@{DIGESTS[name]}" for name in ("tokenizer", "generator",
                                                                                    "trainer", "pipeline")}


def test_an_image_without_a_digest_is_refused_when_digests_are_required(tmp_path: Path) -> None:
    run = load_run_config(with_digests_file(tmp_path, {k: v for k, v in DIGESTS.items() if k != "trainer"}))
    with pytest.raises(ConfigError, match="image dflash-trainer has no digest and images.require_digests is set"):
        render_documents(run)


def test_a_missing_digests_file_names_the_command_that_writes_it(tmp_path: Path) -> None:
    path = with_digests_file(tmp_path, DIGESTS)
    (tmp_path / "build" / "digests.json").unlink()
    with pytest.raises(ConfigError, match=r"cannot read images.digests_file .*digests.json.*make build-images"):
        load_run_config(path)


@pytest.mark.parametrize(("images", "message"), [
    ({"tag": "latest"}, "moves with every build"),
    ({"digests": {"trainer": "sha256:abc"}}, "not an image digest"),
    ({"digests": {"trainr": DIGESTS["trainer"]}}, "unknown image 'trainr'"),
])
def test_moving_tags_and_bad_digests_are_refused(images: dict[str, Any], message: str) -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["images"] = {**data["images"], **images}
    with pytest.raises(ConfigError, match=message):
        parse_run_config(data)


def test_digests_alone_need_no_tag() -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["images"] = {"registry": "localhost", "digests": DIGESTS}
    refs = images_of(render_documents(parse_run_config(data)))
    assert refs == {f"localhost/dflash-{name}@{DIGESTS[name]}" for name in DIGESTS}
    data["images"] = {"registry": "localhost"}
    with pytest.raises(ConfigError, match="images.tag is not set"):
        render_documents(parse_run_config(data))


def test_the_gpu_cluster_overlay_renames_the_images_and_keeps_their_digests(tmp_path: Path) -> None:
    run = load_run_config(with_digests_file(tmp_path, DIGESTS))
    write_base(run, "run.toml", tmp_path / "k8s" / "base")
    shutil.copytree(OVERLAYS / "gpu-cluster", tmp_path / "k8s" / "overlays" / "gpu-cluster")
    refs = images_of(kustomize_build(tmp_path / "k8s" / "overlays" / "gpu-cluster"))
    assert refs == {f"registry.invalid/dflash/dflash-{name}:0123abc@{digest}" for name, digest in DIGESTS.items()}


def test_the_digests_file_build_images_writes_is_what_a_run_file_reads(tmp_path: Path) -> None:
    """docker/build-images.sh's own writer (its functions, run by bash) over per-image records, then read back."""
    import subprocess

    from dflash_pipeline.run.config import read_digests_file
    from tests.pipeline.k8s_support import REPO_ROOT

    for name, digest in DIGESTS.items():
        (tmp_path / f"{name}.digest").write_text(
            json.dumps({"ref": f"localhost/dflash-{name}:0123abc", "digest": digest, "pushed": False}) + "\n")
    script = REPO_ROOT / "docker" / "build-images.sh"
    functions = (f"source <(sed -n '/^log()/p; /^die()/p; /^write_digests_json()/,/^}}/p' {script}); "
                 "write_digests_json")
    done = subprocess.run(["bash", "-c", functions], env={"BUILD_DIR": str(tmp_path), "GIT_REVISION": "0123abc",
                                                          "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "digests.json").read_text())
    assert written["revision"] == "0123abc" and set(written["images"]) == set(DIGESTS)
    assert read_digests_file(tmp_path / "digests.json") == DIGESTS
