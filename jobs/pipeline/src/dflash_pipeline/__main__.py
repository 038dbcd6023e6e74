"""`python -m dflash_pipeline {render,submit,cancel,status,plan,local,drive,wait}`: run a pipeline on Kubernetes.

    render --config run.toml [--stage tokenize | --setup] [--format yaml|json] [--out DIR]
    submit --config run.toml [--stage tokenize | --setup] [--dry-run] [--kubectl PATH]
    cancel RUN_ID [--namespace NS] [--dry-run]
    status --config run.toml [--json]
    plan   --config run.toml [--json] [--offline]
    local  --config run.toml [--stage tokenize] [--repo DIR] [--log-dir DIR] [--verbose]
    drive  --run-id ID --root s3://... [--namespace NS] [--poll-seconds S] [--max-poll-seconds S]
    wait   --manifest s3://.../manifest.json [--timeout-seconds N] [--poll-seconds S]

`render` prints the run's objects as a multi-document stream (or writes a kustomize base with --out);
`submit` pipes the same stream to `kubectl apply -f -` (`--setup`: the namespace's one-time setup instead);
`cancel` deletes one run's objects and stops its Jobs; `status` reads the run's prefixes; `plan` sizes every
stage (pods, GPU-hours, wall time, disk) before anything is submitted; `drive` is the run driver (the
in-cluster Job that creates each stage's Job once its input is committed); `wait` blocks a script until a
manifest is committed; `local` runs the same stages on this machine (the demo).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from dflash_pipeline.base import write_base
from dflash_pipeline.config import load_run_config
from dflash_pipeline.namespace_setup import setup_documents
from dflash_pipeline.run_objects import render_documents
from dflash_pipeline.status import format_status, run_status
from dflash_pipeline.wait import wait_for_manifest
from dflash_pipeline.yaml_out import dump_all
from dflash_shared.cli import run_stage_main
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore


class _Parser(argparse.ArgumentParser):
    """Exits USAGE (64) on a bad command line, like every stage, instead of argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))


_EXAMPLES = """examples:
  dflash-pipeline plan --config k8s/example-run.toml --offline
  dflash-pipeline render --config k8s/example-run.toml | less
  dflash-pipeline submit --config k8s/example-run.toml --dry-run
  dflash-pipeline status --config k8s/example-run.toml"""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dflash_pipeline", description=__doc__.splitlines()[0], epilog=_EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("render", "print the run's Kubernetes objects"), ("submit", "kubectl apply them"),
                       ("status", "show each stage's progress from storage")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
        if name != "status":
            cmd.add_argument("--stage", action="append", help="only this stage's Job (repeatable)")
            cmd.add_argument("--setup", action="store_true",
                             help="the namespace's one-time setup (Namespace, stage ServiceAccount), not the run")
    render = sub.choices["render"]
    render.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format")
    render.add_argument("--out", type=Path, help="write a kustomize base into this directory instead")
    submit = sub.choices["submit"]
    submit.add_argument("--dry-run", action="store_true", help="print what would be applied, apply nothing")
    submit.add_argument("--kubectl", default="kubectl", help="kubectl executable")
    sub.choices["status"].add_argument("--json", action="store_true", help="machine-readable output")
    plan = sub.add_parser("plan", help="size every stage before submitting: pods, GPU-hours, wall time, disk")
    plan.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--offline", action="store_true",
                      help="read no manifests from the object store (figures from the run file and estimates only)")
    local = sub.add_parser("local", help="run every stage on this machine, each in its own environment")
    local.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    local.add_argument("--repo", type=Path, default=Path.cwd(), help="checkout holding .venv, .venv-generate, ...")
    local.add_argument("--stage", action="append", help="only this stage (repeatable)")
    local.add_argument("--log-dir", type=Path, default=None,
                       help="where each stage's full output goes (default: <repo>/logs/<run_id>)")
    local.add_argument("--verbose", action="store_true", help="print every line of every stage, engines' included")
    cancel = sub.add_parser("cancel", help="delete one run's objects and stop its Jobs (nothing shared)")
    cancel.add_argument("run_id", metavar="RUN_ID", help="the run file's run_id")
    cancel.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE") or "dflash",
                        help="namespace of the run (default: $POD_NAMESPACE, else dflash)")
    cancel.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    drive = sub.add_parser("drive", help="the run driver (in the cluster): create each stage's Job once its input "
                           "is committed, stop the run when one fails")
    drive.add_argument("--run-id", required=True, help="run whose stage templates to drive")
    drive.add_argument("--root", required=True, help="the run file's root (state: <root>/<run_id>/driver/)")
    drive.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE") or None,
                       help="namespace of the run (default: $POD_NAMESPACE, the driver pod's own)")
    drive.add_argument("--run-object", default=os.environ.get("DFLASH_RUN_OBJECT") or None,
                       help="the run object ConfigMap (default: $DFLASH_RUN_OBJECT, else dflash-<run-id>-run)")
    drive.add_argument("--poll-seconds", type=float, default=15.0, help="first interval between checks")
    drive.add_argument("--max-poll-seconds", type=float, default=300.0,
                       help="the interval doubles up to this while nothing changes")
    wait = sub.add_parser("wait", help="block until a manifest is committed (scripts, CI)")
    wait.add_argument("--manifest", required=True, help="manifest URI to wait for")
    wait.add_argument("--timeout-seconds", type=float, default=2 * 86400, help="give up (exit 65) after this")
    wait.add_argument("--poll-seconds", type=float, default=30.0, help="time between checks")
    return parser


