"""`python -m dflash_pipeline {render,submit,pilot,...}`: run a pipeline on Kubernetes (`--help` lists all).

    render --config run.toml [--stage tokenize | --setup] [--pilot] [--format yaml|json] [--out DIR]
    submit --config run.toml [--stage tokenize | --setup] [--dry-run] [--kubectl PATH] [--no-pilot]
           [--target-config config.json]
    pilot  --config run.toml [--dry-run] [--kubectl PATH]
    cancel --config run.toml | RUN_ID [--namespace NS] [--dry-run]
    status --config run.toml [--json] [--pilot]
    logs   --config run.toml [STAGE] [--tail N] [--store-only] [--pilot]
    resume --config run.toml [--dry-run] [--kubectl PATH] [--pilot] [--target-config config.json]
    plan   --config run.toml [--json] [--offline] [--pilot | --from-pilot REPORT] [--target-config config.json]
    local  --config run.toml [--stage tokenize] [--repo DIR] [--log-dir DIR] [--verbose] [--pilot]
    drive  --run-id ID --root s3://... [--namespace NS] [--poll-seconds S] [--max-poll-seconds S]
           [--stuck-after-seconds S]
    wait   --manifest s3://.../prefix[/manifest.json] [--config run.toml] [--timeout-seconds N] [--poll-seconds S]
    restart --config run.toml --stage tokenize [--dry-run]
    stage-model --from DIR|s3://... [--to s3://.../models/NAME] [--config run.toml] [--workers N] [--replace]

`render` prints the run's objects as a multi-document stream (or writes a kustomize base with --out);
`submit` pipes the same stream to `kubectl apply -f -` (`--setup`: the namespace's one-time setup instead);
`pilot` submits the run's pilot (the full run at full shape, its counts reduced: `dflash_pipeline.pilot.derive`),
whose report (`<run>-pilot/report.json`) `status` shows and `plan --from-pilot` re-plans the full run from;
`cancel` deletes one run's objects and stops its Jobs; `status` reads the run's prefixes (progress, a failed
stage's cause and what to run next); `logs` prints the stage pods' logs (the cluster's while the pods exist, the
store's copies after); `resume` deletes the run's failed Jobs and applies it again, the one way to continue a
run that stopped; `plan` sizes every stage (pods, GPU-hours, wall time, disk) before anything is submitted;
`drive` is the run driver (the
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
from typing import NoReturn, TextIO

from dflash_pipeline.drive.status import format_status, run_status
from dflash_pipeline.drive.wait import wait_for_manifest
from dflash_pipeline.render.base import write_base
from dflash_pipeline.render.namespace_setup import setup_documents
from dflash_pipeline.render.run_objects import render_documents
from dflash_pipeline.render.yaml_out import dump_all
from dflash_pipeline.run.config import RunConfig, load_run_config
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
  dflash-pipeline doctor --config k8s/example-run.toml
  dflash-pipeline plan --config k8s/example-run.toml --offline
  dflash-pipeline render --config k8s/example-run.toml | less
  dflash-pipeline submit --config k8s/example-run.toml --dry-run
  dflash-pipeline status --config k8s/example-run.toml
  dflash-pipeline logs --config k8s/example-run.toml train --tail 50
  dflash-pipeline resume --config k8s/example-run.toml --dry-run"""


