"""`pipeline plan`: each stage's pods, GPU-hours, wall time and disk follow from the run file and the manifests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline import layout, parse_run_config
from dflash_pipeline.plan.run_plan import START_SECONDS, build_plan, format_plan, gpu_model_warnings, plan_json
from dflash_pipeline.run.config import RunConfig, read_run_file
from dflash_shared.errors import ConfigError
from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import (
    Accounting,
    CompletionsSection,
    Kind,
    Manifest,
    Producer,
    PromptsSection,
    Shard,
    SpecialTokens,
    TargetIdentity,
)
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT

HEADLINE_RUN = REPO_ROOT / "k8s" / "examples" / "qwen3.6-27b.toml"


def headline(**plan: Any) -> RunConfig:
    data = read_run_file(HEADLINE_RUN)
    data["plan"] = {**data["plan"], **plan}
    return parse_run_config(data)


def stages(run: RunConfig, store: ObjectStore | None = None) -> dict[str, Any]:
    return {s.stage: s for s in build_plan(run, store).stages}


def cut_mean(mean: float, at: float) -> float:
    """E[min(X, at)] for X exponential with `mean`: the plan's completion length under a budget (plan_tokens)."""
    return mean * (1 - math.exp(-at / mean))


# The headline run: answers of 4,000 tokens on average, stopped where the 16,384-token window ends after a
# prompt of 700 (budget 15,684 per prompt).
HEADLINE_COMPLETION = cut_mean(4000, 16384 - 700)


def test_the_headline_run_is_sized_from_its_run_file() -> None:
    run = headline()
    got = stages(run)
    assert list(got) == ["import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"]
    generate, train = got["generate"], got["train"]
    # 64 one-GPU pods; 900K prompts x 3,921 tokens at 1,500 tok/s/GPU, after the target copy (target.disk_size,
    # as the Jobs size their scratch for it, at 500 MB/s) and the engine's start.
    assert (generate.pods, generate.gpus, generate.model_copies) == (64, 64, 64)
    target = 56 * 2**30  # target.disk_size
    start = target / 500e6 + START_SECONDS
    assert HEADLINE_COMPLETION == pytest.approx(3920.7, abs=0.1)
    assert generate.wall_seconds == pytest.approx(start + 900_000 * HEADLINE_COMPLETION / (1500 * 64))
    assert generate.gpu_hours == pytest.approx(64 * generate.wall_seconds / 3600)
    assert generate.scratch_bytes_per_pod == pytest.approx(target)
    # 4 nodes x 8 GPUs; 6 epochs over 900K x (700 + 3,921) tokens (all inside the window) at 3,000 tok/s/GPU.
    assert (train.pods, train.gpus, train.model_copies) == (4, 32, 1)  # rank 0's pod alone copies the weights
    assert train.wall_seconds == pytest.approx(start + 6 * 900_000 * (700 + HEADLINE_COMPLETION) / (3000 * 32))
    assert train.wall_seconds > 2 * 86400  # days, not hours: what a user must see before submitting
    assert "steps" in train.work and "6 epochs" in train.work and "rows of 16,384" in train.work
    assert not build_plan(run).warnings


def test_twice_the_prompts_takes_twice_the_generation() -> None:
    one, two = stages(headline()), stages(headline(prompts=1_800_000))
    start = one["generate"].wall_seconds - 900_000 * HEADLINE_COMPLETION / (1500 * 64)
    assert two["generate"].wall_seconds - start == pytest.approx(2 * (one["generate"].wall_seconds - start))
    assert two["generate"].store_bytes == pytest.approx(2 * one["generate"].store_bytes)
    assert two["train"].gpu_hours > 1.9 * one["train"].gpu_hours


def test_a_deadline_shorter_than_the_stage_and_a_small_scratch_are_warned() -> None:
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["generate"] |= {"active_deadline_seconds": 3600}
    # The train pod's shard cache (cache_gib, 20 GiB by default) does not fit in 10Gi beside the target copy.
    data["stages"]["train"] |= {"scratch_size": "10Gi"}
    plan = build_plan(parse_run_config(data))
    warnings = "\n".join(plan.warnings)
    assert "generate: active_deadline_seconds 3,600 is shorter than the predicted" in warnings
    assert "raise stages.generate.active_deadline_seconds" in warnings
    assert "train: needs ~" in warnings and "raise stages.train.scratch_size" in warnings
    assert len(plan.warnings) == 2, plan.warnings
    # 0 is "no deadline" in the run file: nothing to warn about.
    data["stages"]["generate"] |= {"active_deadline_seconds": 0}
    assert not [w for w in build_plan(parse_run_config(data)).warnings if w.startswith("generate")]


