"""The multi-node train Job as a gang: two pods of the rendered Indexed Job, each one torchrun agent with one
CPU rank under the trainer image's entrypoint, meeting at a c10d rendezvous on this machine.

- SIGTERM to ONE pod: both pods exit 75 (the failure policy ignores it), and two replacement pods resume from
  the checkpoint to exactly the run an uninterrupted pair of pods makes (same loss at every step, same weights);
- bad input on one rank: that pod exits 65 (the policy fails the Job), its peer 75.

The pods are emulated as in test_k8s_train (tests/pipeline/pod_emulation.py); the one thing changed from the
rendered container is the rendezvous endpoint: DNS of the headless Service is not emulated, so pod 0's name
becomes 127.0.0.1 and the port a free one.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.run.config import read_run_file
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import DrafterSection, Kind
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, env_of, failure_action, jobs
from tests.pipeline.pod_emulation import ContainerProcess, pod_containers
from tests.pipeline.train_inputs import TRAIN_VENV, tiny_target_dir, tokenized_for, train_python, upload_dir

SECRETS = {"dflash-s3": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}}
STEPS = 4
LOSS_LINE = re.compile(r"step (\d+)/\d+ \(\d+%\) loss (\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def two_node_job(store: ObjectStore, bucket: str, endpoint: str, **train: Any) -> dict[str, Any]:
    """The example run's train Job on two nodes of one CPU rank each, its inputs in the bucket."""
    train_python()
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{bucket}/runs"
    data["target"] = {**data["target"], "uri": f"{bucket}/models/tiny"}
    data["storage"] = {**data["storage"], "endpoint_url": endpoint, "region": "us-east-1"}
    # One thread per rank: BLAS on several threads is not bitwise reproducible from run to run (and two ranks
    # share this machine's cores), and the resume is compared bit for bit with an uninterrupted run.
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    data["stages"]["train"] = {**data["stages"]["train"], "nodes": 2, "gpus": 1, "env": threads, "config": {
        "preset": "debug", "device": "cpu", "max_steps": STEPS, "checkpoint_every": 1, "batch_tokens": 512,
        "log_every": 1, "tensorboard": False, **train}}
    run = parse_run_config(data, "two-node run")
    upload_dir(store, tiny_target_dir(), run.target.uri)
    tokenized_for(store, f"{bucket}/runs/example", tiny_target_dir())
    return jobs(render_documents(run))["train"]


def pod_main(job: dict[str, Any], index: int, pod_dir: Path, port: int, output: str | None = None) -> ContainerProcess:
    """Pod `index`'s train container, its rendezvous on this machine (and its output elsewhere if given)."""
    main = pod_containers(job, index, SECRETS, pod_dir, TRAIN_VENV)[-1]
    command = [re.sub(r"^--rdzv-endpoint=.*", f"--rdzv-endpoint=127.0.0.1:{port}", a) for a in main.command]
    assert command != main.command, "the rendered torchrun has no --rdzv-endpoint"
    env = {**main.env, "DFLASH_TRAIN_OUTPUT": output} if output else main.env
    return dataclasses.replace(main, command=command, env=env)