_TARGET_CONFIG_HELP = ("the target's config.json, for the fit check of every GPU stage (default: [plan] "
                       "target_config, else <target.uri>/config.json from the object store)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dflash_pipeline", description=__doc__.splitlines()[0], epilog=_EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("render", "print the run's Kubernetes objects"), ("submit", "kubectl apply them"),
                       ("status", "show each stage's progress from storage")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
        if name == "submit":
            cmd.add_argument("--no-pilot", action="store_true",
                             help="submit a full run without its pilot's report, and without the warning")
        else:
            cmd.add_argument("--pilot", action="store_true", help="the run's pilot instead (<run_id>-pilot)")
        if name != "status":
            cmd.add_argument("--stage", action="append",
                             help="only this stage (repeatable): its Job template and Service, with the run object "
                             "and the run driver's objects")
            cmd.add_argument("--setup", action="store_true",
                             help="the namespace's one-time setup (Namespace, stage ServiceAccount), not the run")
    render = sub.choices["render"]
    render.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format")
    render.add_argument("--out", type=Path, help="write a kustomize base into this directory instead")
    submit = sub.choices["submit"]
    submit.add_argument("--dry-run", action="store_true", help="print what would be applied, apply nothing")
    submit.add_argument("--kubectl", default="kubectl", help="kubectl executable")
    submit.add_argument("--target-config", type=Path, help=_TARGET_CONFIG_HELP)
    sub.choices["status"].add_argument("--json", action="store_true", help="machine-readable output")
    plan = sub.add_parser("plan", help="size every stage before submitting: pods, GPU-hours, wall time, disk")
    plan.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--offline", action="store_true",
                      help="read no manifests from the object store (figures from the run file and estimates only)")
    plan.add_argument("--target-config", type=Path, help=_TARGET_CONFIG_HELP)
    which = plan.add_mutually_exclusive_group()
    which.add_argument("--pilot", action="store_true", help="plan the run's pilot, and what it costs beside the run")
    which.add_argument("--from-pilot", metavar="REPORT",
                       help="re-plan the run from its pilot's report.json (a path or s3:// URI)")
    pilot = sub.add_parser("pilot", help="submit the run's pilot: full shape, reduced counts, its own run id")
    pilot.add_argument("--config", required=True, type=Path, help="the full run's file (.toml or .json)")
    pilot.add_argument("--dry-run", action="store_true", help="print what would be applied, apply nothing")
    pilot.add_argument("--kubectl", default="kubectl", help="kubectl executable")
    local = sub.add_parser("local", help="run every stage on this machine, each in its own environment")
    local.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    local.add_argument("--repo", type=Path, default=_checkout(),
                       help="checkout holding .venv, .venv-generate, ... (default: the one this package runs from, "
                       "whatever the current directory)")
    local.add_argument("--stage", action="append", help="only this stage (repeatable)")
    local.add_argument("--log-dir", type=Path, default=None,
                       help="where each stage's full output goes (default: <repo>/logs/<run_id>)")
    local.add_argument("--verbose", action="store_true", help="print every line of every stage, engines' included")
    local.add_argument("--pilot", action="store_true", help="run the run's pilot, then write its report")
    logs = sub.add_parser("logs", help="print the stage pods' logs: the cluster's while the pods exist, the store's "
                          "copies after")
    logs.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    logs.add_argument("stage", nargs="?", metavar="STAGE", help="only this stage's pods (`driver`: the run driver's)")
    logs.add_argument("--tail", type=int, metavar="N", help="the last N lines of each log")
    logs.add_argument("--store-only", action="store_true", help="read only the copies in the store, not the cluster")
    logs.add_argument("--pilot", action="store_true", help="the run's pilot instead (<run_id>-pilot)")
    resume = sub.add_parser("resume", help="continue a stopped run: delete its failed Jobs (the driver's too), "
                            "then apply it again; committed work is kept")
    resume.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    resume.add_argument("--dry-run", action="store_true", help="list what would be deleted and applied, do nothing")
    resume.add_argument("--kubectl", default="kubectl", help="kubectl executable")
    resume.add_argument("--pilot", action="store_true", help="the run's pilot instead (<run_id>-pilot)")
    resume.add_argument("--target-config", type=Path, help=_TARGET_CONFIG_HELP)
    cancel = sub.add_parser("cancel", help="delete one run's objects and stop its Jobs (nothing shared)")
    cancel.add_argument("run_id", metavar="RUN_ID", nargs="?", help="the run's run_id (or give --config)")
    cancel.add_argument("--config", type=Path, help="run file (.toml or .json): its run_id and namespace")
    cancel.add_argument("--namespace", default=None,
                        help="namespace of the run (default: the run file's, else $POD_NAMESPACE, else dflash)")
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
    drive.add_argument("--stuck-after-seconds", type=float, default=600.0,
                       help="fail a stage whose pod cannot start (image pull, missing Secret, no node) after this")
    drive.add_argument("--max-poll-seconds", type=float, default=300.0,
                       help="the interval doubles up to this while nothing changes")
    wait = sub.add_parser("wait", help="block until a manifest is committed (scripts, CI)")
    wait.add_argument("--manifest", required=True,
                      help="the manifest to wait for: its URI, or the stage's prefix (PREFIX/manifest.json)")
    wait.add_argument("--config", type=Path, help="run file: its [storage] endpoint_url and region apply where the "
                      "environment sets none")
    wait.add_argument("--timeout-seconds", type=float, default=2 * 86400, help="give up (exit 65) after this")
    wait.add_argument("--poll-seconds", type=float, default=30.0, help="time between checks")
    restart = sub.add_parser("restart", help="start a stage's output over under new settings: delete it and "
                             "every later stage's output")
    restart.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    restart.add_argument("--stage", required=True, help="the stage to start over (the later stages' outputs go too)")
    restart.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    restart.add_argument("--pilot", action="store_true", help="the run's pilot instead (<run_id>-pilot)")
    doctor = sub.add_parser("doctor", help="check the run file against the cluster and the object store before the "
                            "pilot: namespace, rights, Secret, nodes, queues, images; exit 0 or 69")
    doctor.add_argument("--config", required=True, type=Path, help="run file (.toml or .json)")
    doctor.add_argument("--no-image-probe", action="store_true",
                        help="leave out the probe pods that pull each image on its stage's nodes")
    doctor.add_argument("--probe-timeout-seconds", type=int, default=300,
                        help="how long a probe pod may take to be scheduled and pull its image")
    stage = sub.add_parser("stage-model", help="upload a target model's folder to the object store, each file "
                           "verified (size, sha256); a rerun resumes")
    stage.add_argument("--from", dest="source", required=True,
                       help="model folder (config.json, *.safetensors, tokenizer, chat template), or s3://... to copy")
    stage.add_argument("--to", help="s3://.../models/NAME (default: the run file's target.uri)")
    stage.add_argument("--config", type=Path, help="run file: its target.uri is the default --to, its [storage] "
                       "endpoint_url and region apply where AWS_ENDPOINT_URL is not set")
    stage.add_argument("--workers", type=int, default=4, help="files hashed and uploaded at once")
    stage.add_argument("--replace", action="store_true",
                       help="overwrite another model staged at --to (its other files are deleted)")
    stage.add_argument("--scratch", help="where an s3:// --from is copied first (default: the temp directory)")
    return parser


