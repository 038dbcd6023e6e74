"""The target model's chat format: its chat template and its tokenizer, loaded without transformers.

`ChatFormat.render` reproduces `transformers`' `apply_chat_template(..., tokenize=False)` exactly: the same
sandboxed Jinja environment (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII text), the same variables (the tokenizer's named special tokens, `tools`,
`documents`, `add_generation_prompt`, template keyword arguments) and the same message clean-up (keys
whose value is None dropped, reasoning aliased under `thinking`). The tokenizer is the model's
`tokenizer.json` run by the `tokenizers` library directly, which is what makes the stage fast.

A conversation whose user, system or tool text contains a literal control-token string (a user pasting
"<|im_end|>") must keep that text as text. `encode_batch` matches added tokens everywhere, as an engine
does; `encode_plain_batch` matches none, for the pieces between the template's own control tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding, Tokenizer

from dflash_shared import identity
from dflash_shared.errors import ConfigError
from dflash_shared.records import Message
from dflash_shared.target_family import END_OF_TURN, THINK_MARKERS, TURN_START
from dflash_tokenize.byte_spans import token_byte_lengths

# The named special tokens transformers passes to every chat template (its `special_tokens_map`).
TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Older names under which a message's reasoning arrives; transformers copies the first one found.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatFormatError(ConfigError):
    """The tokenizer directory or its chat template cannot be used; the message names the file.

    A setting to fix (`--tokenizer` points at the wrong place), so it exits USAGE: a retry cannot help.
    """


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` blocks (assistant-mask hints) and renders their body."""

    tags = {"generation"}  # the attribute jinja2 reads to route the tag here

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


# What `getattr` finds on a plain dict instance: its class's attributes (instances have no __dict__).
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the same answers at a fraction of the cost per attribute access.

    Rendering is most of this stage's work besides the tokenizer, and most of rendering is `message.role`
    style lookups. The sandbox answers them by trying `getattr(dict, "role")`, catching the
    AttributeError, then indexing; and it re-derives whether an attribute is safe on every access.
    Both answers depend only on the object's type and the attribute's name, so:
    - on a plain dict, a name that is not a dict attribute goes straight to the item lookup, which is
      what the sandbox would reach after its AttributeError;
    - the safety verdict is kept per (type, attribute name).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe_attributes: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe_attributes.get(key)
        if safe is None:
            safe = self._safe_attributes[key] = super().is_safe_attribute(obj, attr, value)
        return safe

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment configured like transformers' one."""
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def message_dict(message: Message | Mapping[str, Any]) -> dict[str, Any]:
    """The dict a chat template sees for one message (None values dropped, reasoning aliased)."""
    if isinstance(message, Message):
        data = message.template_dict()
    else:
        data = {k: v for k, v in message.items() if v is not None}
    reasoning = next((data[k] for k in _REASONING_FIELDS if data.get(k) is not None), None)
    if reasoning is not None:
        # Same aliasing as transformers: templates of different families read different names.
        data = {"thinking": reasoning, **data, "reasoning_content": reasoning}
    return data


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _alternation(tokens: Iterable[str]) -> re.Pattern[str]:
    # Longest first, so that at one position the longest token wins, as in the tokenizer's own matcher.
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) never matches


def read_chat_template(directory: Path, config: Mapping[str, Any]) -> str:
    """The chat template of a tokenizer directory, as every stage finds it (see dflash_shared.identity)."""
    try:
        return identity.read_chat_template(directory, config)
    except identity.TargetFilesError as err:
        raise ChatFormatError(str(err)) from err