def test_an_unsized_model_id_asks_for_the_disk_size() -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["target"]["model_id"] = "acme/house-model"
    with pytest.raises(ConfigError, match=r"target.disk_size"):
        build_plan(parse_run_config(data))


def _target() -> TargetIdentity:
    return TargetIdentity(model_id="Qwen/Qwen3-8B", tokenizer_sha256="0" * 64, chat_template_sha256="0" * 64,
                          enable_thinking=True, special_tokens=SpecialTokens(end_of_turn=1))


def _completions(run_id: str, records: int, output_tokens: int, stored: int, seconds: float) -> Manifest:
    return Manifest(
        kind=Kind.completions, run_id=run_id, producer=Producer(stage="generate"),
        shards=[Shard(uri="part-00000.jsonl.zst", bytes=stored, sha256="0" * 64, records=records)],
        accounting=Accounting(input_records=records, succeeded=records, failed=0, skipped=0),
        section=CompletionsSection(target=_target(), has_token_ids=True, output_tokens=output_tokens,
                                   throughput={"output_tokens_per_s_per_gpu": output_tokens / seconds}),
    )


def test_manifests_and_an_earlier_run_replace_the_estimates(s3_bucket: str, store: ObjectStore) -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = join(s3_bucket, "runs")
    earlier = join(s3_bucket, "runs", "last-month")
    data["plan"] = {"measured_from": earlier}
    run = parse_run_config(data)
    lay = layout(run.root, run.run_id)
    # This run's import counted 5,000 prompts; last month's generate made 2,500 tokens per prompt at 800 tok/s/GPU,
    # stored in 2 bytes per token.
    write_manifest(store, lay.prompts, Manifest(
        kind=Kind.prompts, run_id=run.run_id, producer=Producer(stage="import"),
        shards=[Shard(uri="p.jsonl.zst", bytes=1, sha256="0" * 64, records=5000)],
        accounting=Accounting(input_records=5000, succeeded=5000, failed=0, skipped=0),
        section=PromptsSection(sources=[run.source.uri], duplicates=0, prompt_tokens=5000 * 321)))
    write_manifest(store, join(earlier, "completions"), _completions("last-month", 1000, 2_500_000, 5_000_000, 3125.0))

    plan = build_plan(run, store)
    sources = {name: (f.value, f.source) for name, f in plan.figures.items()}
    assert sources["prompts"] == (5000, "manifest")
    # The import counted the prompts with the target's tokenizer: their mean replaces the estimate.
    assert sources["mean prompt tokens"] == (321, "manifest")
    # The measured mean is the mean under a 4,096-token budget (this run's: the earlier manifest records none);
    # the uncut answer length behind it, cut at the same budget again, gives it back.
    answer, source = sources["mean answer tokens (uncut)"]
    assert source == "measured" and cut_mean(answer, 4096) == pytest.approx(2500)
    assert sources["mean completion tokens"][0] == pytest.approx(2500)
    assert sources["generate tokens/s/GPU"] == (800, "measured")
    assert sources["completions bytes per token"] == (2.0, "measured")
    generate = {s.stage: s for s in plan.stages}["generate"]
    assert generate.store_bytes == pytest.approx(5000 * 2500 * 2.0)
    text = format_plan(plan)
    assert "prompts: 5.0K (manifest)" in text and "generate tokens/s/GPU: 800 (measured)" in text