def _stream(args: argparse.Namespace, fmt: str = "yaml") -> str:
    if args.setup and args.stage:
        raise ConfigError("--setup renders the namespace's setup, which has no stages; leave out --stage")
    run = _run(args)
    docs = setup_documents(run) if args.setup else render_documents(run, args.stage)
    if fmt == "json":
        return "".join(json.dumps(doc, indent=2) + "\n" for doc in docs)
    return dump_all(docs, _header(args.config, docs, args.setup))


def _run(args: argparse.Namespace) -> RunConfig:
    """The run file's run, or its pilot with --pilot (the `pilot` command always)."""
    run = load_run_config(args.config)
    if getattr(args, "pilot", False) or args.command == "pilot":
        from dflash_pipeline.pilot.derive import derive_pilot

        return derive_pilot(run)
    return run


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
    if any(doc.get("kind") == "ConfigMap" and "pilot_of" in (doc.get("data") or {}) for doc in docs):
        lines += [f"The pilot of this run file's run: `{cli} pilot --config {run_file}` applies it (kubectl apply);",
                  f"`{cli} status --config {run_file} --pilot` follows it and shows its report; "
                  f"`{cli} plan --config {run_file} --pilot` sizes it."]
        return lines
    lines += [f"Next: `{cli} submit --config {run_file} --dry-run`, then without --dry-run (kubectl apply);",
              f"`{cli} status --config {run_file}` follows the run; `{cli} plan --config {run_file}` sizes it."]
    return lines


