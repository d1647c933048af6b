"""The OpenAI-compatible HTTP API of rank 0 (FastAPI).

Every request is checked here, in full, before it reaches the scheduler: the model
name, the JSON and its types, the prompt (empty, out of vocabulary, too long for
--max-model-len) and the queue limit. So bad input never reaches a collective, and the
workers never see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from shardwise.engine.sampling import SamplingParams
from shardwise.serve.http import BodyLimit
from shardwise.serve.metrics import Metrics
from shardwise.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    completion_body,
    error_body,
    new_id,
)
from shardwise.serve.scheduler import EngineDown, Output, QueueFull, Scheduler, Sequence
from shardwise.serve.text import ChatTemplate, TextStream

__all__ = ["ServerState", "build_app"]

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class ServerState:
    scheduler: Scheduler
    metrics: Metrics
    tokenizer: Any
    """The checkpoint's tokenizers.Tokenizer (serve refuses a checkpoint without one)."""
    chat: ChatTemplate
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_ids: frozenset[int]
    max_body_bytes: int
    info: dict = field(default_factory=dict)
    """Shown by /health: tp, backend, pids of the ranks."""
    created: int = field(default_factory=lambda: int(time.time()))


class _EngineError(Exception):
    pass


class _ClientGone(Exception):
    pass


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="shardwise", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status < 500:
            state.metrics.request_done("rejected")
        return JSONResponse(error_body(e.status, e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        state.metrics.request_done("rejected")
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            where, message = "", f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '?')}"
        else:
            msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            message = f"{where}: {msg}" if where else msg
        return JSONResponse(error_body(400, message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(e.status_code, str(e.detail), "invalid_request_error"), status_code=e.status_code
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, reason = state.scheduler.health()
        body = {"status": "ok" if ok else "unavailable", "reason": reason, **state.info}
        body["last_step_age_s"] = round(time.monotonic() - state.scheduler.last_beat, 3)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(healthy=state.scheduler.health()[0])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "shardwise"}
        return {"object": "list", "data": [{**card, "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            ids = state.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        return await _serve(state, request, body, ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = state.chat.render(messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = state.tokenizer.encode(text, add_special_tokens=not state.chat.own).ids
        max_tokens = body.max_completion_tokens or body.max_tokens or max(state.max_model_len - len(ids), 1)
        return await _serve(state, request, body, ids, max_tokens, chat=True)

    return BodyLimit(app, state.max_body_bytes)  # type: ignore[return-value]


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", param="model")


def _validate(state: ServerState, ids: list[int], max_tokens: int) -> None:
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(
            400, f"prompt has token ids outside the vocabulary [0, {state.vocab_size}): {bad[:5]}", param="prompt"
        )
    if len(ids) + max_tokens > state.max_model_len:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} is over "
            f"the maximum context length of {state.max_model_len} tokens (--max-model-len)",
            param="max_tokens",
        )


async def _serve(state: ServerState, request: Request, body, ids: list[int], max_tokens: int, *, chat: bool):
    _validate(state, ids, max_tokens)
    sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Output] = asyncio.Queue()

    def on_output(out: Output) -> None:  # the engine thread
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is going down
            loop.call_soon_threadsafe(queue.put_nowait, out)

    eos = frozenset() if body.ignore_eos else state.eos_ids
    seq = Sequence(ids, max_tokens, sampling, eos, on_output)
    try:
        state.scheduler.submit(seq)
    except QueueFull as e:
        raise ApiError(429, f"the server is at capacity: {e}; retry later", "rate_limit_error") from None
    except EngineDown as e:
        raise ApiError(503, f"the engine is down: {e}", "server_error") from None
    text = TextStream(state.tokenizer, body.stop_strings)
    rid, model = new_id("chatcmpl" if chat else "cmpl"), state.model_name
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def chunk(piece: str | None, finish: str | None, usage=None, first: bool = False) -> str:
        b = (
            chat_body(rid, model, piece, finish, usage, chunk=True, first=first)
            if chat
            else completion_body(rid, model, piece, finish, usage)
        )
        return f"data: {json.dumps(b)}\n\n"

    if body.stream:

        async def sse() -> AsyncIterator[str]:
            outcome = "cancelled"
            try:
                if chat:
                    yield chunk("", None, first=True)
                async for piece, finish in _events(state, seq, queue, text, None):
                    if piece or finish:
                        yield chunk(piece, finish)
                if include_usage:
                    yield chunk(None, None, (len(ids), text.tokens))
                outcome = "completed"
            except _EngineError as e:
                outcome = "error"
                yield f"data: {json.dumps(error_body(500, f'the engine failed: {e}', 'server_error'))}\n\n"
            finally:
                state.scheduler.cancel(seq)
                state.metrics.request_done(outcome)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    pieces, reason = [], None
    try:
        async for piece, finish in _events(state, seq, queue, text, request):
            pieces.append(piece)
            reason = finish
    except _EngineError as e:
        state.metrics.request_done("error")
        return JSONResponse(error_body(500, f"the engine failed: {e}", "server_error"), status_code=500)
    except _ClientGone:
        state.metrics.request_done("cancelled")
        return Response(status_code=499)
    state.metrics.request_done("completed")
    out = "".join(pieces)
    b = (
        chat_body(rid, model, out, reason, (len(ids), text.tokens), chunk=False)
        if chat
        else completion_body(rid, model, out, reason, (len(ids), text.tokens))
    )
    return JSONResponse(b)


async def _events(
    state: ServerState, seq: Sequence, queue: asyncio.Queue[Output], text: TextStream, watch: Request | None
) -> AsyncIterator[tuple[str, str | None]]:
    """(text piece, finish reason or None) until the sequence ends.

    watch: a non-streaming request, polled for a client that left (a stream notices
    that itself: Starlette cancels it)."""
    checked = time.monotonic()
    try:
        while True:
            if watch is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await watch.is_disconnected():
                    raise _ClientGone()
            try:
                out = await (asyncio.wait_for(queue.get(), 0.5) if watch is not None else queue.get())
            except TimeoutError:
                continue
            if out.error is not None:
                raise _EngineError(out.error)
            finish, piece = out.finish, ""
            if out.token is not None:
                piece = text.push(out.token)
            if text.stopped:
                finish = "stop"
            if finish is not None:
                yield piece + text.finish(), finish
                return
            yield piece, None
    finally:
        state.scheduler.cancel(seq)
