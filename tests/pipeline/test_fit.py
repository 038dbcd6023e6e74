"""Fit before any GPU is held: `plan` and `submit` size each GPU stage's memory per GPU from the target's
config.json and the run file, and refuse (exit 64) a run that cannot fit, naming the fixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline import parse_run_config
from dflash_pipeline.plan.fit import FitReport, StageFit, check_before_submit, check_fit
from dflash_pipeline.plan.gpu_models import lookup
from dflash_pipeline.plan.run_plan import build_plan, format_plan, plan_json
from dflash_pipeline.run.config import RunConfig, read_run_file
from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore, join
from dflash_train.training.memory_plan import GIB, GPU_CLASSES
from dflash_train.training.target_params import target_sizes
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT
from tests.support.published_configs import QWEN3_6_27B, QWEN3_8B

HEADLINE_RUN = REPO_ROOT / "k8s" / "examples" / "qwen3.6-27b.toml"
H200, H100 = "NVIDIA-H200", "NVIDIA-H100-80GB-HBM3"
GPU_STAGES = ("generate", "train", "evaluate", "serve-check")

def on_gpu(path: Path, gpu: str, **train_config: Any) -> dict[str, Any]:
    """The run file's data with every GPU stage pinned to `gpu` and `train_config` over its train config."""
    data = read_run_file(path)
    for stage in GPU_STAGES:
        data["stages"][stage]["gpu_types"] = [gpu]
    data["plan"] = {**data.get("plan", {}), "gpu_model": gpu}
    data["stages"]["train"].setdefault("config", {}).update(train_config)
    return data


def run_on(path: Path, gpu: str, **train_config: Any) -> RunConfig:
    return parse_run_config(on_gpu(path, gpu, **train_config))


def fit_of(run: RunConfig, config: dict[str, Any]) -> dict[str, StageFit]:
    report = check_fit(run, None, target_config=config)
    assert report.ran, report.target
    return {s.stage: s for s in report.stages}


def test_qwen3_6_27b_is_sized_from_its_config_alone() -> None:
    sizes = target_sizes(QWEN3_6_27B)
    # The published 27B: 48 Gated DeltaNet layers of 383.3M, 16 gated full-attention layers of 372.3M, and the
    # untied embedding and head (vision tower and MTP weights are not loaded).
    assert sizes.linear_attention_layers == 48 and sizes.full_attention_layers == 16
    assert sizes.layer_params[0] == 383_273_184 and sizes.layer_params[3] == 372_255_232
    assert sizes.params == pytest.approx(26.9e9, rel=0.01)
    # KV per token: K and V of 16 layers x 4 heads x 256 x 2 bytes; split over 8 GPUs, a head each (replicated).
    assert sizes.kv_bytes_per_token(2) == 2 * 16 * 4 * 256 * 2 == 65536
    assert sizes.kv_bytes_per_token(2, tp=8) == 2 * 16 * 1 * 256 * 2
    # A sequence's fixed state: 48 layers x (conv [3, 2 x 2048 + 6144] + delta [48, 128, 128]) x 2 bytes.
    assert sizes.recurrent_bytes_per_sequence(2) == 48 * (3 * 10240 + 48 * 128 * 128) * 2
    dense = target_sizes(QWEN3_8B)
    assert dense.params == pytest.approx(8.19e9, rel=0.01) and dense.recurrent_bytes_per_sequence(2) == 0
    assert dense.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2


