"""Run the containers of a rendered Job's pod as local processes, as closely as a kubelet would.

There is no cluster here, so this stands in for one pod of an Indexed Job: each init container, then
the main container, runs its `command` + `args` exactly as written, with the environment a container of
that image gets there and nothing else from the test process:

- the image's ENV (read from docker/<image>/Dockerfile), then envFrom Secrets, then the container's env;
- what Kubernetes adds: JOB_COMPLETION_INDEX, HOSTNAME, KUBERNETES_SERVICE_*, and the pod's name and
  namespace where the downward API asks for them (`fieldRef`);
- every emptyDir mount becomes a fresh directory of the pod, and a path under a mount path (in env values
  and arguments) is rewritten to that directory, since the processes share this machine's filesystem;
- the image's virtualenv (/opt/venv) is this repository's .venv, where the stage packages are installed
  (or another environment, e.g. .venv-train for the trainer image), and a file the Dockerfile COPYs into
  the image (the entrypoint script) is run from the repository;
- `$(VAR)` references in command and args are expanded from the container's environment, as the kubelet
  does (`$$` escapes a `$`; a reference to an undefined variable stays as written).

Anything this does not know how to emulate (a volume other than emptyDir, valueFrom env other than the pod's
name and namespace, a command that resolves nowhere) fails the test instead of being skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
IMAGE_VENV = "/opt/venv"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ContainerRun:
    name: str
    argv: list[str]
    returncode: int
    output: str


@dataclass(frozen=True)
class ContainerProcess:
    """One container of the pod, ready to start: the resolved argv, its environment and working directory."""

    name: str
    argv: list[str]  # as written in the manifest (references expanded)
    command: list[str]  # what runs here: argv[0] resolved, container paths mapped to the pod's directories
    env: dict[str, str]
    cwd: Path


def _dockerfile(image: str) -> Path:
    name = image.rsplit("/", 1)[-1].split(":", 1)[0].removeprefix("dflash-")
    path = REPO_ROOT / "docker" / name / "Dockerfile"
    if not path.is_file():
        raise AssertionError(f"image {image!r} has no Dockerfile at {path}")
    return path


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def image_env(image: str) -> dict[str, str]:
    """The ENV of the image's final stage, ARG defaults substituted (DFLASH_IMAGE is the Job's image)."""
    args: dict[str, str] = {}
    env: dict[str, str] = {"PATH": BASE_PATH}

    def expand(value: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), args.get(m.group(1), "")), value)

    for word, rest in _instructions(_dockerfile(image)):
        if word == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        elif word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = expand(value)
    env["DFLASH_IMAGE"] = image
    return env


def image_files(image: str) -> dict[str, Path]:
    """Destination in the image -> source file in the repository, for every COPY of a single file."""
    files = {}
    for word, rest in _instructions(_dockerfile(image)):
        if word == "COPY":
            parts = [p for p in rest.split() if not p.startswith("--")]
            if len(parts) == 2 and (REPO_ROOT / parts[0]).is_file():
                files[parts[1]] = REPO_ROOT / parts[0]
    return files


def expand_references(value: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of command and args: $(NAME) from the environment, $$ -> $."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, value)


class PodPaths:
    """Container paths -> this pod's directories (emptyDir mounts, the image venv)."""

    def __init__(self, mounts: dict[str, Path], venv: Path = VENV) -> None:
        self.table = sorted({**mounts, IMAGE_VENV: venv}.items(), key=lambda kv: -len(kv[0]))

    def map(self, value: str) -> str:
        if ":" in value and "://" not in value and value.startswith("/"):  # PATH-like lists
            return ":".join(self.map(part) for part in value.split(":"))
        for container_path, local in self.table:
            if value == container_path or value.startswith(container_path + "/"):
                return str(local) + value[len(container_path):]
        return value


# Downward API fields the emulation knows, and the key of `pod_containers`'s injected values holding each.
_POD_FIELDS = {"metadata.name": "pod-name", "metadata.namespace": "pod-namespace"}


