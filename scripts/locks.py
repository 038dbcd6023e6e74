"""The project's hash-pinned lock files: which there are, what each is made from, and whether each is current.

Two kinds, both made by docker/lock.sh (`make lock`) with `uv pip compile --generate-hashes`:

  image        jobs/<stage>/requirements*.in -> the .lock beside it, for every lock a docker/*/Dockerfile installs;
               resolved for the images' platform (CPython 3.11, x86_64 manylinux_2_28).
  environment  requirements/<env>.in -> requirements/<env>.lock: dev (.venv, `make venv`), train (.venv-train) and
               generate (.venv-generate). An environment input names the stage files it is made of (-r, and -c for
               an image lock it must agree with) and the project's own packages (-e); those are left out of the
               lock (it is installed with hashes required, which editables cannot have) and installed after it
               without dependencies: the lock holds theirs.

X.overrides and X.excludes beside X.in go to uv as --overrides / --excludes.

Every lock records the sha256 of its inputs in its header (`# inputs-sha256: ...`): the input files followed
through -r/-c, the overrides and excludes, the dependency tables of the -e packages' pyproject.toml and the
resolver flags; comments and blank lines do not count. `check` recomputes them offline and names each lock that
an input has changed since (`make check-locks`, and tests/test_locks.py in the test suite).

Usage: locks.py plan [NAME...]        one line per lock, tab-separated: input, lock, uv flags (for docker/lock.sh)
       locks.py digest INPUT          the header line of INPUT's lock
       locks.py check                 exit 1, naming each lock that is missing or stale
       locks.py editables INPUT       the -e packages of INPUT, one `-e PATH` line each (a requirements file)
       locks.py extraneous LOCK INPUT the distributions installed in this interpreter that neither names

Standard library only: it runs under any Python 3.11, before any environment exists.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# inputs-sha256: "

IMAGE_FLAGS = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28")
# .venv holds no torch: one lock for every platform a developer may build it on (Python 3.11 and later).
UNIVERSAL_FLAGS = ("--universal", "--python-version", "3.11")
# The torch builds these two install (the local CPU wheel, the index's CUDA build) exist for x86_64 Linux only.
ENVIRONMENT_FLAGS = {"train": IMAGE_FLAGS, "generate": IMAGE_FLAGS}
# The packages the seeding of a `python -m venv` brings, kept by `extraneous`: the environment's installer.
SEED = {"pip", "setuptools", "wheel"}

_INCLUDE = re.compile(r"^(-r|--requirement|-c|--constraint)(?:\s*=?\s*)(\S+)$")
_EDITABLE = re.compile(r"^(-e|--editable)(?:\s*=?\s*)(\S+)$")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class Lock:
    kind: str  # "image" or "environment"
    source: Path  # the .in
    flags: tuple[str, ...]

    @property
    def path(self) -> Path:
        return self.source.with_suffix(".lock")

    @property
    def name(self) -> str:
        """What `docker/lock.sh NAME` selects it by: the stage for an image lock, the environment otherwise."""
        return self.source.parent.name if self.kind == "image" else self.source.stem

    def sidecars(self) -> list[Path]:
        return [p for p in (self.source.with_suffix(".overrides"), self.source.with_suffix(".excludes")) if p.is_file()]

    def compile_flags(self) -> list[str]:
        """uv pip compile's flags, less the machine's package sources and the input and output files."""
        flags = list(self.flags)
        for sidecar in self.sidecars():
            flags += [f"--{sidecar.suffix[1:]}", rel(sidecar)]
        if self.kind == "environment":
            for package in sorted(local_packages()):
                flags += ["--no-emit-package", package]
        return flags


def rel(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


def local_packages() -> set[str]:
    """The project's own distributions (shared/ and every jobs/<stage>/)."""
    names = set()
    for pyproject in [ROOT / "shared" / "pyproject.toml", *sorted(ROOT.glob("jobs/*/pyproject.toml"))]:
        names.add(normalize(tomllib.loads(pyproject.read_text())["project"]["name"]))
    return names


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def all_locks() -> list[Lock]:
    """Image locks first: an environment input may constrain itself with one (-c), so it is locked after it."""
    installed = set()
    for dockerfile in sorted(ROOT.glob("docker/*/Dockerfile")):
        installed.update(re.findall(r"\bjobs/[\w.-]+/requirements[\w.-]*\.lock\b", dockerfile.read_text()))
    images = [Lock("image", (ROOT / lock).with_suffix(".in"), IMAGE_FLAGS) for lock in sorted(installed)]
    environments = [Lock("environment", source, ENVIRONMENT_FLAGS.get(source.stem, UNIVERSAL_FLAGS))
                    for source in sorted((ROOT / "requirements").glob("*.in"))]
    return images + environments


def requirement_lines(path: Path) -> list[str]:
    """The lines that count: comments (whole-line and trailing) and blank lines dropped, whitespace trimmed."""
    lines = []
    for line in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            lines.append(line)
    return lines


