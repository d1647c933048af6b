"""The OpenAI wire format: request schemas (validated strictly) and response bodies.

Fields the server cannot honour (n > 1, logprobs, penalties, ...) are refused with a
400 rather than silently ignored; unknown fields are ignored, as OpenAI's clients send
some that do not change the result. `top_k` and `ignore_eos` are extensions (as in vLLM;
the openai client sends them through `extra_body`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ApiError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "completion_body",
    "chat_body",
    "error_body",
    "new_id",
]


class ApiError(Exception):
    """An error answered with an OpenAI-style JSON body: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Fields OpenAI defines that this server does not implement, and the value that is harmless.
_UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "response_format": None,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Sampling:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in (_UNSUPPORTED[name], None, False, [], {}):
                raise ValueError(f"{name}={value!r} is not supported by this server")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError(f"stop takes at most 4 strings, got {len(self.stop)}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list of one is accepted)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError(f"prompt holds {len(p)} prompts; send one request per prompt")
            p = p[0]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str, model: str, text: str | None, finish: str | None, usage: tuple[int, int] | None = None
) -> dict[str, Any]:
    """A text_completion object, or one streamed chunk of it (text None: a usage-only chunk)."""
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    body["choices"] = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    if usage is not None:
        body["usage"] = _usage(*usage)
    return body


def chat_body(
    rid: str,
    model: str,
    text: str | None,
    finish: str | None,
    usage: tuple[int, int] | None = None,
    *,
    chunk: bool,
    first: bool = False,
) -> dict[str, Any]:
    """A chat.completion object, or a chat.completion.chunk (text None: a usage-only chunk)."""
    obj = "chat.completion.chunk" if chunk else "chat.completion"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
    if text is None:
        body["choices"] = []
    elif chunk:
        delta: dict[str, str] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        message = {"role": "assistant", "content": text}
        body["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]
    if usage is not None:
        body["usage"] = _usage(*usage)
    return body
