"""Chat messages to one prompt string, through a Jinja chat template: the one renderer that serving
(`meshlm.serve.api`) and chat fine-tuning data (`meshlm.data.chat`) share.

A model's own template (`template_beside` finds it beside a tokenizer.json) is rendered the way
`transformers` renders it; a model without one gets `DEFAULT_TEMPLATE`, a plain transcript whose
generation stops before the model writes the user's next turn (`ChatTemplate.stop`). Built-in
templates by name (`BUILTIN`: `plain`, `chatml`) or a Jinja file are chosen by `resolve_chat_template`
(`meshlm train --chat_template=NAME|PATH`).

    template = ChatTemplate.from_source(model.chat_template, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi!"}])

docs/data.md, "Chat templates", says how a template is rendered and found.
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

from meshlm.errors import UsageError

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# What the model writes when it starts the user's next turn under DEFAULT_TEMPLATE.
DEFAULT_STOP = ("\nUser:",)
# Each turn between a start marker naming the role and an end marker.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILTIN = {"plain": DEFAULT_TEMPLATE, "chatml": CHATML_TEMPLATE}


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


def template_beside(tokenizer_path: str | Path | None) -> str | None:
    """The chat template shipped with a tokenizer.json: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (its `default` entry when it lists several), in the tokenizer's folder; or None."""
    if tokenizer_path is None:
        return None
    folder = Path(tokenizer_path)
    folder = folder if folder.is_dir() else folder.parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        template = template_in_config(json.loads((folder / "tokenizer_config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return None
    return template or None


def template_in_config(config: dict) -> str | None:
    """A tokenizer_config.json's `chat_template`: the string, or the `default` entry (else the first)
    when it lists several as [{"name": ..., "template": ...}, ...]; None when there is none."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def resolve_chat_template(spec: str | None, tokenizer) -> tuple[ChatTemplate, str]:
    """The template for chat data and where it came from: `spec` a `BUILTIN` name or a Jinja file;
    None: the tokenizer's own (`template_beside`), else `plain`. Special tokens come from the tokenizer
    the way serving takes them (`bos_token`, `eos_token` attributes), so both render the same text."""
    bos = getattr(tokenizer, "bos_token", "") or ""
    eos = getattr(tokenizer, "eos_token", "") or ""
    if spec is None:
        own = template_beside(getattr(tokenizer, "path", None))
        if own is None:
            return ChatTemplate(), "plain (the tokenizer has no chat template)"
        source, origin = own, "the tokenizer's own"
    elif spec in BUILTIN:
        source, origin = BUILTIN[spec], spec
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UsageError(
                f"--chat_template={spec}: neither a built-in template ({', '.join(BUILTIN)}) "
                f"nor a Jinja file; name one of them or an existing file"
            )
        source, origin = path.read_text(), str(path)
    if source == DEFAULT_TEMPLATE:
        return ChatTemplate(), origin
    try:
        _compile(source)  # a broken template is one error now, not one per conversation
    except ChatTemplateError as e:
        raise UsageError(f"chat template {origin}: {e}; fix it or pass --chat_template=chatml or plain") from None
    return ChatTemplate(source, bos_token=bos, eos_token=eos, stop=()), origin