def _render(args: argparse.Namespace) -> int:
    if args.out:
        if args.stage:
            raise ConfigError("--out writes the whole run; leave out --stage")
        for path in write_base(_run(args), args.config.name, args.out, setup=args.setup):
            print(path)
        return ExitCode.OK
    sys.stdout.write(_stream(args, args.format))
    return ExitCode.OK


def _submit(args: argparse.Namespace) -> int:
    if args.command == "submit" and not args.setup and not args.no_pilot:
        _warn_without_pilot(load_run_config(args.config), args.config)
    if args.command == "pilot":
        _print_pilot_plan(args, sys.stderr)
        args.setup, args.stage = False, None
    from dflash_pipeline.plan.fit import check_before_submit

    check_before_submit(args.config, getattr(args, "target_config", None), args.stage, args.setup)  # refuses a misfit
    return _apply(_stream(args), args)


def _apply(stream: str, args: argparse.Namespace) -> int:
    """`kubectl apply -f -` of the stream (printed instead with --dry-run)."""
    command = [args.kubectl, "apply", "-f", "-"]
    if args.dry_run:
        sys.stdout.write(stream)
        print(f"dry run: would pipe the above to {' '.join(command)}", file=sys.stderr)
        return ExitCode.OK
    if shutil.which(args.kubectl) is None:
        raise ConfigError(f"{args.kubectl!r} not found on PATH; install kubectl or pass --kubectl")
    proc = subprocess.run(command, input=stream, text=True, check=False)
    if proc.returncode != 0:
        # Like resume and cancel: the cluster or the user's access, which `doctor` checks one by one.
        print(f"{shutil.which(args.kubectl)} apply exited {proc.returncode} (its message is above): check its context "
              f"(`kubectl config current-context`) and your rights, e.g. `python -m dflash_pipeline doctor --config "
              f"{args.config}`", file=sys.stderr)
        return ExitCode.ENVIRONMENT
    return ExitCode.OK


def _warn_without_pilot(run: RunConfig, run_file: str) -> None:
    """A full run submitted without a pilot report: say so, and how to get one (a warning, not a refusal)."""
    from dflash_pipeline.pilot.report import pilot_report_uri, read_report
    from dflash_shared.storage import StorageError

    if run.pilot_of is not None:
        return
    try:
        uri = pilot_report_uri(run.root, run.run_id)
        found = read_report(ObjectStore(), uri) is not None
    except (StorageError, ConfigError) as err:
        print(f"warning: could not look for the pilot's report ({err}); --no-pilot skips this check",
              file=sys.stderr)
        return
    if not found:
        print(f"warning: no pilot report at {uri}: this run's settings have not run on the cluster. First "
              f"`python -m dflash_pipeline pilot --config {run_file}` (under an hour at full shape, reduced "
              "counts), then `plan --from-pilot` its report; --no-pilot skips this warning", file=sys.stderr)


def _print_pilot_plan(args: argparse.Namespace, out: TextIO) -> None:
    from dflash_pipeline.pilot.derive import pilot_cost_lines
    from dflash_pipeline.plan.run_plan import build_plan, format_plan

    full = load_run_config(args.config)
    pilot = _run(args)
    planned = build_plan(pilot, None)
    out.write(format_plan(planned))
    out.write("\n".join(pilot_cost_lines(full, planned, build_plan(full, None))) + "\n")


def _status(args: argparse.Namespace) -> int:
    from dflash_pipeline.pilot.report import format_report, pilot_report_uri, read_report
    from dflash_pipeline.run.endpoint import run_store

    run = _run(args)
    store = run_store(run, args.config, [run.root])
    statuses = run_status(run, store)
    report = read_report(store, pilot_report_uri(run.root, run.pilot_of or run.run_id))
    if args.json:
        print(json.dumps({"stages": [s.to_json() for s in statuses],
                          "pilot_report": None if report is None else report.model_dump(mode="json")}, indent=2))
    else:
        sys.stdout.write(format_status(run, statuses, str(args.config)))
        if report is not None:
            sys.stdout.write(format_report(report))
    return ExitCode.OK


