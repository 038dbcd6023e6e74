"""dflash_shared.target_family: what a target family is, said once, and read the same way by every stage."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_shared.target_family import (
    FAMILIES,
    QWEN2,
    QWEN3,
    QWEN3_5,
    QWEN3_MOE,
    StatedSize,
    config_view,
    family_of_config,
    family_of_model_id,
    is_hybrid_config,
    is_moe_config,
    stated_parameters,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("model_id", "family"), [
    ("Qwen/Qwen3-8B", QWEN3), ("Qwen/Qwen3-30B-A3B", QWEN3_MOE), ("Qwen/Qwen3-Coder-30B-A3B-Instruct", QWEN3_MOE),
    ("Qwen/Qwen3-235B-A22B-Thinking-2507", QWEN3_MOE), ("tiny-qwen3_moe-demo", QWEN3_MOE),
    ("Qwen/Qwen3.6-27B", QWEN3_5), ("Qwen/Qwen3.5-397B-A17B", QWEN3_5), ("org/my-finetune-of-qwen3.6", QWEN3_5),
    ("Qwen/Qwen2.5-7B-Instruct", QWEN2), ("Qwen/Qwen2-72B-Instruct", QWEN2), ("tiny-qwen2-demo", QWEN2),
    ("Qwen/Qwen2.5-Coder-32B-Instruct", QWEN2), ("tiny-demo", QWEN3),
])
def test_the_plan_knows_the_family_from_the_model_id(model_id: str, family: object) -> None:
    assert family_of_model_id(model_id) is family


@pytest.mark.parametrize(("model_id", "stated"), [
    ("Qwen/Qwen3-8B", StatedSize(8.0, None)), ("Qwen/Qwen3-30B-A3B", StatedSize(30.0, 3.0)),
    ("Qwen/Qwen3.5-397B-A17B", StatedSize(397.0, 17.0)), ("meta-llama/Llama-3.1-70B-Instruct", StatedSize(70.0, None)),
    ("tiny-demo", StatedSize(None, None)),
])
def test_a_model_id_states_its_total_and_active_parameters(model_id: str, stated: StatedSize) -> None:
    assert stated_parameters(model_id) == stated


def test_a_mixture_of_experts_is_known_from_its_config() -> None:
    assert is_moe_config({"model_type": "qwen3_moe", "num_experts": 128})
    assert is_moe_config({"model_type": "qwen3_5_moe", "text_config": {"num_experts": 256}})
    assert not is_moe_config({"model_type": "qwen3"}) and not is_moe_config({"model_type": "x", "num_experts": 0})


@pytest.mark.parametrize(("config", "family", "hybrid"), [
    ({"model_type": "qwen3"}, QWEN3, False),
    ({"model_type": "qwen3_moe", "num_experts": 128}, QWEN3_MOE, False),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, QWEN3_5, True),  # a multimodal one
    ({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]}, QWEN3_5, True),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, QWEN2, False),
    ({"model_type": "llama"}, None, False),
    ({"model_type": "other", "text_config": {"layer_types": ["linear_attention"]}}, None, True),
])
def test_the_stages_know_the_family_and_hybrids_from_config_json(config: dict, family: object, hybrid: bool) -> None:
    assert family_of_config(config) is family and is_hybrid_config(config) is hybrid
    # A transformers config object reads the same as its JSON.
    text = config.get("text_config")
    obj = SimpleNamespace(**{k: v for k, v in config.items() if k != "text_config"},
                          **({"text_config": SimpleNamespace(**text)} if text else {}))
    assert family_of_config(config_view(obj)) is family and is_hybrid_config(config_view(obj)) is hybrid


def test_a_family_without_a_thinking_mode_refuses_thinking_and_keeps_its_instruct_sampling() -> None:
    assert [family.name for family in FAMILIES if not family.thinks] == ["qwen2"]
    assert QWEN2.sampling(False).repetition_penalty == 1.05 and QWEN3.sampling(False).repetition_penalty == 1.0
    with pytest.raises(ValueError, match="qwen2 targets have no thinking mode: set enable_thinking = false"):
        QWEN2.sampling(True)
    assert QWEN3.sampling(True).temperature == 0.6 and QWEN3_5.sampling(True).presence_penalty == 1.5


def test_no_other_module_tests_a_model_type_or_a_model_id() -> None:
    """The family is said in dflash_shared.target_family only: a model-id pattern or a model-type prefix test
    anywhere else in the source is a second place to change when a family is added."""
    pattern = re.compile(r"""qwen3\\\.\[|model_type[^\n]*\.startswith\(|startswith\(\(?["']qwen3""")
    offenders = [f"{path.relative_to(REPO)}:{n}" for root in ("shared/src", "jobs")
                 for path in sorted((REPO / root).rglob("*.py")) if path.name != "target_family.py"
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert offenders == []
