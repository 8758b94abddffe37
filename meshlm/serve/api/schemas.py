"""The HTTP API's request bodies: what `/v1/completions` and `/v1/chat/completions` accept.

Strict types ("5" is not a number and true is not 1), ranges checked, text checked to be text. Unknown
fields are ignored, as OpenAI clients send many; `n` must be 1. `null` stands for the default wherever
OpenAI accepts it. Extension: `top_k` (0 = off).

A completion's `prompt` is a string, a list of strings, a list of token ids or a list of such lists
(`Prompts`: at most `MAX_PROMPTS`); `echo` and `logprobs` (0..MAX_TOP alternatives) as OpenAI has them.
Chat takes `logprobs: true` and `top_logprobs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from pydantic_core import PydanticCustomError

from meshlm.serve.engine.sampling import SEED_RANGE

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 256  # prompts in one completions request
MAX_TOP = 20  # alternatives per position (logprobs, top_logprobs); meshlm.serve.engine.scoring.MAX_TOP


def _or(default: Any) -> BeforeValidator:
    """`null` means the default."""
    return BeforeValidator(lambda value: default if value is None else value)


def _unicode(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800); it is no character, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "text",
            f"holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, which is not text",
        ) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]


def _text_content(value: Any) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts, joined."""
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in value
    ):
        return _unicode("".join(part["text"] for part in value))
    raise PydanticCustomError("content", 'must be a string or a list of {"type": "text", "text": ...} parts')


def _stop_strings(value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value if value is not None else ()
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) and s for s in strings):
        raise PydanticCustomError("stop", "must be a non-empty string or a list of them")
    if len(strings) > MAX_STOP_STRINGS:
        raise PydanticCustomError("stop", f"at most {MAX_STOP_STRINGS} strings")
    return tuple(_unicode(s) for s in strings)


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms, as a list of prompts each a string or a list of token ids."""
    if isinstance(value, str):
        return [_unicode(value)]
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "prompt",
            "must be a string, a list of strings, a list of token ids or a list of lists of token ids, and not empty",
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [value]
    if len(value) > MAX_PROMPTS:
        raise PydanticCustomError("prompt", f"at most {MAX_PROMPTS} prompts in one request; split the batch")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(_unicode(item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            out.append(item)
        else:
            raise PydanticCustomError("prompt", f"item {i} is neither a string nor a list of token ids")
    return out


class StreamOptions(BaseModel):
    include_usage: Annotated[StrictBool, _or(False)] = False


class GenerationBody(BaseModel):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False), _or(1.0)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False), _or(1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0, lt=2**31), _or(0)] = 0  # the engine holds it as int32
    seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None  # every one its own stream
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop_strings)] = ()
    ignore_eos: Annotated[StrictBool, _or(False)] = False  # an extension: run to max_tokens past end-of-text
    n: Annotated[StrictInt, _or(1)] = 1
    stream: Annotated[StrictBool, _or(False)] = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise PydanticCustomError("n", "only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(GenerationBody):
    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # 0 with echo: score the prompt only
    echo: Annotated[StrictBool, _or(False)] = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP)] | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]


class ChatCompletionBody(GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = None  # the newer name of max_tokens
    logprobs: Annotated[StrictBool, _or(False)] = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP)] | None = None


__all__ = [
    "GenerationBody",
    "CompletionBody",
    "ChatCompletionBody",
    "ChatMessage",
    "StreamOptions",
    "Text",
    "MAX_STOP_STRINGS",
    "MAX_PROMPTS",
    "MAX_TOP",
]