def _stream(args: argparse.Namespace, fmt: str = "yaml") -> str:
    if args.setup and args.stage:
        raise ConfigError("--setup renders the namespace's setup, which has no stages; leave out --stage")
    run = load_run_config(args.config)
    docs = setup_documents(run) if args.setup else render_documents(run, args.stage)
    if fmt == "json":
        return "".join(json.dumps(doc, indent=2) + "\n" for doc in docs)
    return dump_all(docs, _header(args.config, docs, args.setup))


def _header(run_file: Path, docs: list[dict], setup: bool) -> list[str]:
    """The comment heading `render`: what the objects are and what to run next."""
    kinds: dict[str, int] = {}
    for doc in docs:
        kinds[str(doc.get("kind"))] = kinds.get(str(doc.get("kind")), 0) + 1
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    lines = [f"Rendered from {run_file.name} by python -m dflash_pipeline: {listed}."]
    cli = "python -m dflash_pipeline"
    if setup:
        lines.append("The namespace's one-time setup; apply it once (submit --setup), then submit the run.")
        return lines
    if any(doc.get("kind") == "CronJob" and doc.get("spec", {}).get("suspend") for doc in docs):
        lines.append("The suspended CronJobs never fire: they are the stages' Job templates, which the run driver "
                     "turns into Jobs once each stage's input is committed.")
    lines += [f"Next: `{cli} submit --config {run_file} --dry-run`, then without --dry-run (kubectl apply);",
              f"`{cli} status --config {run_file}` follows the run; `{cli} plan --config {run_file}` sizes it."]
    return lines


def _render(args: argparse.Namespace) -> int:
    if args.out:
        if args.stage:
            raise ConfigError("--out writes the whole run; leave out --stage")
        for path in write_base(load_run_config(args.config), args.config.name, args.out, setup=args.setup):
            print(path)
        return ExitCode.OK
    sys.stdout.write(_stream(args, args.format))
    return ExitCode.OK


def _submit(args: argparse.Namespace) -> int:
    stream = _stream(args)
    command = [args.kubectl, "apply", "-f", "-"]
    if args.dry_run:
        sys.stdout.write(stream)
        print(f"dry run: would pipe the above to {' '.join(command)}", file=sys.stderr)
        return ExitCode.OK
    if shutil.which(args.kubectl) is None:
        raise ConfigError(f"{args.kubectl!r} not found on PATH; install kubectl or pass --kubectl")
    proc = subprocess.run(command, input=stream, text=True, check=False)
    if proc.returncode != 0:
        print(f"{' '.join(command)} exited {proc.returncode}", file=sys.stderr)
        return ExitCode.RETRYABLE
    return ExitCode.OK


def _status(args: argparse.Namespace) -> int:
    run = load_run_config(args.config)
    statuses = run_status(run, ObjectStore())
    if args.json:
        print(json.dumps([s.to_json() for s in statuses], indent=2))
    else:
        sys.stdout.write(format_status(run, statuses))
    return ExitCode.OK


def _plan(args: argparse.Namespace) -> int:
    from dflash_pipeline.plan import build_plan, format_plan, plan_json

    run = load_run_config(args.config)
    planned = build_plan(run, None if args.offline else ObjectStore())
    if args.json:
        print(json.dumps(plan_json(planned), indent=2))
    else:
        sys.stdout.write(format_plan(planned))
    return ExitCode.OK


def _local(args: argparse.Namespace) -> int:
    from dflash_pipeline.local import run_local_and_report

    return run_local_and_report(load_run_config(args.config), args.repo.resolve(), args.stage, args.log_dir,
                                args.verbose)


def _cancel(args: argparse.Namespace) -> int:
    from dflash_pipeline.cancel import cancel_run
    from dflash_pipeline.kube import Cluster

    deleted = cancel_run(Cluster(args.namespace), args.run_id, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for item in deleted:
        print(f"{verb} {item}")
    if not deleted:
        print(f"no objects of run {args.run_id} in namespace {args.namespace}", file=sys.stderr)
    return ExitCode.OK


def _drive(args: argparse.Namespace) -> int:
    from dflash_pipeline.driver import RunDriver
    from dflash_pipeline.kube import Cluster

    if not args.namespace:
        raise ConfigError("drive: --namespace is not given and POD_NAMESPACE is not set")
    driver = RunDriver(Cluster(args.namespace), ObjectStore(), args.root, args.run_id, poll_s=args.poll_seconds,
                       max_poll_s=args.max_poll_seconds, run_object=args.run_object)
    return driver.run()


def _wait(args: argparse.Namespace) -> int:
    return wait_for_manifest(ObjectStore(), args.manifest, args.timeout_seconds, args.poll_seconds)


def main(argv: list[str] | None = None) -> NoReturn:
    args = _parser().parse_args(argv)
    commands = {"render": _render, "submit": _submit, "status": _status, "plan": _plan, "local": _local,
                "cancel": _cancel, "drive": _drive, "wait": _wait}
    run_stage_main(f"pipeline {args.command}", lambda: commands[args.command](args))


if __name__ == "__main__":
    main()
