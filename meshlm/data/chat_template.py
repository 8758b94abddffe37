"""Chat messages to one prompt string, through a Jinja chat template: the one renderer that serving
(`meshlm.serve.api`) and chat fine-tuning data (`meshlm.data.chat`) share.

A model's own template (`template_beside` finds it beside a tokenizer.json) is rendered the way
`transformers` renders it; a model without one gets `DEFAULT_TEMPLATE`, a plain transcript whose
generation stops before the model writes the user's next turn (`ChatTemplate.stop`; a model's
template stops at the end-of-turn marker it writes). Built-in templates by name (`BUILTIN`: `plain`,
`chatml` for Qwen, `gemma`, `mistral`) or a Jinja file are chosen by `resolve_chat_template`
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
# The system message, when the conversation opens with one, taken out of the turns (`system`, `turns`);
# the templates below fold it into the first user turn, or give it a user turn when there is none.
_SYSTEM_APART = (
    "{% set ns = namespace(system='') %}"
    "{% set turns = messages %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% endif %}"
    "{% if ns.system and not (turns | selectattr('role', 'equalto', 'user') | list) %}"
    "{% set turns = [{'role': 'user', 'content': ns.system}] + turns %}{% set ns.system = '' %}"
    "{% endif %}"
)
# Gemma's turns: <start_of_turn>ROLE ... <end_of_turn>, the assistant's role named `model`; no system
# role: the system message opens the first user turn, followed by a blank line.
GEMMA_TEMPLATE = (
    "{{ bos_token }}" + _SYSTEM_APART + "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if role == 'user' and ns.system %}{{ ns.system + '\n\n' }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Mistral's instruction format, spaced as its v3 tokenizer writes it: [INST] user[/INST] reply</s>; the
# system prompt opens the first instruction, followed by a blank line.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}" + _SYSTEM_APART + "{% for message in turns %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (ns.system + '\n\n' if ns.system else '') + message['content'] + '[/INST]' }}"
    "{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% else %}{{ raise_exception('the mistral template takes system, user and assistant messages, not '"
    " + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)
BUILTIN = {"plain": DEFAULT_TEMPLATE, "chatml": CHATML_TEMPLATE, "gemma": GEMMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
# End-of-turn markers a template may write after each reply: generation stops at those it writes.
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template rejected it, or the template is broken."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special-token strings it may refer to.

    `stop` holds the strings that end the assistant's turn (`stops_of`): the end-of-turn markers the
    template writes, or the transcript's next `User:` for the default template.
    """

    source: str = DEFAULT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = DEFAULT_STOP

    @classmethod
    def from_source(cls, source: str | None, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The model's own template, or the default one when it has none (`source` None or empty)."""
        if not source or source == DEFAULT_TEMPLATE:
            return cls()
        return cls(source, bos_token=bos_token, eos_token=eos_token, stop=stops_of(source, eos_token))

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

    def reply_length(self, reply: str) -> int:
        """How much of a rendered reply (from the generation prompt's end to the next turn) the model
        writes: through its end-of-turn marker (a `stop` string it ends with, the whitespace after that
        left out), else all of it."""
        kept = reply.rstrip()
        return len(kept) if any(kept.endswith(stop) for stop in self.stop if stop) else len(reply)


def stops_of(source: str, eos_token: str = "") -> tuple[str, ...]:
    """Where a reply ends under the template `source`: the `END_OF_TURN` markers it writes (Gemma's
    <end_of_turn>, ChatML's <|im_end|>, ...), and `eos_token` when the template writes that after a
    reply (Mistral's instruction format)."""
    stops = tuple(marker for marker in END_OF_TURN if marker in source)
    if eos_token and "eos_token" in source and eos_token not in stops:
        stops += (eos_token,)
    return stops


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
    try:
        _compile(source)  # a broken template is one error now, not one per conversation
    except ChatTemplateError as e:
        raise UsageError(f"chat template {origin}: {e}; fix it or pass --chat_template=chatml or plain") from None
    return ChatTemplate.from_source(source, bos_token=bos, eos_token=eos), origin