class ChatFormat:
    """A model's chat template plus its tokenizer, with the control-token ids the stage needs.

    Encoding methods serialise on an internal lock (the literal-text path flips a tokenizer flag), so
    one instance may be shared by threads; processes each load their own.
    """

    def __init__(
        self,
        tokenizer_json: bytes,
        chat_template: str,
        template_tokens: Mapping[str, str] | None = None,
        *,
        name: str = "<memory>",
        end_of_turn: str = END_OF_TURN,
        turn_start: str = TURN_START,
        think_markers: tuple[str, str] = THINK_MARKERS,
    ) -> None:
        self.name = name
        self.tokenizer_sha256 = hashlib.sha256(tokenizer_json).hexdigest()
        self.chat_template = chat_template
        self.chat_template_sha256 = hashlib.sha256(chat_template.encode("utf-8")).hexdigest()
        self.template_tokens = dict(template_tokens or {})
        self._template = compile_chat_template(chat_template)

        # Parsed once by the tokenizers library (a Python JSON round trip costs seconds on a 250k vocab).
        self.tokenizer = Tokenizer.from_buffer(tokenizer_json)
        added = self.tokenizer.get_added_tokens_decoder()
        self.added_tokens: dict[str, int] = {str(t.content): int(i) for i, t in added.items()}
        self.special_tokens = frozenset(str(t.content) for t in added.values() if t.special)
        # Every added token is marked special in our copy so that `encode_special_tokens` turns off
        # matching for all of them (Qwen's <think> and <tool_call> are added but not special). Re-adding
        # an existing token only flips its flag: ids and the vocabulary are unchanged.
        self.tokenizer.add_special_tokens([
            AddedToken(str(t.content), special=True, normalized=t.normalized, lstrip=t.lstrip,
                       rstrip=t.rstrip, single_word=t.single_word)
            for t in added.values() if not t.special
        ])
        # Some tokenizer.json files carry a truncation or padding setting; the stage truncates itself.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._lock = threading.Lock()

        self.added_token_pattern = _alternation(self.added_tokens)
        # Whether JSON text of messages can be searched for these strings (see literal.py).
        self.added_tokens_json_safe = not any(
            c in '"\\' or ord(c) < 0x20 for token in self.added_tokens for c in token
        )
        self.special_token_pattern = _alternation(self.special_tokens)

        self.end_of_turn = end_of_turn
        self.turn_start = turn_start
        self.eot_id = self._required_id(end_of_turn)
        self.turn_start_id = self._required_id(turn_start)
        self.think_start, self.think_end = think_markers
        self.think_start_id = self.added_tokens.get(self.think_start)
        self.think_end_id = self.added_tokens.get(self.think_end)
        self.assistant_header = self._probe_assistant_header()

    @staticmethod
    def check_dir(directory: Path) -> tuple[dict[str, Any], str]:
        """(tokenizer_config.json's content, the chat template) of a directory that has a tokenizer.json."""
        if not (directory / "tokenizer.json").is_file():
            what = "does not exist" if not directory.exists() else "has no tokenizer.json"
            raise ChatFormatError(f"tokenizer directory {directory} {what}: point --tokenizer at the target model's "
                                  "directory (local or s3://), the one holding tokenizer.json and the chat template")
        config_file = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        return config, read_chat_template(directory, config)

    @classmethod
    def from_dir(cls, directory: str | Path, **kwargs: Any) -> ChatFormat:
        """Load `tokenizer.json` and the chat template from a model or tokenizer directory."""
        directory = Path(directory)
        config, template = cls.check_dir(directory)
        tok_file = directory / "tokenizer.json"
        tokens = {k: v for k in TEMPLATE_TOKEN_NAMES if (v := _token_content(config.get(k))) is not None}
        return cls(tok_file.read_bytes(), template, tokens, name=str(directory), **kwargs)

    def _required_id(self, token: str) -> int:
        if token not in self.added_tokens:
            raise ChatFormatError(f"{self.name}: tokenizer has no added token {token!r}")
        return self.added_tokens[token]

    def _probe_assistant_header(self) -> str:
        # The header that opens an assistant turn: what the generation prompt adds, up to its first
        # line end (a template may pre-fill more, like an opening <think>, which is not the header).
        probe = [{"role": "user", "content": "probe"}]
        bare = self.render_dicts(probe, add_generation_prompt=False, enable_thinking=True)
        with_prompt = self.render_dicts(probe, add_generation_prompt=True, enable_thinking=True)
        suffix = with_prompt[len(bare) :]
        if not with_prompt.startswith(bare) or not suffix.startswith(self.turn_start):
            raise ChatFormatError(
                f"{self.name}: the generation prompt {suffix!r} does not open with {self.turn_start!r}"
            )
        newline = suffix.find("\n")
        return suffix if newline < 0 else suffix[: newline + 1]

    # Rendering ---------------------------------------------------------------------------------

    def render_dicts(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render message dicts already shaped by `message_dict`."""
        variables: dict[str, Any] = {**self.template_tokens, **template_kwargs}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat as text, exactly as `apply_chat_template(..., tokenize=False)` renders it."""
        return self.render_dicts(
            [message_dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
            **template_kwargs,
        )

    # Encoding ----------------------------------------------------------------------------------

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """Encode texts as an engine does: every added-token string becomes that token."""
        with self._lock:
            return self.tokenizer.encode_batch(list(texts), add_special_tokens=False)

    def encode_batch_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids only, like `encode_batch` without the cost of tracking offsets (see byte_spans.py)."""
        with self._lock:
            return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    @functools.cached_property
    def token_byte_lengths(self) -> np.ndarray | None:
        """Bytes of text per id for byte-level tokenizers (None otherwise); built on first use."""
        return token_byte_lengths(self.tokenizer)

    def byte_lengths_for(self, records: int) -> np.ndarray | None:
        """The byte-length table when encoding this many records pays for building it, else None."""
        # Building it costs about what tracking offsets costs on a hundred records; token-exact
        # mode's spot checks encode a handful per batch and never need it.
        if records >= 64 or "token_byte_lengths" in self.__dict__:
            return self.token_byte_lengths
        return None

    def encode_plain_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """Encode texts as plain text: added-token strings are split into ordinary BPE tokens."""
        with self._lock:
            self.tokenizer.encode_special_tokens = True
            try:
                return self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
            finally:
                self.tokenizer.encode_special_tokens = False

    def encode(self, text: str) -> list[int]:
        """Ids of one text, added tokens matched (for tests and small jobs)."""
        return self.encode_batch([text])[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, control tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