def _env(container: dict[str, Any], pod: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env = image_env(container["image"])
    for source in container.get("envFrom", []):
        if set(source) != {"secretRef"}:
            raise AssertionError(f"envFrom {source} is not emulated")
        ref = source["secretRef"]
        if ref["name"] not in secrets:
            if ref.get("optional"):
                continue
            raise AssertionError(f"container {container['name']}: Secret {ref['name']!r} does not exist "
                                 "(the kubelet reports CreateContainerConfigError)")
        env.update(secrets[ref["name"]])
    for item in container.get("env", []):
        field = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if set(item) == {"name", "valueFrom"} and field in _POD_FIELDS:
            # The downward API: the pod's own name and namespace.
            env[item["name"]] = pod[_POD_FIELDS[field]]
            continue
        if set(item) != {"name", "value"}:
            raise AssertionError(f"env entry {item} is not emulated (only name/value and the pod's name/namespace)")
        env[item["name"]] = item["value"]
    env.update({k: v for k, v in pod.items() if k not in _POD_FIELDS.values()})
    return env


def _resolve(argv0: str, env: dict[str, str], files: dict[str, Path], paths: PodPaths) -> str:
    if argv0 in files:
        return str(files[argv0])
    if argv0.startswith("/"):
        local = paths.map(argv0)
        if os.access(local, os.X_OK):
            return local
        raise AssertionError(f"command {argv0} exists neither in the image nor in the emulated pod")
    found = shutil.which(argv0, path=env["PATH"])
    if found is None:
        raise AssertionError(f"command {argv0!r} not found on the container's PATH {env['PATH']}")
    return found


def pod_containers(job: dict[str, Any], index: int, secrets: dict[str, dict[str, str]], pod_dir: Path,
                   venv: Path = VENV) -> list[ContainerProcess]:
    """The containers of pod `index` of the Job, init containers first, each ready to start here."""
    spec = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed" and 0 <= index < job["spec"]["completions"]
    volumes = {}
    for volume in spec.get("volumes", []):
        if set(volume) != {"name", "emptyDir"}:
            raise AssertionError(f"volume {volume['name']} is not an emptyDir; not emulated")
        volumes[volume["name"]] = pod_dir / "volumes" / volume["name"]
        volumes[volume["name"]].mkdir(parents=True, exist_ok=True)
    workdir = pod_dir / "workdir"
    workdir.mkdir(parents=True, exist_ok=True)
    injected = {
        "JOB_COMPLETION_INDEX": str(index),
        "HOSTNAME": f"{job['metadata']['name']}-{index}-emulated",
        # Set even with enableServiceLinks: false (the API server's own service).
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        # Read through the downward API only (`_POD_FIELDS`).
        "pod-name": f"{job['metadata']['name']}-{index}-emulated",
        "pod-namespace": job["metadata"].get("namespace") or "default",
    }
    out = []
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
        paths = PodPaths(mounts, venv)
        written = _env(container, injected, secrets)
        env = {k: paths.map(v) for k, v in written.items()}
        argv = [expand_references(a, written) for a in [*container.get("command", []), *container.get("args", [])]]
        assert argv, f"container {container['name']} relies on the image's default command"
        resolved = _resolve(argv[0], env, image_files(container["image"]), paths)
        out.append(ContainerProcess(container["name"], argv, [resolved, *(paths.map(a) for a in argv[1:])],
                                    env, workdir))
    return out


def run_pod(job: dict[str, Any], index: int, secrets: dict[str, dict[str, str]], pod_dir: Path,
            timeout: float = 180.0, venv: Path = VENV) -> list[ContainerRun]:
    """Run pod `index` of the Job: init containers in order (stopping at a failure), then the container."""
    runs = []
    for c in pod_containers(job, index, secrets, pod_dir, venv):
        proc = subprocess.run(c.command, env=c.env, cwd=c.cwd, capture_output=True, text=True, timeout=timeout,
                              check=False)
        runs.append(ContainerRun(c.name, c.argv, proc.returncode, proc.stdout + proc.stderr))
        if proc.returncode != 0:
            break
    return runs
