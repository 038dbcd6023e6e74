"""The base of every stage's single typed config, and the one way to parse it.

A stage defines its config once, as a `StageSettings` subclass with a description per field::

    class TokenizeConfig(StageSettings):
        model_config = SettingsConfigDict(env_prefix="DFLASH_TOKENIZE_")
        input_uri: str = Field(description="Completions prefix to read.")
        max_length: int = Field(default=4096, gt=0, description="Longest sequence kept.")

`parse_settings(TokenizeConfig, argv)` then accepts `--max-length 8192` on the command line, else
`DFLASH_TOKENIZE_MAX_LENGTH=8192` from the environment, else the default. The flags come from the model
(pydantic-settings' CLI source), so there is no second parser to drift from it. Unknown flags, and
unknown environment variables carrying the stage's prefix (a typo there would otherwise be ignored
silently), are refused with a `ConfigError` that names them.
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Sequence
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from dflash_shared.errors import ConfigError
from dflash_shared.logs import REDACTED, redact

S = TypeVar("S", bound="StageSettings")

# Field names that look like they hold a secret; their values never reach a manifest.
_SECRET_NAME = re.compile(r"(^|_)(secret|password|passwd|credentials?|api_key|access_key|token)$", re.IGNORECASE)


class StageSettings(BaseSettings):
    """Base of a stage config: immutable, unknown keys refused, flags in kebab case.

    Subclasses set `model_config = SettingsConfigDict(env_prefix="DFLASH_<STAGE>_")`. Nested models
    can be set from the environment with '__' (`DFLASH_TRAIN_OPTIM__LR=3e-4`) or from the command line
    with dots (`--optim.lr 3e-4`). Booleans are flags: `--resume` / `--no-resume`.
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        env_nested_delimiter="__",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_exit_on_error=False,
        # Settings come from flags and environment variables only, never from files in the work dir.
        env_file=None,
    )


def env_prefix(cls: type[BaseSettings]) -> str:
    return str(cls.model_config.get("env_prefix") or "")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(cls: type[BaseSettings], field: str) -> str:
    return (env_prefix(cls) + field).upper()


def _reject_unknown_env(cls: type[BaseSettings]) -> None:
    prefix = env_prefix(cls).upper()
    if not prefix:
        raise TypeError(f"{cls.__name__} must set model_config env_prefix (e.g. 'DFLASH_TOKENIZE_')")
    delimiter = str(cls.model_config.get("env_nested_delimiter") or "\0").upper()
    fields = {name.upper() for name in cls.model_fields}
    unknown = sorted(
        key
        for key in os.environ
        if key.upper().startswith(prefix) and key.upper()[len(prefix) :].split(delimiter)[0] not in fields
    )
    if unknown:
        known = ", ".join(env_name(cls, name) for name in cls.model_fields)
        raise ConfigError(f"unknown environment variable(s) {', '.join(unknown)}; {cls.__name__} reads {known}")


def _describe_validation(cls: type[BaseSettings], err: ValidationError) -> str:
    problems = []
    for item in err.errors():
        loc = [str(part) for part in item["loc"]]
        field = loc[0] if loc else "?"
        where = f"{'.'.join(loc)} ({flag_name(field)} / {env_name(cls, field)})"
        if item["type"] == "missing":
            problems.append(f"missing required setting {where}")
        else:
            shown = redact(repr(item.get("input")))[:120]
            problems.append(f"invalid {where}: {item['msg']}, got {shown}")
    return f"invalid {cls.__name__}: " + "; ".join(problems)


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Build the config from flags (first), environment variables (second) and defaults (last).

    `argv` excludes the program name; None means `sys.argv[1:]`. `--help` prints the flags and exits 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    _reject_unknown_env(cls)
    try:
        # Passed as a dict: type checkers only know the fields as keyword arguments of a settings class.
        sources: dict[str, Any] = {
            "_cli_parse_args": args,
            "_cli_prog_name": prog or cls.__name__,
            "_cli_show_env_vars": True,
        }
        return cls(**sources)
    except SettingsError as err:
        message = str(err)
        if "unrecognized arguments:" in message:
            extra = message.split("unrecognized arguments:", 1)[1].split()
            flags = [a for a in extra if a.startswith("-")] or extra
            valid = ", ".join(flag_name(name) for name in cls.model_fields)
            raise ConfigError(f"unknown flag(s) {', '.join(flags)}; {cls.__name__} accepts {valid}") from err
        raise ConfigError(f"invalid command line for {cls.__name__}: {redact(message)}") from err
    except ValidationError as err:
        raise ConfigError(_describe_validation(cls, err)) from err


# ---------------------------------------------------------------------- documentation


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(annotation))
    if origin is not None and get_args(annotation):
        name = getattr(origin, "__name__", None) or str(origin).replace("typing.", "")
        if name == "Literal":
            return " | ".join(repr(arg) for arg in get_args(annotation))
        return f"{name}[{', '.join(_type_name(arg) for arg in get_args(annotation))}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_text(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{getattr(value, 'value', value)!r}`"


def settings_reference_markdown(cls: type[BaseSettings]) -> str:
    """A Markdown table of every setting: flag, type, default, environment variable, description."""
    rows = [
        "| Setting | Type | Default | Environment variable | Description |",
        "|---|---|---|---|---|",
    ]
    for name, field in cls.model_fields.items():
        cells = [
            f"`{flag_name(name)}`",
            f"`{_type_name(field.annotation)}`",
            _default_text(field),
            f"`{env_name(cls, name)}`",
            (field.description or "").replace("\n", " "),
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------- provenance


def _scrub(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, key) for v in value]
    if isinstance(value, str):
        if value and _SECRET_NAME.search(key):
            return REDACTED
        return redact(value)
    return value


def public_dict(config: BaseModel) -> dict[str, Any]:
    """The resolved config as JSON-ready data for a manifest, with anything secret-looking masked.

    Configs should not hold secrets at all (credentials come from the standard AWS chain); this is the
    second line of defence: SecretStr fields, fields named like secrets, and values of secret
    environment variables are replaced by '***'.
    """
    data = _scrub(config.model_dump(mode="json"))
    assert isinstance(data, dict)
    return data
