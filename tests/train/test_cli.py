"""`dflash-train` as a Job runs it: exit codes, one clear error line, preflight lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.storage import ObjectStore, join
from tests.support import exit_policy
from tests.train.test_stage import other_template_target
from tests.train.train_fixtures import identity_of, synthetic_docs, tiny_target, write_tokenized


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("cli")
    return write_tokenized(ObjectStore(), str(root / "tok"), synthetic_docs(10), identity_of(tiny_target()))


def test_usage_help_and_bad_config() -> None:
    missing = cli()
    assert missing.returncode == 64 and "dflash-train {preflight|run|export|evaluate}" in missing.stderr
    helped = cli("run", "--help")
    assert helped.returncode == 0 and "--checkpoint-every" in helped.stdout and "DFLASH_TRAIN_RESUME" in helped.stdout
    bad = cli("run", "--preset", "debug", "--input", "x", "--output", "y", "--target", "z", "--lr", "-1")
    assert bad.returncode == 64, bad.stderr
    assert "invalid TrainConfig: invalid lr (--lr / DFLASH_TRAIN_LR)" in bad.stderr
    typo = cli("run", "--input", "x", env={"DFLASH_TRAIN_CHECKPOINT_EVRY": "5"})
    assert typo.returncode == 64 and "DFLASH_TRAIN_CHECKPOINT_EVRY" in typo.stderr


def test_preflight_passes_then_refuses_another_template(data: str, tmp_path: Path) -> None:
    common = ["--input", data, "--output", str(tmp_path / "out"), "--scratch-dir", str(tmp_path / "scratch"),
              "--disk-need-gib", "0.01"]
    ok = cli("preflight", *common, "--target", str(tiny_target()))
    assert ok.returncode == 0, ok.stderr
    for check in ("imports", "gpus", "storage_write", "disk", "kernels", "input_manifest", "target_compatible"):
        assert f"preflight train OK {check}" in ok.stderr
    assert "not needed: the target (qwen3) has no linear-attention layers" in ok.stderr
    assert "tokenizer and chat template match the target" in ok.stderr
    wrong = cli("preflight", *common, "--target", str(other_template_target(tmp_path)))
    assert wrong.returncode == 65
    assert "FAIL target_compatible" in wrong.stderr and "(field: target.chat_template_sha256)" in wrong.stderr
    no_gpu = cli("preflight", *common, "--target", str(tiny_target()), "--device", "cuda")
    assert no_gpu.returncode == 69 and "FAIL gpus" in no_gpu.stderr


def test_run_refuses_incompatible_data_with_bad_input(data: str, tmp_path: Path) -> None:
    result = cli("run", "--preset", "debug", "--input", data, "--output", str(tmp_path / "out"),
                 "--target", str(other_template_target(tmp_path)), "--scratch-dir", str(tmp_path / "scratch"))
    assert result.returncode == 65, result.stderr
    error = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(error) == 1 and "target.chat_template_sha256" in error[0] and join(data, "manifest.json") in error[0]


@pytest.mark.parametrize("case", exit_policy.CASES)
def test_unusable_storage_exits_69_in_run_as_in_preflight(case: str, s3_bucket: str, store: ObjectStore) -> None:
    write_tokenized(store, join(s3_bucket, "tokenized"), synthetic_docs(4), identity_of(tiny_target()))
    bucket = exit_policy.bucket_for(case, s3_bucket)
    argv = [sys.executable, "-m", "dflash_train", "run", "--preset", "debug", "--input", f"{bucket}/tokenized",
            "--output", f"{bucket}/drafter", "--target", str(tiny_target())]
    exit_policy.assert_environment_exit(exit_policy.run_case(argv, case, Path.cwd()), case)