def includes(path: Path) -> Iterator[Path]:
    """The files a requirements file reads (-r, -c), relative to its own folder."""
    for line in requirement_lines(path):
        match = _INCLUDE.match(line)
        if match:
            yield (path.parent / match.group(2)).resolve()


def editables(path: Path) -> list[Path]:
    """The -e packages of a requirements file (not followed through -r: an input names its own), extras dropped.

    Their paths are relative to the project root, where uv and pip run (as in requirements/dev.in).
    """
    out = []
    for line in requirement_lines(path):
        match = _EDITABLE.match(line)
        if match:
            out.append((ROOT / re.sub(r"\[.*\]$", "", match.group(2))).resolve())
    return out


def closure(path: Path) -> list[Path]:
    """`path` and every file it reads, depth first, each once."""
    seen: list[Path] = []

    def visit(p: Path) -> None:
        if p in seen:
            return
        seen.append(p)
        for q in includes(p):
            visit(q)

    visit(path.resolve())
    return seen


def project_dependencies(package: Path) -> str:
    """What of a package's pyproject.toml a lock depends on: its name, Python range and dependency tables."""
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    keys = ("name", "requires-python", "dependencies", "optional-dependencies")
    return json.dumps({k: project.get(k) for k in keys}, sort_keys=True)


def inputs(lock: Lock) -> list[Path]:
    """The files a lock is made from: its input, its overrides and excludes, and all they read."""
    files = closure(lock.source)
    for sidecar in lock.sidecars():
        files += [f for f in closure(sidecar) if f not in files]
    return files


def digest(lock: Lock) -> str:
    h = hashlib.sha256()
    h.update(f"{lock.kind} {' '.join(lock.flags)}\n".encode())
    files = inputs(lock)
    for f in files:
        h.update(f"== {rel(f)}\n".encode())
        h.update("\n".join(requirement_lines(f)).encode() + b"\n")
    for f in files:
        for package in editables(f):
            h.update(f"== -e {rel(package)}\n".encode())
            h.update(project_dependencies(package).encode() + b"\n")
    return h.hexdigest()


def recorded(lock: Lock) -> str | None:
    if not lock.path.is_file():
        return None
    for line in lock.path.read_text().splitlines()[:10]:
        if line.startswith(HEADER):
            return line[len(HEADER):].split()[0]
    return None


def problems() -> list[str]:
    """One line per lock that is missing or older than its inputs, and per input that no lock covers."""
    out = []
    locks = all_locks()
    for lock in locks:
        if not lock.source.is_file():
            out.append(f"{rel(lock.path)}: its input {rel(lock.source)} is missing")
        elif not lock.path.is_file():
            out.append(f"{rel(lock.path)}: missing (make lock)")
        elif recorded(lock) is None:
            out.append(f"{rel(lock.path)}: records no hash of its inputs (make lock)")
        elif recorded(lock) != digest(lock):
            names = ", ".join(rel(f) for f in inputs(lock))
            out.append(f"{rel(lock.path)}: stale, its inputs changed since it was made (make lock): {names}")
    covered = {f for lock in locks if lock.source.is_file() for f in closure(lock.source)}
    for source in sorted(ROOT.glob("jobs/*/requirements*.in")):
        if source.resolve() not in covered:
            out.append(f"{rel(source)}: no image installs its lock and no requirements/*.in reads it")
    return out


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "plan":
        locks = [lock for lock in all_locks() if not args or lock.name in args]
        unknown = set(args) - {lock.name for lock in locks}
        if unknown:
            names = sorted({lock.name for lock in all_locks()})
            print(f"locks: no lock named {', '.join(sorted(unknown))} (known: {', '.join(names)})", file=sys.stderr)
            return 2
        for lock in locks:
            print("\t".join([rel(lock.source), rel(lock.path), *lock.compile_flags()]))
        return 0
    if command == "digest" and len(args) == 1:
        matching = [lock for lock in all_locks() if lock.source == (Path.cwd() / args[0]).resolve()]
        if not matching:
            print(f"locks: {args[0]} is not the input of a lock", file=sys.stderr)
            return 2
        print(f"{HEADER}{digest(matching[0])} (make check-locks compares it with the inputs)")
        return 0
    if command == "check" and not args:
        found = problems()
        for line in found:
            print(line, file=sys.stderr)
        if not found:
            print(f"locks: {len(all_locks())} locks match their inputs")
        return 1 if found else 0
    if command == "editables" and len(args) == 1:
        for package in editables(Path(args[0])):
            print(f"-e {package}")
        return 0
    if command == "extraneous" and len(args) == 2:
        from importlib.metadata import distributions

        lock_file, source = Path(args[0]), Path(args[1])
        wanted = {normalize(m.group(1)) for line in requirement_lines(lock_file) if (m := _NAME.match(line))}
        wanted |= {normalize(tomllib.loads((p / "pyproject.toml").read_text())["project"]["name"])
                   for p in editables(source)}
        installed = {normalize(d.metadata["Name"]) for d in distributions() if d.metadata["Name"]}
        for name in sorted(installed - wanted - SEED):
            print(name)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
