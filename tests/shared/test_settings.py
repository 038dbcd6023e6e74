"""Flags as people type them: every boolean form, and a misspelt name answered with the nearest valid one."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from dflash_shared.errors import ConfigError
from dflash_shared.settings import (
    SECRET_NAME,
    StageSettings,
    env_name,
    env_value,
    parse_settings,
    public_dict,
    settings_reference_markdown,
)


class Optimizer(BaseModel):
    fused: bool = Field(default=False, description="Fused kernel.")


class ListConfig(StageSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_LISTTEST_")

    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    weights: dict[str, float] = Field(default_factory=dict, description="Weights by name.")
    resume: bool = Field(default=False, description="Resume.")
    ratio: float = Field(default=0.5, description="A ratio.")


class BoolConfig(StageSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_BOOLTEST_")

    enable_thinking: bool = Field(default=True, description="Thinking mode.")
    allow_truncated: bool | None = Field(default=None, description="Tri-state.")
    workers: int = Field(default=2, description="Worker count.")
    optim: Optimizer = Field(default_factory=Optimizer, description="Optimizer.")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--enable-thinking"], True),
        (["--no-enable-thinking"], False),
        (["--enable-thinking", "false"], False),
        (["--enable-thinking", "False"], False),
        (["--enable-thinking=false"], False),
        (["--enable-thinking=0"], False),
        (["--enable-thinking", "no"], False),
        (["--enable-thinking", "off"], False),
        (["--enable-thinking", "true"], True),
        (["--enable-thinking=1"], True),
        (["--enable-thinking", "YES"], True),
        ([], True),
    ],
)
def test_boolean_flag_forms(argv: list[str], expected: bool) -> None:
    assert parse_settings(BoolConfig, [*argv, "--workers", "3"]).enable_thinking is expected


def test_optional_and_nested_booleans_take_values() -> None:
    config = parse_settings(BoolConfig, ["--allow-truncated", "no", "--optim.fused=true"])
    assert config.allow_truncated is False and config.optim.fused is True
    assert parse_settings(BoolConfig, []).allow_truncated is None


@pytest.mark.parametrize("value", ["true", "1", "yes", "on"])
def test_boolean_environment_forms(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DFLASH_BOOLTEST_ENABLE_THINKING", "false")
    assert parse_settings(BoolConfig, []).enable_thinking is False
    monkeypatch.setenv("DFLASH_BOOLTEST_ENABLE_THINKING", value)
    assert parse_settings(BoolConfig, []).enable_thinking is True


def test_a_boolean_with_a_non_boolean_value_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--enable-thinking is a boolean: .* got 'maybe'"):
        parse_settings(BoolConfig, ["--enable-thinking=maybe"])
    # A following word that is no boolean is the next argument, not this flag's value.
    with pytest.raises(ConfigError, match="unknown flag"):
        parse_settings(BoolConfig, ["--enable-thinking", "maybe"])


def test_misspelt_flag_and_variable_suggest_the_nearest_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"unknown flag\(s\) --enable-thinkng \(did you mean --enable-thinking\?\)"):
        parse_settings(BoolConfig, ["--enable-thinkng"])
    with pytest.raises(ConfigError, match=r"--wrkers=3 \(did you mean --workers\?\)"):
        parse_settings(BoolConfig, ["--wrkers=3"])
    monkeypatch.setenv("DFLASH_BOOLTEST_WORKRS", "3")
    with pytest.raises(ConfigError, match=r"DFLASH_BOOLTEST_WORKRS \(did you mean DFLASH_BOOLTEST_WORKERS\?\)"):
        parse_settings(BoolConfig, [])


def test_reference_shows_the_boolean_forms() -> None:
    table = settings_reference_markdown(BoolConfig)
    assert r"`--enable-thinking`, `--no-enable-thinking`, `--enable-thinking true\|false`" in table
    assert "`--workers`, `--no-workers`" not in table


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("secret", True), ("AWS_SECRET_ACCESS_KEY", True), ("db_password", True), ("passwd", True),
        ("credentials", True), ("credential", True), ("hub_token", True), ("HF_TOKEN", True), ("api_key", True),
        ("OPENAI_APIKEY", True), ("access_key", True), ("accesskey", True), ("ssh_private_key", True),
        ("max_new_tokens", False), ("token_budget", False), ("secretary", False), ("keyword", False),
        ("tokenizer", False), ("num_prompts", False),
    ],
)
def test_one_secret_name_pattern_for_manifests_and_run_files(name: str, secret: bool) -> None:
    assert bool(SECRET_NAME.search(name)) is secret


def test_a_secret_looking_field_is_masked_in_the_recorded_config() -> None:
    class WithKey(StageSettings):
        model_config = SettingsConfigDict(env_prefix="DFLASH_KEYED_")
        private_key: str = Field(default="-----BEGIN-----", description="A key.")
        tokenizer: str = Field(default="qwen", description="Not a secret.")

    assert public_dict(WithKey()) == {"private_key": "***", "tokenizer": "qwen"}


def test_a_value_written_as_its_variable_is_read_back_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the rendered Jobs and the local run set for a stage (env_value) must parse back unchanged.
    given = {"stop": ["</think>", "a, b"], "weights": {"x": 0.25}, "resume": True, "ratio": 0.125}
    for field, value in given.items():
        monkeypatch.setenv(env_name(ListConfig, field), env_value(value))
    assert parse_settings(ListConfig, []).model_dump() == given
    assert env_value(False) == "false" and env_value(["a"]) == '["a"]'
