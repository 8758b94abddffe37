"""The HTTP API's request bodies: what `/v1/completions` and `/v1/chat/completions` accept.

Strict types ("5" is not a number and true is not 1), ranges checked, text checked to be text. Unknown
fields are ignored, as OpenAI clients send many; `n` must be 1. Extension: `top_k` (0 = off).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 4


def _unicode(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800); it is no character, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("text", f"holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at "
                                          f"character {e.start}, which is not text") from None
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


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class GenerationBody(BaseModel):
    """What completions and chat completions share. Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0, lt=2**31)] = 0  # the engine holds it as int32
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop_strings)] = ()
    n: StrictInt = 1
    stream: StrictBool = False
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
    prompt: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]


class ChatCompletionBody(GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = None  # the newer name of max_tokens


__all__ = ["GenerationBody", "CompletionBody", "ChatCompletionBody", "ChatMessage", "StreamOptions", "Text",
           "MAX_STOP_STRINGS"]