@pytest.mark.slow
def test_the_command_prints_the_table_and_json_offline() -> None:
    base = [sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(HEADLINE_RUN), "--offline"]
    text = subprocess.run(base, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=True).stdout
    assert text.splitlines()[1].split() == ["stage", "pods", "GPUs", "GPU-hours", "cost", "wall", "scratch/pod",
                                            "written", "model", "copies", "work"]
    assert "generate     64    64" in text and "(run file)" in text and "(estimate)" in text
    out = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                                    check=True).stdout)
    train = next(s for s in out["stages"] if s["stage"] == "train")
    assert train["gpus"] == 32 and train["gpu_hours"] == pytest.approx(32 * train["wall_seconds"] / 3600)
    # Without a prompt count, the example's times are unknown and the table says how to give them.
    example = subprocess.run([sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(EXAMPLE_RUN),
                              "--offline"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=True)
    assert "set [plan] prompts" in example.stdout


def test_the_headline_run_renders_and_validates(tmp_path: Path) -> None:
    from dflash_pipeline import render_documents
    from tests.pipeline.k8s_support import schema_errors

    docs = render_documents(headline())
    assert schema_errors(docs) == []
    components = {d["metadata"].get("labels", {}).get("app.kubernetes.io/component") for d in docs}
    assert {"import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"} <= components


def window_run(generate: dict[str, Any], window: int = 4096, **plan: Any) -> RunConfig:
    """The headline run trained on `window`-token records, with `generate` as its generate stage's config."""
    data = read_run_file(HEADLINE_RUN)
    data["plan"] = {**data["plan"], **plan}
    data["stages"]["generate"]["config"] = generate
    data["stages"]["train"]["config"] = {"max_length": window, "batch_tokens": 32 * window}
    return parse_run_config(data)


UNCAPPED_32K = {"max_new_tokens": 32768, "max_model_len": 40960, "cap_to_training_window": False}


def test_training_reads_at_most_the_window_of_each_record_and_unread_generation_is_warned() -> None:
    """A 32K budget against a 4,096-token window (the headline file before): each record trains min(record,
    window), and the plan says which share of the generated tokens no step reads, with the fix."""
    start = 56 * 2**30 / 500e6 + START_SECONDS
    generated, in_window = cut_mean(4000, 32768), cut_mean(4000, 4096 - 700)
    plan = build_plan(window_run(UNCAPPED_32K))
    got = {s.stage: s for s in plan.stages}
    assert got["generate"].wall_seconds == pytest.approx(start + 900_000 * generated / (1500 * 64))
    # Trained per record: the prompt, then the completion up to the window's end (2,989 tokens, not 4,700).
    assert 700 + in_window == pytest.approx(2988.6, abs=0.1)
    assert got["train"].wall_seconds == pytest.approx(start + 6 * 900_000 * (700 + in_window) / (3000 * 32))
    figures = {name: f.value for name, f in plan.figures.items()}
    assert figures["tokens per record trained"] == pytest.approx(700 + in_window)
    assert figures["generated tokens never trained"] == pytest.approx(1 - in_window / generated)
    assert figures["generated tokens never trained"] == pytest.approx(0.428, abs=0.001)
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("generate: 43% of the generated tokens")
    assert "cap_to_training_window = true" in plan.warnings[0]
    text = format_plan(plan)
    assert "training reads min(record, 4,096) = 2,989" in text
    assert "42.8% of the generated tokens are never trained on (limit 10%)" in text


def test_a_budget_capped_to_the_window_generates_nothing_unread() -> None:
    """The default: each completion stops where the window ends; the cut ones are counted, not lost."""
    plan = build_plan(window_run({}))
    figures = {name: f.value for name, f in plan.figures.items()}
    assert figures["completion budget per prompt"] == 4096 - 700
    assert figures["mean completion tokens"] == pytest.approx(cut_mean(4000, 3396))
    assert figures["completions cut by the budget"] == pytest.approx(math.exp(-3396 / 4000))  # 42.8%
    assert figures["generated tokens never trained"] == 0.0
    # The same tokens trained as the uncapped run, for 43% less generation.
    uncapped = {n: f.value for n, f in build_plan(window_run(UNCAPPED_32K)).figures.items()}
    assert figures["tokens per record trained"] == pytest.approx(uncapped["tokens per record trained"])
    assert plan.warnings == []
    # A prompt longer than the window trains the window's worth and leaves no room for a completion.
    long = {n: f.value for n, f in build_plan(window_run({}, mean_prompt_tokens=5000)).figures.items()}
    assert (long["tokens per record trained"], long["mean completion tokens"]) == (4096, 0.0)
    # Limits past the window with the cap on are what the generate stage refuses at its start.
    refused = build_plan(window_run({"max_new_tokens": 32768, "max_model_len": 40960}))
    assert any("the stage refuses them at its start" in w for w in refused.warnings)


def test_the_pipeline_passes_the_training_window_to_generate_and_tokenize() -> None:
    from dflash_pipeline.run.stages import GENERATE, TOKENIZE, stage_config

    run = headline()
    for stage, name in ((GENERATE, "training_window"), (TOKENIZE, "max_length")):
        assert stage_config(stage, run, run.stages.for_stage(stage.name))[name] == 16384
    # A run file's own setting wins over the derived one.
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["generate"]["config"] = {"training_window": 8192}
    run = parse_run_config(data)
    assert stage_config(GENERATE, run, run.stages.for_stage("generate"))["training_window"] == 8192


@pytest.mark.slow
def test_plan_without_credentials_warns_and_sizes_the_run_from_its_file(tmp_path: Path) -> None:
    """The pre-submit check runs where no credentials for the bucket exist: figures from the run file, a warning."""
    empty = tmp_path / "aws"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(empty / "config"), AWS_SHARED_CREDENTIALS_FILE=str(empty / "credentials"),
               AWS_EC2_METADATA_DISABLED="true", AWS_REGION="us-east-1")
    done = subprocess.run([sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(HEADLINE_RUN)],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stdout.splitlines() if line.startswith("warning: storage:")]
    assert "s3://dflash-example-bucket/runs/qwen36-27b-v1/prompts/manifest.json" in warning
    assert "--offline" in warning and "run file" in warning
    offline = subprocess.run([sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(HEADLINE_RUN),
                              "--offline"], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120,
                             check=True)
    # The same figures as offline; only the warning differs.
    assert [line for line in done.stdout.splitlines() if line != warning] == offline.stdout.splitlines()


