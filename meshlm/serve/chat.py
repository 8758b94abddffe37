"""Chat messages to one prompt string, through a Jinja chat template.

A Hugging Face model folder says how its model was trained to see a conversation: a Jinja template
in `chat_template.jinja` or in `tokenizer_config.json` ("chat_template"). It is rendered the way
`transformers` renders it (a sandboxed environment, `trim_blocks`/`lstrip_blocks`, `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`). A model without one gets
`DEFAULT_TEMPLATE`, a plain transcript:

    System: You are terse.

    User: Hi!

    Assistant:

and generation stops before the model writes the user's next turn itself (`ChatTemplate.stop`).

    template = ChatTemplate.from_model_dir("path/to/hf_model")   # or ChatTemplate() for the default
    prompt = template.render([{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# What the model writes when it starts the user's next turn under DEFAULT_TEMPLATE.
DEFAULT_STOP = ("\nUser:",)


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template rejected it, or the template is broken."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special-token strings it may refer to.

    `stop` holds strings that end the assistant's turn when the template has no end-of-turn token of
    its own (only the default template needs them).
    """

    source: str = DEFAULT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = DEFAULT_STOP

    @classmethod
    def from_source(cls, source: str | None, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The model's own template, or the default one when it has none (`source` None or empty)."""
        if not source:
            return cls()
        return cls(source, bos_token=bos_token, eos_token=eos_token, stop=())

    @classmethod
    def from_model_dir(cls, folder: str | Path) -> ChatTemplate:
        """The template a Hugging Face model folder ships, with its BOS/EOS strings; else the default."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        return cls.from_source(
            read_template_source(folder),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
        )

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ({"role", "content"} mappings), ready for the assistant's reply."""
        try:
            return _compile(self.source).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from e


def read_template_source(folder: str | Path) -> str | None:
    """The chat template text a Hugging Face model folder ships, or None.

    Newer folders keep it in `chat_template.jinja`; older ones in `tokenizer_config.json`, either as a
    string or as a list of named templates, of which the one named "default" is the chat template.
    """
    folder = Path(folder)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str:
    """`tokenizer_config.json` writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML; a prompt wants the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template is not valid Jinja: {e}") from e
