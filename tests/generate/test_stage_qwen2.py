"""The generate stage on a family without a thinking mode (Qwen2.5's), on a real vLLM engine (CPU build).

Left unset, `enable_thinking` settles to the family's only mode: the prompts render without thinking, the manifest
and every record say so, and no answer is flagged for the reasoning it was never going to have (with the old default,
thinking on, every one was `thinking_missing`). Thinking on is refused before anything is generated or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="stage tests need the generate environment (.venv-generate)")

from dflash_generate.stage import run  # noqa: E402
from dflash_shared.errors import ConfigError  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import CompletionsSection, Kind  # noqa: E402
from dflash_shared.storage import ObjectStore, join  # noqa: E402
from tests.generate.stage_support import completions, stage_config, varied_prompts, write_prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QWEN2 = pytest.mark.parametrize("target_arch", ["qwen2"], indirect=True)


def prompts_and_output(tmp_path: Path, count: int) -> tuple[ObjectStore, str, str]:
    """The store, a prompts manifest of `count` prompts, and where the completions go."""
    store = ObjectStore()
    src = write_prompts(store, join(str(tmp_path), "prompts"), varied_prompts(count))
    return store, src, join(str(tmp_path), "completions")


@QWEN2
def test_unset_thinking_generates_in_the_familys_only_mode(engine: Any, tiny_target_dir: Path,
                                                          tmp_path: Path) -> None:
    store, src, out = prompts_and_output(tmp_path, 6)
    config = stage_config(src, out, tiny_target_dir)
    assert config.enable_thinking is None
    assert run(config, store, engine=engine) == join(out, "manifest.json")
    manifest = load_manifest(store, out, Kind.completions).manifest
    section = manifest.section
    assert isinstance(section, CompletionsSection) and section.target is not None
    assert (section.target_family, section.target.enable_thinking) == ("qwen2", False)
    assert (section.target.special_tokens.think_start, section.target.special_tokens.think_end) == (None, None)
    # Every value the test does not set is the family's preset for its only mode (repetition penalty included).
    assert {source for source in section.sampling_sources.values() if source != "explicit"} == {
        "preset:qwen2/non_thinking"}
    assert section.sampling["repetition_penalty"] == 1.05
    assert (manifest.accounting.succeeded, manifest.accounting.failed) == (6, 0)
    records = completions(store, out)
    assert len(records) == 6 and all(r.enable_thinking is False for r in records)
    assert all(not r.messages[-1].reasoning_content for r in records)


@QWEN2
def test_thinking_on_is_refused_before_anything_is_generated(engine: Any, tiny_target_dir: Path,
                                                             tmp_path: Path) -> None:
    store, src, out = prompts_and_output(tmp_path, 2)
    with pytest.raises(ConfigError, match="enable_thinking: qwen2 targets have no thinking mode"):
        run(stage_config(src, out, tiny_target_dir, enable_thinking=True), store, engine=engine)
    assert store.list(out) == []