def test_cost_is_gpu_hours_times_the_price() -> None:
    plan = build_plan(headline(gpu_hour_price=2.5, currency="EUR"))
    for stage in plan.stages:
        assert plan.cost(stage) == (None if stage.gpu_hours is None else pytest.approx(stage.gpu_hours * 2.5))
    text = format_plan(plan)
    total = sum(s.gpu_hours or 0 for s in plan.stages)
    assert f"({total * 2.5:,.0f} EUR at 2.50 per GPU-hour)" in text
    unpriced = format_plan(build_plan(headline(gpu_hour_price=None)))
    assert "cost" not in unpriced.splitlines()[1] and "per GPU-hour" not in unpriced
    train = next(s for s in plan_json(plan)["stages"] if s["stage"] == "train")
    assert train["cost"] == pytest.approx(train["gpu_hours"] * 2.5)


def test_the_plan_warns_where_a_gpu_stage_is_not_pinned_to_the_gpu_it_assumes() -> None:
    assert gpu_model_warnings(headline()) == []
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["generate"]["gpu_types"] = ["NVIDIA-H100-80GB-HBM3"]
    del data["stages"]["evaluate"]["gpu_types"]
    warnings = gpu_model_warnings(parse_run_config(data))
    assert warnings == [
        "generate: the plan assumes NVIDIA-H200 ([plan] gpu_model) but the stage runs on NVIDIA-H100-80GB-HBM3: "
        "measure or set the throughputs for that GPU",
        "evaluate: the plan assumes NVIDIA-H200 ([plan] gpu_model) but the stage may run on any GPU; set "
        "stages.evaluate.gpu_types = [\"NVIDIA-H200\"]"]
    assert all(f"warning: {w}" in format_plan(build_plan(parse_run_config(data))) for w in warnings)


def test_a_gpu_type_no_node_is_labelled_with_is_named_with_the_label_it_likely_means() -> None:
    """The plan places "H200" (its matching is liberal) but a node selector matches exactly: the Job would pend."""
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["train"]["gpu_types"] = ["H200"]
    warnings = gpu_model_warnings(parse_run_config(data))
    assert warnings[0] == (
        "train: gpu_types 'H200' is not a value GPU feature discovery writes to nvidia.com/gpu.product: no node would "
        "match it; did you mean 'NVIDIA-H200'? (`kubectl get nodes -L nvidia.com/gpu.product` lists your nodes' "
        "values)")
    assert f"warning: {warnings[0]}" in format_plan(build_plan(parse_run_config(data)))
    data["stages"]["train"]["gpu_types"] = ["NVIDIA-H100-PCIe", "RTX-PRO-6000"]  # a real label; one it cannot place
    assert not any("gpu_types" in w for w in gpu_model_warnings(parse_run_config(data)))


