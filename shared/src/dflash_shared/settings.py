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
silently), are refused with a `ConfigError` that names them and suggests the nearest valid name.

Booleans take every form people type: `--resume`, `--no-resume`, `--resume false`, `--resume=0`, and in the
environment `DFLASH_TRAIN_RESUME=no`; true/false, 1/0, yes/no and on/off, in any case.
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from collections.abc import Sequence
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from dflash_shared.errors import ConfigError, did_you_mean
from dflash_shared.logs import REDACTED, redact

S = TypeVar("S", bound="StageSettings")

# Names that look like they hold a secret (a config field, an environment variable): their values never reach a
# manifest, and a run file may not set them (the pipeline sends them to the Secret instead).
SECRET_NAME = re.compile(
    r"(^|_)(secret|password|passwd|credentials?|token|api_?key|access_?key|private_key)$", re.IGNORECASE
)


class StageSettings(BaseSettings):
    """Base of a stage config: immutable, unknown keys refused, flags in kebab case.

    Subclasses set `model_config = SettingsConfigDict(env_prefix="DFLASH_<STAGE>_")`. A nested model (the
    train stage's `drafter`) is given whole as JSON (`--drafter '{...}'`); one of its fields can then be changed
    from the command line with dots (`--drafter.block-size 8`) or from the environment with '__'
    (`DFLASH_TRAIN_DRAFTER__BLOCK_SIZE=8`). Booleans are flags (`--resume` / `--no-resume`) that also take a value
    (`--resume false`, `--resume=1`).
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


def env_value(value: Any) -> str:
    """`value` as an environment variable that pydantic-settings reads back as it was: JSON for lists and dicts,
    true/false for booleans."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


_TRUE_WORDS = frozenset({"true", "1", "yes", "y", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "n", "off"})


def _bool_flags(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Flag names (without '--', nested ones dotted) of every boolean field, optional ones included."""
    names: set[str] = set()
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
        dotted = prefix + name.replace("_", "-")
        if bool in members:
            names.add(dotted)
        for member in members:
            if isinstance(member, type) and issubclass(member, BaseModel):
                names |= _bool_flags(member, dotted + ".")
    return names


def normalize_bool_flags(cls: type[BaseModel], args: Sequence[str]) -> list[str]:
    """Rewrite `--flag VALUE` and `--flag=VALUE` of boolean fields into `--flag` / `--no-flag`.

    The CLI source only knows the bare and `--no-` forms; users type the others (and the environment takes
    them), so they are translated here rather than refused as an "unknown flag false".
    """
    flags = _bool_flags(cls)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in flags:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in _TRUE_WORDS | _FALSE_WORDS:
                eq, value = "=", args[i + 1]
                i += 1
            if eq:
                if value.lower() in _TRUE_WORDS:
                    arg = f"--{name}"
                elif value.lower() in _FALSE_WORDS:
                    arg = f"--no-{name}"
                else:
                    raise ConfigError(f"--{name} is a boolean: give true/false, 1/0, yes/no or on/off, got {value!r}")
        out.append(arg)
        i += 1
    return out


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
        valid = [env_name(cls, name) for name in cls.model_fields]
        hints = "".join(did_you_mean(key.upper(), valid) for key in unknown[:1])
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}{hints}; {cls.__name__} reads {', '.join(valid)}"
        )


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
    args = normalize_bool_flags(cls, list(sys.argv[1:] if argv is None else argv))
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
            valid = [flag_name(name) for name in cls.model_fields]
            hint = did_you_mean(flags[0].split("=", 1)[0], valid) if flags else ""
            raise ConfigError(
                f"unknown flag(s) {', '.join(flags)}{hint}; {cls.__name__} accepts {', '.join(valid)}"
            ) from err
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
    bool_flags = _bool_flags(cls)
    for name, field in cls.model_fields.items():
        flag = f"`{flag_name(name)}`"
        if name.replace("_", "-") in bool_flags:
            flag = f"`{flag_name(name)}`, `--no-{name.replace('_', '-')}`, `{flag_name(name)} true|false`"
        cells = [
            flag,
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
        if value and SECRET_NAME.search(key):
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
