"""Copy the parts every image shares (docker/common/*.Dockerfile) into each docker/<image>/Dockerfile.

`make dockerfiles` after editing a common part; `--check` changes nothing and exits 1 when a Dockerfile's copy
differs from its fragment (out of date, or edited by hand), which the test suite runs.

A Dockerfile takes a common part between two marker lines, the begin marker naming the fragment and any
parameters (shell quoting):

    # >>> docker/common/install.Dockerfile check="pip check"
    (the fragment's text: written by this script)
    # <<< docker/common/install.Dockerfile

What is copied is the fragment after its header (its leading comment block up to the first blank line, which
describes the fragment itself), with `{{name}}` replaced by the image's name (its folder under docker/) and any
other `{{key}}` by the begin marker's `key=value`. A placeholder without a value, or a value that no placeholder
uses, is an error. Everything outside the markers is the image's own and left as it is.

Why copies, not one base image: the shared steps sit between each image's own ones (system packages come before
the venv, the dependency layer before the source layer, the build record after everything), and a Dockerfile
has no include. A base image built first would need its own build, tag and digest pin before any stage image
could build; copies keep every Dockerfile whole, so any engine builds it alone and hadolint and the tests that
read a Dockerfile see all of it.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN = re.compile(r"^# >>> (?P<path>docker/common/[A-Za-z0-9_-]+\.Dockerfile)(?P<params>(?: .*)?)$")
END = "# <<< {path}"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


class RenderError(Exception):
    """A marker or a fragment that cannot be rendered; the message names the file and line."""


@dataclass(frozen=True)
class Fragment:
    """One common part: what is copied (its text after the header) and the placeholders in it."""

    path: str
    body: str

    @classmethod
    def read(cls, repo: Path, path: str) -> Fragment:
        file = repo / path
        if not file.is_file():
            raise RenderError(f"{path}: no such fragment")
        lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
        # The header describes the fragment to whoever edits it; the images' own comments follow it.
        try:
            blank = next(i for i, line in enumerate(lines) if not line.strip())
        except StopIteration:
            raise RenderError(f"{path}: no blank line after the header comment") from None
        if blank == 0 or not all(line.startswith("#") for line in lines[:blank]):
            raise RenderError(f"{path}: must start with a header comment, then a blank line")
        body = "".join(lines[blank + 1 :]).rstrip("\n") + "\n"
        if not body.strip():
            raise RenderError(f"{path}: nothing after the header")
        return cls(path, body)

    def render(self, params: dict[str, str], where: str) -> str:
        missing = sorted(set(PLACEHOLDER.findall(self.body)) - params.keys())
        if missing:
            raise RenderError(f"{where}: {self.path} needs {', '.join(k + '=...' for k in missing)} on its marker")
        unused = sorted(params.keys() - set(PLACEHOLDER.findall(self.body)) - {"name"})
        if unused:
            raise RenderError(f"{where}: {self.path} has no placeholder for {', '.join(unused)}")
        return PLACEHOLDER.sub(lambda m: params[m.group(1)], self.body)


def parse_params(text: str, where: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for token in shlex.split(text):
        key, sep, value = token.partition("=")
        if not sep or not re.fullmatch(r"\w+", key) or key == "name" or key in params:
            raise RenderError(f"{where}: bad marker parameter {token!r} (key=value, each key once, not name)")
        params[key] = value
    return params


def render(text: str, image: str, fragments: dict[str, Fragment], label: str, repo: Path = REPO) -> str:
    """The Dockerfile `text` of image `image` with every marked part rewritten from its fragment."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        match = BEGIN.match(line.rstrip("\n"))
        if not match:
            if line.startswith(("# >>>", "# <<<")):
                raise RenderError(f"{label}:{i}: a marker line that names no docker/common fragment: {line.strip()}")
            continue
        where, path = f"{label}:{i}", match["path"]
        end = END.format(path=path)
        close = next((j for j in range(i, len(lines)) if lines[j].startswith(("# >>>", "# <<<"))), None)
        if close is None or lines[close].rstrip("\n") != end:
            raise RenderError(f"{where}: {path} is not closed by '{end}' before the next marker")
        if path not in fragments:
            fragments[path] = Fragment.read(repo, path)
        out.append(fragments[path].render({**parse_params(match["params"], where), "name": image}, where))
        out.append(lines[close])
        i = close + 1
    return "".join(out)


def dockerfiles(repo: Path = REPO) -> list[Path]:
    return sorted(repo.glob("docker/*/Dockerfile"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a Dockerfile is not current")
    args = parser.parse_args(argv)

    fragments: dict[str, Fragment] = {}
    stale = []
    try:
        for file in dockerfiles():
            label = str(file.relative_to(REPO))
            text = file.read_text(encoding="utf-8")
            rendered = render(text, file.parent.name, fragments, label)
            if rendered == text:
                continue
            stale.append(label)
            if args.check:
                sys.stderr.writelines(difflib.unified_diff(
                    text.splitlines(keepends=True), rendered.splitlines(keepends=True), label, f"{label} (rendered)"))
            else:
                file.write_text(rendered, encoding="utf-8")
                print(f"rewrote {label}")
    except RenderError as exc:
        print(f"render_dockerfiles: {exc}", file=sys.stderr)
        return 2
    unused = sorted(str(p.relative_to(REPO)) for p in (REPO / "docker" / "common").glob("*.Dockerfile")
                    if str(p.relative_to(REPO)) not in fragments)
    if unused:
        print(f"render_dockerfiles: no Dockerfile uses {', '.join(unused)}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"render_dockerfiles: out of date with docker/common: {', '.join(stale)}; "
              "edit the part in docker/common, not its copy, then run `make dockerfiles`", file=sys.stderr)
        return 1
    if not stale:
        print(f"{len(dockerfiles())} Dockerfiles current with {len(fragments)} common parts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