def _plan(args: argparse.Namespace) -> int:
    from dflash_pipeline.plan.run_plan import build_plan, format_plan, plan_json

    if args.pilot:
        if args.json:
            from dflash_pipeline.pilot.derive import pilot_cost

            full = load_run_config(args.config)
            planned = build_plan(_run(args), None)
            print(json.dumps({**plan_json(planned), "pilot": pilot_cost(full, planned, build_plan(full, None))},
                             indent=2))
        else:
            _print_pilot_plan(args, sys.stdout)
        return ExitCode.OK
    from dflash_pipeline.run.endpoint import run_store

    run = load_run_config(args.config)
    store = None if args.offline else run_store(run, args.config, [run.root, run.target.uri])
    if args.from_pilot:
        return _replan(run, args.from_pilot, store, args.json)
    planned = build_plan(run, store, target_config=args.target_config, run_file=args.config)
    if args.json:
        print(json.dumps(plan_json(planned), indent=2))
    else:
        sys.stdout.write(format_plan(planned))
    return ExitCode.OK


def _replan(run: RunConfig, report_at: str, store: ObjectStore | None, as_json: bool) -> int:
    from pydantic import ValidationError

    from dflash_pipeline.pilot.replan import format_moved, replan
    from dflash_pipeline.pilot.report import PilotReport, format_report
    from dflash_pipeline.plan.run_plan import build_plan, format_plan, plan_json

    try:
        raw = ObjectStore().read_bytes(report_at)
    except FileNotFoundError as err:
        raise ConfigError(f"no pilot report at {report_at}: the pilot writes <root>/<run_id>-pilot/report.json "
                          "when it ends (`pilot --config RUN.toml`)") from err
    try:
        report = PilotReport.model_validate_json(raw)
    except ValidationError as err:
        raise ConfigError(f"{report_at} is not a pilot report: {err.error_count()} problem(s), first: "
                          f"{err.errors()[0]['msg']}") from err
    after, moved = replan(run, report, store)
    if as_json:
        print(json.dumps({**plan_json(after), "moved": [m.__dict__ for m in moved]}, indent=2))
        return ExitCode.OK
    sys.stdout.write(format_report(report))
    sys.stdout.write(format_plan(after))
    sys.stdout.write(format_moved(build_plan(run, None), after, moved))
    return ExitCode.OK


def _local(args: argparse.Namespace) -> int:
    from dflash_pipeline.local.runner import run_local_and_report
    from dflash_pipeline.run.endpoint import run_store

    run = _run(args)
    # The same store for this process and its stages, chosen as every command beside the cluster chooses it: the
    # environment's AWS_ENDPOINT_URL and AWS_REGION win over the run file's [storage] (run/endpoint.py).
    run_store(run, args.config, [run.root])
    return run_local_and_report(run, args.repo.resolve(), args.stage, args.log_dir, args.verbose)


def _logs(args: argparse.Namespace) -> int:
    from dflash_pipeline.drive.kube import Cluster
    from dflash_pipeline.drive.run_logs import collect_logs, format_logs
    from dflash_pipeline.run.endpoint import run_store

    run = _run(args)
    cluster = None if args.store_only else (lambda: Cluster(run.namespace))
    logs, notes = collect_logs(run, run_store(run, args.config, [run.root]), args.stage, args.tail, cluster)
    for note in notes:
        print(note, file=sys.stderr)
    sys.stdout.write(format_logs(logs))
    return ExitCode.OK


def _resume(args: argparse.Namespace) -> int:
    from dflash_pipeline.drive.kube import Cluster
    from dflash_pipeline.drive.resume import resume_run
    from dflash_pipeline.plan.fit import check_before_submit

    args.setup, args.stage = False, None
    run = _run(args)
    # Everything that can refuse the run does so before anything is deleted.
    if not args.dry_run and shutil.which(args.kubectl) is None:
        raise ConfigError(f"{args.kubectl!r} not found on PATH; install kubectl or pass --kubectl")
    check_before_submit(args.config, args.target_config, None, False)
    stream = _stream(args)
    return resume_run(Cluster(run.namespace), run.run_id, lambda: _apply(stream, args), dry_run=args.dry_run,
                      say=lambda text: print(text, file=sys.stderr))