def test_the_gpu_cluster_overlay_schedules_the_gpu_the_plan_assumes(tmp_path: Path) -> None:
    """The headline run's base through the shipped gpu-cluster overlay: every GPU pod may only land on the plan's
    GPU, and the overlay pins no other product."""
    import shutil

    from dflash_pipeline.render.base import write_base
    from tests.pipeline.k8s_support import OVERLAYS, jobs, kustomize_build

    run = headline()
    write_base(run, HEADLINE_RUN.name, tmp_path / "k8s" / "base")
    shutil.copytree(OVERLAYS / "gpu-cluster", tmp_path / "k8s" / "overlays" / "gpu-cluster")
    built = jobs(kustomize_build(tmp_path / "k8s" / "overlays" / "gpu-cluster"))
    for stage in ("generate", "train", "evaluate", "serve-check"):
        pod = built[stage]["spec"]["template"]["spec"]
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "In",
                                             "values": [run.plan.gpu_model]}]
        assert "nvidia.com/gpu.product" not in pod["nodeSelector"]


def test_a_queued_jobset_is_warned_for_the_quota_it_holds_while_it_waits() -> None:
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], "gang": "jobset"}
    assert not [w for w in build_plan(parse_run_config(data)).warnings if "reserves quota" in w]
    data["scheduling"] = {"queue_name": "dflash-batch"}
    plan = build_plan(parse_run_config(data))
    (warning,) = [w for w in plan.warnings if "reserves quota" in w]
    waited = sum(s.wall_seconds or 0 for s in plan.stages[:3])  # import, generate, tokenize
    assert "its 32 GPUs" in warning and f"~{32 * waited / 3600:,.0f} GPU-hours of quota held" in warning


def test_default_throughputs_are_scaled_to_each_stages_gpu_and_say_so() -> None:
    """The defaults are H200 figures: on H100s decoding scales by memory bandwidth (3.35 / 4.8 TB/s) and training by
    dense bf16 throughput (989 / 989 TFLOPS); a figure the run file sets is used as it is."""
    h200 = build_plan(headline())
    data = read_run_file(HEADLINE_RUN)
    for table in data["stages"].values():
        if table.get("gpu_types"):
            table["gpu_types"] = ["NVIDIA-H100-80GB-HBM3"]
    h100 = build_plan(parse_run_config(data))
    figures = {name: (f.value, f.source) for name, f in h100.figures.items()}
    assert h200.figures["generate tokens/s/GPU"].value == 1500
    assert h200.figures["generate tokens/s/GPU"].source == "estimate for NVIDIA-H200"
    assert figures["generate tokens/s/GPU"] == (pytest.approx(1500 * 3.35 / 4.8), (
        "estimate for NVIDIA-H100-80GB-HBM3: the NVIDIA-H200's 1,500 x 0.70, memory bandwidth 3.35 / 4.8 TB/s"))
    assert figures["train tokens/s/GPU"][0] == pytest.approx(3000)
    assert figures["evaluate tokens/s"][0] == pytest.approx(100 * 3.35 / 4.8)
    h200_hours, h100_hours = (sum(s.gpu_hours or 0 for s in plan.stages) for plan in (h200, h100))
    assert h100_hours > 1.05 * h200_hours
    data["plan"]["generate_tokens_per_s_per_gpu"] = 900
    given = build_plan(parse_run_config(data)).figures["generate tokens/s/GPU"]
    assert (given.value, given.source) == (900, "run file")


@pytest.mark.parametrize(("model_id", "factor"), [("Qwen/Qwen3-30B-A3B", 3.0), ("Qwen/Qwen3.5-397B-A17B", 27 / 17),
                                                  ("Qwen/Qwen3-8B", None)])
def test_a_mixture_of_experts_is_planned_from_its_active_parameters(model_id: str, factor: float | None) -> None:
    """The default rates are a dense 27B target's: a mixture of experts runs its active parameters per token, so its
    rates grow by 27B / active (at most 3x), and the figure says why; a dense target's do not change."""
    data = read_run_file(HEADLINE_RUN)
    data["target"]["model_id"] = model_id
    data["target"].pop("disk_size", None)
    plan = build_plan(parse_run_config(data))
    reference = build_plan(headline())
    for name in ("generate tokens/s/GPU", "train tokens/s/GPU", "evaluate tokens/s"):
        figure = plan.figures[name]
        assert figure.value == pytest.approx(reference.figures[name].value * (factor or 1.0))
        assert ("a mixture of experts running" in figure.source) is (factor is not None), figure.source
