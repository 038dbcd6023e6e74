"""The generate stage holds one configuration per completions output: a worker started with other sampling than
the output's markers record is refused before the weights are fetched or an engine starts, while the engine's
sizing (memory, batch, GPUs per engine) may differ from pod to pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash_generate import stage
from dflash_shared.errors import exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifests import Accounting
from dflash_shared.runner import ShardMarker, ShardOutcome, marker_uri
from dflash_shared.stage_identity import SettingsChangedError
from dflash_shared.storage import ObjectStore
from tests.generate.stage_support import ONE_ARCH, stage_config, varied_prompts, write_prompts


def test_the_engines_sizing_is_no_other_configuration(tmp_path: Path) -> None:
    base = stage_config("in", "out", tmp_path, temperature=0.6)
    sized = base.model_copy(update={"gpu_memory_utilization": 0.5, "max_num_seqs": 4, "tensor_parallel_size": 2,
                                    "enforce_eager": False, "model_cache_dir": "/cache", "download_workers": 2})
    assert stage.settings_identity(sized) == stage.settings_identity(base)
    hotter = base.model_copy(update={"temperature": 0.9})
    assert stage.settings_identity(hotter).sha256 != stage.settings_identity(base).sha256


@ONE_ARCH
def test_a_worker_under_other_sampling_is_refused_before_an_engine_starts(
        tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ObjectStore()
    src = write_prompts(store, str(tmp_path / "prompts"), varied_prompts(6), shards=2)
    out = str(tmp_path / "completions")
    earlier = stage_config(src, out, tiny_target_dir, temperature=0.6, num_shards=2, shard_index=0)
    # Worker 0 finished under temperature 0.6 (its marker, as the runner writes it).
    done = ShardMarker(stage=stage.STAGE, item_count=0, items_sha256="x", identity=stage.settings_identity(earlier),
                       outcome=ShardOutcome(shard_index=0, shard_count=2, accounting=Accounting(
                           input_records=0, succeeded=0, failed=0, skipped=0)))
    store.write_bytes(marker_uri(out, 0, 2), done.model_dump_json().encode())

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused worker must not start an engine")

    monkeypatch.setattr(stage, "VllmEngine", no_engine)
    now = earlier.model_copy(update={"temperature": 0.9, "shard_index": 1})
    with pytest.raises(SettingsChangedError) as refused:
        stage.run(now, store)
    assert exit_code_for(refused.value) is ExitCode.USAGE
    assert [d.field for d in refused.value.changed] == ["temperature"]
    assert "temperature 0.6 there, 0.9 now" in str(refused.value)
    assert not store.list(str(tmp_path / "completions" / "data"))
