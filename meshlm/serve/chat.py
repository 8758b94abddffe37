"""Chat messages to one prompt string, through a Jinja chat template.

A Hugging Face model folder says how its model was trained to see a conversation: a Jinja template
(`meshlm.serve.loading.read_chat_template` finds it). It is rendered the way `transformers` renders
it (a sandboxed environment, `trim_blocks`/`lstrip_blocks`, `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception`). A model without one gets `DEFAULT_TEMPLATE`, a plain
transcript:

    System: You are terse.

    User: Hi!

    Assistant:

and generation stops before the model writes the user's next turn itself (`ChatTemplate.stop`).

    template = ChatTemplate.from_source(model.chat_template, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
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