class Gang:
    """The two pods of the Job, started together; logs in the test's folder."""

    def __init__(self, job: dict[str, Any], where: Path, output: str | None = None) -> None:
        port = free_port()
        self.logs = [where / f"pod-{i}.log" for i in range(2)]
        self.procs = []
        for i in range(2):
            c = pod_main(job, i, where / f"pod-{i}", port, output)
            with open(self.logs[i], "wb") as sink:
                self.procs.append(subprocess.Popen(c.command, env=c.env, cwd=c.cwd, stdout=sink,
                                                   stderr=subprocess.STDOUT))

    def text(self, tail: int | None = 3000) -> str:
        """The pods' logs, each cut to its last `tail` characters (for a failure's message; None: whole)."""
        return "\n".join(f"--- pod {i}\n{log.read_text()[-tail if tail else 0:]}" for i, log in enumerate(self.logs))

    def wait(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def losses(self) -> dict[int, str]:
        """step -> loss as rank 0 logged it (rank 0 is in either pod: the c10d rendezvous assigns ranks)."""
        return {int(m[1]): m[2] for log in self.logs for m in LOSS_LINE.finditer(log.read_text())}


def checkpoint_steps(store: ObjectStore, output: str) -> list[int]:
    markers = store.list(join(output, "checkpoints"), suffix="/COMPLETE.json")
    return sorted(int(u.rsplit("/", 2)[-2].removeprefix("step-")) for u in markers)


def final_checkpoint(store: ObjectStore, output: str) -> tuple[dict[str, np.ndarray], float]:
    """The final checkpoint's weights (read from model.safetensors) and the last step's full-precision loss."""
    manifest = load_manifest(store, output, Kind.drafter).manifest
    (weights,) = [s for s in manifest.shards if s.uri.endswith("/model.safetensors")]
    assert isinstance(manifest.section, DrafterSection)
    # safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape, byte range), the data.
    blob = store.read_bytes(weights.uri)
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    data = blob[8 + size:]
    dtypes = {"F32": np.float32, "F16": np.float16}
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] in dtypes, f"{name}: dtype {entry['dtype']} not read here"
        start, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return tensors, manifest.section.final_metrics["loss"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_pod_stops_the_gang_with_75_and_the_resume_is_exact(
    s3_bucket: str, moto_endpoint: str, store: ObjectStore, tmp_path: Path
) -> None:
    job = two_node_job(store, s3_bucket, moto_endpoint)
    output = env_of(job["spec"]["template"]["spec"]["containers"][0])["DFLASH_TRAIN_OUTPUT"]

    gang = Gang(job, tmp_path / "first")
    deadline = time.monotonic() + 300
    while not checkpoint_steps(store, output):
        assert all(p.poll() is None for p in gang.procs), f"a pod exited early:\n{gang.text()}"
        assert time.monotonic() < deadline, f"no checkpoint within 300 s:\n{gang.text()}"
        time.sleep(0.1)
    # Only pod 1 is preempted; pod 0 hears of it from its ranks, not from Kubernetes.
    gang.procs[1].send_signal(signal.SIGTERM)
    codes = gang.wait()
    assert codes == [ExitCode.PREEMPTED, ExitCode.PREEMPTED], gang.text()
    assert all(failure_action(job, code) == "Ignore" for code in codes)
    text = gang.text(tail=None)
    assert "stopped by SIGTERM" in text and "the gang stopped, every rank of this pod exited 75" in text, text
    stopped = checkpoint_steps(store, output)[-1]
    assert stopped < STEPS and not store.exists(join(output, "manifest.json")), text
    first_losses = gang.losses()

    # Two replacement pods (fresh emptyDirs) resume from the checkpoint and finish the run.
    resumed = Gang(job, tmp_path / "resumed")
    assert resumed.wait() == [0, 0], resumed.text()
    # The whole log: a line early in it must not fall out of the tail a failure message shows.
    assert f"(step {stopped}, saved by 2 rank(s)" in resumed.text(tail=None), resumed.text()

    # The same pods, never interrupted, writing elsewhere.
    reference_output = join(s3_bucket, "reference", "drafter")
    reference = Gang(job, tmp_path / "reference", output=reference_output)
    assert reference.wait() == [0, 0], reference.text()
    expected = reference.losses()
    assert sorted(expected) == list(range(1, STEPS + 1)), reference.text()
    assert {s: v for s, v in first_losses.items() if s <= stopped} | resumed.losses() == expected
    (resumed_weights, resumed_loss), (reference_weights, reference_loss) = (
        final_checkpoint(store, output), final_checkpoint(store, reference_output))
    assert resumed_loss == reference_loss
    assert sorted(resumed_weights) == sorted(reference_weights)
    # Bit for bit: the same float32 values in every tensor. (The files' sha256 is not compared: the bytes of two
    # safetensors files with equal tensors can differ in their header.)
    unequal = [k for k in reference_weights if not np.array_equal(resumed_weights[k], reference_weights[k])]
    assert unequal == [], f"final weights differ from the uninterrupted run's in {unequal}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bad_input_on_one_rank_fails_its_pod_with_65_and_its_peer_exits_75(
    s3_bucket: str, moto_endpoint: str, store: ObjectStore, tmp_path: Path
) -> None:
    job = two_node_job(store, s3_bucket, moto_endpoint)
    # The tokenized data has one shard: rank 0 alone counts its rows when planning, rank 1 waits in the
    # all-gather of the counts. A shard that no longer matches its manifest is bad input on rank 0 only.
    tokenized = load_manifest(store, join(s3_bucket, "runs", "example", "tokenized"), Kind.tokenized).manifest
    (shard,) = tokenized.shards
    store.write_bytes(shard.uri, b"not the shard the manifest describes")

    gang = Gang(job, tmp_path)
    codes = gang.wait()
    assert sorted(codes) == [ExitCode.BAD_INPUT, ExitCode.PREEMPTED], gang.text()
    failed, peer = (gang.logs[codes.index(c)].read_text() for c in (ExitCode.BAD_INPUT, ExitCode.PREEMPTED))
    assert "does not match the tokenized manifest" in failed and "exit 65" in failed, failed[-3000:]
    assert "a peer rank is gone" in peer and "the gang stopped" in peer, peer[-3000:]
    assert failure_action(job, ExitCode.BAD_INPUT) == "FailJob" and failure_action(job, ExitCode.PREEMPTED) == "Ignore"