def test_the_headline_run_fits_h200_and_the_plan_prints_each_stage() -> None:
    plan = build_plan(run_on(HEADLINE_RUN, H200), target_config=QWEN3_6_27B)
    assert plan.fit is not None
    fits = {s.stage: s for s in plan.fit.stages}
    assert list(fits) == list(GPU_STAGES) and all(s.verdict == "fits" for s in fits.values())
    train = fits["train"]
    # DDP (auto: a replica takes under 80% of an H200), 32 ranks, the 16K window with 2,048 anchors per row.
    assert train.summary.startswith("ddp (from auto), 32 rank(s), max_length 16,384, N=2048")
    assert 100 * GIB < train.peak < 120 * GIB and train.available == GPU_CLASSES["141 GB"]
    text = format_plan(plan)
    assert f"  train: peak {train.peak / GIB:.1f} GiB per GPU, of 139.8 GiB free on NVIDIA-H200" in text
    assert "  generate: " in text and "vLLM takes on NVIDIA-H200" in text
    # More sequences in flight than the KV cache holds at max_model_len: a warning, not a refusal.
    (crowded,) = [w for w in plan.warnings if w.startswith("generate: the KV cache holds")]
    assert "fewer than the 512 it keeps in flight" in crowded and "optimistic" in crowded
    as_json = plan_json(plan)["fit"]
    assert [s["verdict"] for s in as_json["stages"]] == ["fits"] * 4
    assert as_json["stages"][1]["peak_bytes"] == train.peak


def test_on_80gb_the_headline_run_shards_under_auto_and_is_refused_under_ddp() -> None:
    # parallelism auto resolves as the train stage does: target and drafter state take more than 80% of the GPU,
    # so FSDP, and the run fits at about the bench's 44 GiB.
    auto = fit_of(run_on(HEADLINE_RUN, H100), QWEN3_6_27B)["train"]
    assert auto.verdict == "fits" and auto.summary.startswith("fsdp (from auto)") and auto.peak < 50 * GIB
    # DDP asked for: ~114 GiB per rank of 79 GiB. Refused, the fix named as the run file sets it.
    with pytest.raises(ConfigError) as refused:
        build_plan(run_on(HEADLINE_RUN, H100, parallelism="ddp"), target_config=QWEN3_6_27B)
    message = str(refused.value)
    assert "train: predicted peak memory" in message and "NVIDIA-H100-80GB-HBM3" in message
    assert 'stages.train.config.parallelism = "fsdp"' in message and "a bigger GPU: NVIDIA-H200" in message


def test_a_dense_qwen3_8b_fits_80_and_141_gb_and_a_long_unchecked_window_only_141() -> None:
    for gpu in (H100, H200):
        assert all(s.verdict == "fits" for s in fit_of(run_on(EXAMPLE_RUN, gpu), QWEN3_8B).values())
    heavy = {"max_length": 16384, "max_anchors_per_row": 2048,
             "activation_checkpointing": False}
    wide = fit_of(run_on(EXAMPLE_RUN, H200, **heavy), QWEN3_8B)["train"]
    assert wide.verdict == "fits" and 80 * GIB < wide.peak < 139 * GIB
    with pytest.raises(ConfigError) as refused:
        build_plan(run_on(EXAMPLE_RUN, H100, **heavy), target_config=QWEN3_8B)
    message = str(refused.value)
    assert "stages.train.config.activation_checkpointing = true" in message
    assert "stages.train.config.max_anchors_per_row = " in message
    assert "stages.train.config.max_length = " not in message or "or less" in message


def test_generation_is_refused_when_not_one_sequence_fits_and_names_the_fixes() -> None:
    # 0.68 x 79.6 GiB leaves ~0.4 GiB of KV cache after 50 GiB of weights: one 16K sequence needs ~1.1 GiB.
    data = on_gpu(HEADLINE_RUN, H100)
    data["stages"]["generate"]["config"] = {"gpu_memory_utilization": 0.68}
    with pytest.raises(ConfigError) as refused:
        build_plan(parse_run_config(data), target_config=QWEN3_6_27B)
    message = str(refused.value)
    assert "generate: the KV cache gets" in message and "vLLM refuses to start" in message
    for fix in ("stages.generate.gpus = 2", "stages.generate.config.max_model_len = ",
                "stages.generate.config.gpu_memory_utilization = 0.69 or more",
                "stages.generate.config.max_num_seqs = ", "a bigger GPU: NVIDIA-H100-NVL"):
        assert fix in message
    # A 40 GB GPU cannot hold the bf16 weights at all: two GPUs per engine can.
    small = check_fit(run_on(HEADLINE_RUN, "NVIDIA-A100-SXM4-40GB"), None, target_config=QWEN3_6_27B)
    generate = next(s for s in small.refused if s.stage == "generate")
    assert "the engine cannot load" in generate.reason and generate.fixes[0].startswith("stages.generate.gpus = 2")
    # gpu_memory_utilization above what the GPU has free: vLLM refuses to start.
    data["stages"]["generate"]["config"] = {"gpu_memory_utilization": 1.0}
    full = fit_of(parse_run_config(data), QWEN3_6_27B)["generate"]
    assert full.verdict == "refused" and "which has 79.0 GiB free" in full.reason