def _cancel(args: argparse.Namespace) -> int:
    from dflash_pipeline.drive.cancel import cancel_run
    from dflash_pipeline.drive.kube import Cluster

    if (args.run_id is None) == (args.config is None):
        raise ConfigError("cancel: name the run once: --config RUN.toml, or its RUN_ID")
    run_id, namespace = args.run_id, args.namespace
    if args.config is not None:
        run = _run(args)
        run_id, namespace = run.run_id, namespace or run.namespace
    args.run_id, args.namespace = run_id, namespace or os.environ.get("POD_NAMESPACE") or "dflash"
    deleted = cancel_run(Cluster(args.namespace), args.run_id, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for item in deleted:
        print(f"{verb} {item}")
    if not deleted:
        print(f"no objects of run {args.run_id} in namespace {args.namespace}", file=sys.stderr)
    return ExitCode.OK


def _checkout() -> Path:
    """The checkout this package is installed from (editable, as `make venv` installs it), else the current
    directory: `local` finds the stage environments there from any working directory."""
    root = Path(__file__).resolve().parents[4]
    return root if (root / "jobs" / "pipeline").is_dir() and (root / "Makefile").is_file() else Path.cwd()


def _drive(args: argparse.Namespace) -> int:
    from dflash_pipeline.drive.driver import RunDriver
    from dflash_pipeline.drive.kube import Cluster

    if not args.namespace:
        raise ConfigError("drive: --namespace is not given and POD_NAMESPACE is not set")
    driver = RunDriver(Cluster(args.namespace), ObjectStore(), args.root, args.run_id, poll_s=args.poll_seconds,
                       max_poll_s=args.max_poll_seconds, run_object=args.run_object,
                       stuck_after_s=args.stuck_after_seconds)
    return driver.run()


def _wait(args: argparse.Namespace) -> int:
    from dflash_pipeline.run.endpoint import run_store
    from dflash_shared.manifest_io import manifest_uri

    run = load_run_config(args.config) if args.config is not None else None
    uri = manifest_uri(args.manifest)  # a stage's prefix stands for its manifest
    return wait_for_manifest(run_store(run, args.config, [uri]), uri, args.timeout_seconds, args.poll_seconds)


def _restart(args: argparse.Namespace) -> int:
    from dflash_pipeline.drive.restart import restart_stage
    from dflash_pipeline.run.endpoint import run_store

    run = _run(args)
    cleared = restart_stage(run_store(run, args.config, [run.root]), run, args.stage, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for each in cleared:
        print(f"{verb} {each.objects} object(s) under {each.prefix} ({each.stage})")
    if not args.dry_run:
        print(f"next: `python -m dflash_pipeline resume --config {args.config}` runs them again on the cluster "
              f"(`local --config {args.config}` on this machine)", file=sys.stderr)
    return ExitCode.OK


def _doctor(args: argparse.Namespace) -> int:
    from dflash_pipeline.doctor.command import run_doctor
    from dflash_pipeline.run.endpoint import run_store

    run = load_run_config(args.config)
    return run_doctor(run, run_store(run, args.config, [run.root, run.target.uri]),
                      probe_images=not args.no_image_probe, probe_timeout_s=args.probe_timeout_seconds)


def _stage_model(args: argparse.Namespace) -> int:
    from dflash_pipeline.staging.stage_model import run_stage_model

    return run_stage_model(args.source, args.to, args.config, workers=args.workers, replace=args.replace,
                           scratch=args.scratch)


def main(argv: list[str] | None = None) -> NoReturn:
    args = _parser().parse_args(argv)
    commands = {"render": _render, "submit": _submit, "pilot": _submit, "status": _status, "plan": _plan,
                "local": _local, "cancel": _cancel, "drive": _drive, "wait": _wait, "stage-model": _stage_model,
                "logs": _logs, "resume": _resume, "restart": _restart, "doctor": _doctor}
    run_stage_main(f"pipeline {args.command}", lambda: commands[args.command](args))


if __name__ == "__main__":
    main()