def test_without_a_gpu_model_the_figures_are_printed_and_nothing_is_refused() -> None:
    data = on_gpu(HEADLINE_RUN, H100, parallelism="ddp")
    for stage in GPU_STAGES:
        del data["stages"][stage]["gpu_types"]
    del data["plan"]["gpu_model"]
    plan = build_plan(parse_run_config(data), target_config=QWEN3_6_27B)
    assert plan.fit is not None and {s.verdict for s in plan.fit.stages} == {"not checked"}
    train = next(s for s in plan.fit.stages if s.stage == "train")
    assert "under fsdp: " in train.summary and "set [plan] gpu_model" in train.reason
    # [plan] gpu_memory_gib alone names the memory: 79.6 GiB is an 80 GB card, and DDP does not fit it.
    data["plan"]["gpu_memory_gib"] = 79.6
    with pytest.raises(ConfigError, match=r'parallelism = "fsdp"'):
        build_plan(parse_run_config(data), target_config=QWEN3_6_27B)


def test_without_a_target_config_the_check_says_why_it_did_not_run() -> None:
    plan = build_plan(parse_run_config(read_run_file(HEADLINE_RUN)))
    assert plan.fit is not None and not plan.fit.ran and not plan.warnings
    assert "fit before any GPU is held: not checked, no config.json of the target was read" in format_plan(plan)
    assert "--target-config" in format_plan(plan)


def test_the_target_config_comes_from_the_run_file_or_the_store(tmp_path: Path, s3_bucket: str,
                                                                store: ObjectStore) -> None:
    (tmp_path / "qwen3.6-27b-config.json").write_text(json.dumps(QWEN3_6_27B))
    data = on_gpu(HEADLINE_RUN, H200)
    data["plan"]["target_config"] = "qwen3.6-27b-config.json"
    run = parse_run_config(data)
    report = check_fit(run, None, run_file=tmp_path / "run.toml")
    assert report.ran and report.target.startswith(str(tmp_path / "qwen3.6-27b-config.json"))
    with pytest.raises(ConfigError, match="cannot read the target config"):
        check_fit(run, None, run_file=REPO_ROOT / "run.toml")
    # From <target.uri>/config.json in the store; absent there, the check says so.
    data = on_gpu(HEADLINE_RUN, H200)
    data["target"]["uri"] = join(s3_bucket, "models", "Qwen3.6-27B")
    store.write_bytes(join(data["target"]["uri"], "config.json"), json.dumps(QWEN3_6_27B).encode())
    found = check_fit(parse_run_config(data), store)
    assert found.ran and found.target.startswith(join(data["target"]["uri"], "config.json"))
    data["target"]["uri"] = join(s3_bucket, "models", "missing")
    missing = check_fit(parse_run_config(data), store)
    assert not missing.ran and "does not exist" in missing.target


def test_submit_runs_the_same_check_before_kubectl(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_6_27B))
    run_file = _write_run(tmp_path / "run.json", on_gpu(HEADLINE_RUN, H100, parallelism="ddp"))
    with pytest.raises(ConfigError, match=r'parallelism = "fsdp"'):
        check_before_submit(run_file, config, None, setup=False)
    check_before_submit(run_file, config, ["tokenize"], setup=False)  # no GPU stage selected
    check_before_submit(run_file, config, None, setup=True)  # the namespace's setup holds no GPU


def _write_run(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_the_command_refuses_with_exit_64_and_accepts_on_h200(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_6_27B))
    refused = _write_run(tmp_path / "ddp-80gb.json", on_gpu(HEADLINE_RUN, H100, parallelism="ddp"))

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dflash_pipeline", *args, "--target-config", str(config)],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)

    plan = command("plan", "--config", str(refused), "--offline")
    assert plan.returncode == 64, plan.stderr
    assert 'stages.train.config.parallelism = "fsdp"' in plan.stderr and "DOES NOT FIT" in plan.stderr
    submit = command("submit", "--config", str(refused), "--dry-run")
    assert submit.returncode == 64 and "apiVersion" not in submit.stdout
    assert 'stages.train.config.parallelism = "fsdp"' in submit.stderr
    accepted = command("plan", "--config", str(HEADLINE_RUN), "--offline")
    assert accepted.returncode == 0, accepted.stderr
    assert "  train: peak " in accepted.stdout and "free on NVIDIA-H200 (gpu_types): fits" in accepted.stdout


def test_gpu_products_are_matched_liberally_and_never_guessed() -> None:
    for name, product in (("NVIDIA-H200", H200), ("nvidia h200 nvl", H200), ("NVIDIA-H100-80GB-HBM3", H100),
                          ("NVIDIA-H100-PCIe", H100), ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
                          ("Tesla_A100-PCIE-40GB", "NVIDIA-A100-SXM4-40GB"), ("NVIDIA-L40S", "NVIDIA-L40S"),
                          ("NVIDIA-B200", "NVIDIA-B200"), ("NVIDIA-H100-NVL", "NVIDIA-H100-NVL")):
        model = lookup(name)
        assert model is not None and model.name == product, name
    for name in ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "NVIDIA-A100", "NVIDIA-GeForce-RTX-4090", "NVIDIA-GH200"):
        assert lookup(name) is None, name
    # The two classes the memory plan knows keep its figures.
    h200, h100 = lookup(H200), lookup(H100)
    assert h200 is not None and h200.usable == GPU_CLASSES["141 GB"]
    assert h100 is not None and h100.usable == GPU_CLASSES["80 GB"]
    assert FitReport("x", ran=False).lines() == ["fit before any GPU is held: not checked, x"]


def test_a_staged_target_far_from_the_size_its_id_states_is_refused_unless_allowed(s3_bucket: str,
                                                                                   store: ObjectStore) -> None:
    """The wrong model staged at target.uri (Qwen3-8B's config under the Qwen3.6-27B id): refused before any GPU is
    held, naming both counts; the named size (26.9B against "27B") passes; allow_size_mismatch accepts it."""
    data = on_gpu(HEADLINE_RUN, H200)
    data["target"]["uri"] = join(s3_bucket, "models", "Qwen3.6-27B")
    store.write_bytes(join(data["target"]["uri"], "config.json"), json.dumps(QWEN3_8B).encode())
    report = check_fit(parse_run_config(data), store)
    assert report.blocked and not report.refused
    assert "describes 8.19B parameters, target.model_id 'Qwen/Qwen3.6-27B' 27B" in report.target_refusal
    assert report.message().startswith("the staged target is not the model the run file names:")
    assert any("NOT THE NAMED MODEL" in line for line in report.lines())
    with pytest.raises(ConfigError, match="target.allow_size_mismatch"):
        build_plan(parse_run_config(data), target_config=QWEN3_8B)
    data["target"]["allow_size_mismatch"] = True
    assert not check_fit(parse_run_config(data), store).blocked
    store.write_bytes(join(data["target"]["uri"], "config.json"), json.dumps(QWEN3_6_27B).encode())
    data["target"]["allow_size_mismatch"] = False
    assert not check_fit(parse_run_config(data), store).blocked
