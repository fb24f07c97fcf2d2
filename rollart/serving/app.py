"""The OpenAI-compatible endpoint (FastAPI): ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` (OpenAI's Responses API, :mod:`rollart.serving.responses`) and
``/v1/messages`` (Anthropic's Messages API, :mod:`rollart.serving.messages`), each also under a
session's base URL ``/sessions/{id}/v1``. The last two are served as chat calls.

Sessions: an episode's calls go to its own base URL, ``http://HOST:PORT/sessions/{id}/v1`` — the
``base_url`` of an ``openai`` client, so a harness needs no change beyond it. Calls there are recorded
token-exactly (:mod:`rollart.serving.sessions`); calls to ``/v1`` are served and not recorded.
``POST /sessions`` opens one (the pipeline's ``agent`` env kind opens its own), ``GET /sessions/{id}``
shows it (``?trajectory=true``: the token-exact trajectory), ``POST /sessions/{id}/reward`` with
``{"reward": R}`` ends the episode with its reward, ``DELETE /sessions/{id}`` closes it.

Guards, in the order a request meets them: connections over ``max_connections`` (503) and headers not
sent within ``read_timeout_s`` (408) (:mod:`rollart.reward.http_server`); bearer token compared in
constant time from the headers alone, before any body byte is read (401; the per-job token, the
``api_key`` of an ``openai`` client, or as ``x-api-key`` that of an ``anthropic`` client); body size (413) and a body not sent within ``read_timeout_s``
(408) (:class:`~rollart.reward.http_guard.RequestGuard`); session (404), JSON that does not
parse (400), schema (422), what the endpoint cannot honour (400, naming the field), model name (404),
calls in flight (429 + ``Retry-After``), no inference worker (503 + ``Retry-After``). Every error is
an OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` (on ``/v1/messages`` with
Anthropic's ``"type": "error"`` beside it).

Bodies are parsed, and replies built, in the service's tokenizer thread (the loop is the driver's); a
string holding a lone surrogate is a 400 naming its field; an unexpected failure is a JSON 500.

``stream: true`` answers server-sent events (``chat.completion.chunk`` / ``text_completion`` chunks,
then ``data: [DONE]``; Responses and Anthropic events on their paths) as the engine decodes the reply
(:mod:`rollart.serving.streaming`): the response begins with the first text that is final, so an
error before it (no worker, a refused request) is still an HTTP error; one after it is an error event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollart.serving import messages as anthropic_events
from rollart.serving import responses as response_events
from rollart.serving.detok import pieces
from rollart.serving.messages import MessagesRequest, message_body, stream_events
from rollart.serving.messages import to_chat as messages_to_chat
from rollart.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, completion_id, now
from rollart.serving.responses import ResponsesRequest, ResponseStore, reply_message, response_body
from rollart.serving.responses import stream_events as responses_events
from rollart.serving.responses import to_chat as responses_to_chat
from rollart.serving.service import Choice, PolicyService, Result
from rollart.serving.sessions import Session, SessionStore
from rollart.serving.streaming import HoldRule, LiveCall, hold_rule

log = logging.getLogger(__name__)


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tag: str | None = Field(default=None, min_length=1, max_length=128)


MAX_ABS_REWARD = 1e6  # a reward a session accepts lies in [-MAX_ABS_REWARD, MAX_ABS_REWARD]


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)
    info: dict[str, Any] = Field(default_factory=dict)


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _logprobs(tokenizer: Any, choice: Choice) -> list[dict[str, Any]]:
    """One entry per content token (special tokens left out), as OpenAI's chat ``logprobs.content``:
    the token's text, its log-prob, its bytes and its ``top_logprobs`` (the most likely tokens of the
    distribution it was sampled from, each ``{token, logprob, bytes}``; empty unless asked)."""
    return _entries(tokenizer, choice.token_ids, choice.logprobs, choice.top)


def _entries(
    tokenizer: Any, ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]]
) -> list[dict[str, Any]]:
    """The ``logprobs.content`` entries of these tokens (special ones left out)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    tops = tops or [[] for _ in ids]
    for t, lp, top in zip(ids, logprobs, tops):
        if t in special:
            continue
        text = _token_text(tokenizer, t)
        alternatives = []
        for alt, alt_lp in top:
            alt_text = _token_text(tokenizer, alt)
            alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": list(alt_text.encode())})
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alternatives})
    return out


def _legacy_top(entry: dict[str, Any]) -> dict[str, float]:
    """A position's ``top_logprobs`` as the legacy completions API gives it: ``{token text: log-prob}``
    of the most likely tokens, and the sampled token's own (so up to ``logprobs + 1`` entries)."""
    top = {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
    top.setdefault(entry["token"], entry["logprob"])
    return top


def build_app(
    service: PolicyService,
    sessions: SessionStore,
    *,
    token: str | None = None,
    max_body_bytes: int = 8 << 20,
    read_timeout_s: float | None = None,
    ready: Callable[[], bool] = lambda: True,
    public_url: Callable[[], str] | None = None,
) -> FastAPI:
    """The endpoint over ``service``; ``token``: the bearer token every call must carry (None: open),
    checked from the headers alone before any body byte is read; ``read_timeout_s``: the most seconds
    a body may take to arrive (408 past it)."""
    from rollart.reward.http_guard import BearerAuth, RequestGuard

    app = FastAPI(title="rollart policy endpoint (OpenAI-compatible)", version="1")
    ep = _Endpoint(service, sessions, token, ready)
    _add_error_handlers(app)
    _add_model_routes(app, ep)
    for path, handler in (
        ("chat/completions", ep.chat),
        ("completions", ep.completion),
        ("responses", ep.respond),
        ("messages", ep.message),
    ):
        _serve(app, ep, path, handler)
    _add_session_routes(app, ep, public_url)
    app.add_middleware(
        RequestGuard,
        limit=max_body_bytes,
        auth=BearerAuth(token, {}, description="the job's token"),
        public=("/healthz",),
        read_timeout_s=read_timeout_s,
        error=_guard_error,
        token_headers=("x-api-key",),
    )
    return app


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def _guard_error(status: int, message: str) -> bytes:
    if status == 401:
        message = "missing or wrong bearer token (the job's token: the api_key of an openai client)"
    code = {401: "invalid_api_key", 408: "request_timeout", 413: "body_too_large"}.get(status)
    return json.dumps(APIError(status, message, code=code).body()).encode()


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI API's error body (and Anthropic's shape on ``/v1/messages``)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path.endswith("/v1/messages"):  # Anthropic's error shape too: {"type": "error", "error": ...}
            return JSONResponse({"type": "error", **exc.body()}, status_code=exc.status, headers=exc.headers())
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return _error(APIError(400, "the body is not valid JSON"))
        first = problems[0] if problems else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return _error(APIError(422, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _error(APIError(500, f"the endpoint failed: {type(exc).__name__}"))


class _Endpoint:
    """What the endpoint's routes share: the service, its sessions, the token check, and the handlers of
    the four call APIs (each answers a call with or without a session)."""

    def __init__(self, service: PolicyService, sessions: SessionStore, token: str | None, ready: Callable[[], bool]):
        self.service, self.sessions, self.token, self.ready = service, sessions, token, ready
        self.tok = service.tokenizer
        self.stored = ResponseStore()  # /v1/responses kept for previous_response_id

    def authorize(self, request: Request) -> None:
        if self.token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer":  # an anthropic client sends the token as x-api-key
            scheme, value = "bearer", request.headers.get("x-api-key", "")
        if not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise APIError(
                401,
                "missing or wrong bearer token (the job's token: the api_key of an openai client)",
                code="invalid_api_key",
            )

    def session_of(self, session_id: str, request: Request | None = None) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"no session {session_id[:64]!r} on this endpoint", code="session_not_found")
        if session.ended is not None:
            raise APIError(404, f"session {session_id[:64]!r} has ended ({session.ended})", code="session_closed")
        if request is not None and request.client is not None:
            session.clients.add(request.client.host)
        return session

    def check_ready(self) -> None:
        if not self.ready():
            raise APIError(503, "the policy is not being served yet; retry shortly", retry_after_s=2)

    async def body_of(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        # a big body is parsed off the loop
        return await self.service.offload(parse_body, raw, model, size=len(raw))

    def models(self) -> dict[str, Any]:
        version = self.service.version_fn()
        model = {"id": self.service.model, "object": "model", "created": 0, "owned_by": "rollart", "version": version}
        return {"object": "list", "data": [model]}

    def chat_rule(self, body: ChatCompletionRequest) -> HoldRule:
        """What of a streamed chat reply waits for its end: stop sequences, tool calls (as service.chat parses them)."""
        tools = bool(body.tools) and body.tool_choice != "none"
        return hold_rule(body.stop, tools, self.service.tool_parser, tools and body.forced_tool()[0])

    # replies are built in the tokenizer thread (decoding every token of a long reply is no work for the loop)
    async def chat(self, request: Request, session: Session | None) -> Any:
        service, tok = self.service, self.tok
        body: ChatCompletionRequest = await self.body_of(request, ChatCompletionRequest)
        self.check_ready()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            live = LiveCall(tok, self.chat_rule(body), lambda sink: service.chat(body, session, sink))
            if await live.first():
                version = service.version_fn()
                return _sse(_live_chat_chunks(tok, service.model, version, live, body.logprobs, include_usage))
            result = live.task.result()
        else:
            result = await service.chat(body, session)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            split = await service.offload(_split, tok, result, body.logprobs, True, size=0, tokens=_tokens(result))
            return _sse(_chat_chunks(service.model, result, split, include_usage))
        reply = await service.offload(
            _chat_response, tok, service.model, result, body.logprobs, size=0, tokens=_tokens(result)
        )
        return JSONResponse(reply)

    async def completion(self, request: Request, session: Session | None) -> Any:
        service, tok = self.service, self.tok
        body: CompletionRequest = await self.body_of(request, CompletionRequest)
        self.check_ready()
        logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            live = LiveCall(tok, hold_rule(body.stop, False, None, False), lambda s: service.complete(body, session, s))
            if await live.first():
                version = service.version_fn()
                return _sse(_live_completion_chunks(tok, service.model, version, live, logprobs, include_usage))
            result = live.task.result()
        else:
            result = await service.complete(body, session)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            split = await service.offload(_split, tok, result, logprobs, False, size=0, tokens=_tokens(result))
            return _sse(_completion_chunks(service.model, result, split, include_usage))
        reply = await service.offload(
            _completion_response, tok, service.model, result, logprobs, size=0, tokens=_tokens(result)
        )
        return JSONResponse(reply)

    async def respond(self, request: Request, session: Session | None) -> Any:
        service, tok, stored = self.service, self.tok, self.stored
        body: ResponsesRequest = await self.body_of(request, ResponsesRequest)
        self.check_ready()
        err = body.unsupported()
        if err is not None:
            raise err
        sid = session.id if session is not None else None
        history = stored.get(body.previous_response_id, sid) if body.previous_response_id else []
        chat_body, conversation = await service.offload(responses_to_chat, body, history)
        rid, message_id = completion_id("resp"), completion_id("msg")

        async def run(sink: Any = None) -> Result:
            result = await service.chat(chat_body, session, sink)
            stored.put(rid, sid, [*conversation, reply_message(result.choices[0])])
            return result

        if body.stream:
            live = LiveCall(tok, self.chat_rule(chat_body), run)
            if await live.first():
                return _named_sse(_live_response_events(service.model, body, rid, message_id, live))
            result = live.task.result()
        else:
            result = await run()
        choice = result.choices[0]
        reply = response_body(rid, service.model, body, result, choice)
        if not body.stream:
            return JSONResponse(reply)
        split = await service.offload(_split, tok, result, False, True, size=0, tokens=_tokens(result))
        return _named_sse(responses_events(reply, [text for text, _ in split[choice.index]]))

    async def message(self, request: Request, session: Session | None) -> Any:
        service, tok = self.service, self.tok
        body: MessagesRequest = await self.body_of(request, MessagesRequest)
        self.check_ready()
        err = body.unsupported()
        if err is not None:
            raise err
        chat_body = await service.offload(messages_to_chat, body)
        if body.stream:
            live = LiveCall(tok, self.chat_rule(chat_body), lambda sink: service.chat(chat_body, session, sink))
            if await live.first():
                return _named_sse(_live_message_events(service.model, live))
            result = live.task.result()
        else:
            result = await service.chat(chat_body, session)
        choice = result.choices[0]
        if not body.stream:
            return JSONResponse(message_body(service.model, result, choice))
        split = await service.offload(_split, tok, result, False, True, size=0, tokens=_tokens(result))
        texts = [text for text, _ in split[choice.index]]
        return _named_sse(stream_events(service.model, result, choice, texts))


def _add_model_routes(app: FastAPI, ep: _Endpoint) -> None:
    """``/healthz`` (public) and the model lists, with and without a session."""
    service = ep.service

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok" if ep.ready() else "starting",
            "model": service.model,
            "version": service.version_fn(),
            "sessions": len(ep.sessions),
            "in_flight": service.in_flight,
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        ep.authorize(request)
        return ep.models()

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request) -> dict[str, Any]:
        ep.authorize(request)
        ep.session_of(session_id)
        return ep.models()


def _serve(app: FastAPI, ep: _Endpoint, path: str, handler: Any) -> None:
    """``POST /v1/<path>`` (no session) and ``POST /sessions/{id}/v1/<path>`` (recorded into that session)."""

    async def plain(request: Request) -> Any:
        ep.authorize(request)
        return await handler(request, None)

    async def in_session(request: Request) -> Any:
        ep.authorize(request)
        return await handler(request, ep.session_of(request.path_params["session_id"], request))

    # plain Starlette routes: a handler reads its body itself and answers a Response, so FastAPI's parameter
    # resolution and response validation would only cost each call CPU (about a tenth of the endpoint's)
    app.add_route(f"/v1/{path}", plain, methods=["POST"], name=f"{path}_plain")
    app.add_route(f"/sessions/{{session_id}}/v1/{path}", in_session, methods=["POST"], name=f"{path}_session")


def _add_session_routes(app: FastAPI, ep: _Endpoint, public_url: Callable[[], str] | None) -> None:
    """Open a session, show it (with its trajectory), give it its reward, close it."""
    service, sessions = ep.service, ep.sessions

    @app.post("/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        ep.authorize(request)
        raw = await request.body()
        body = await ep.body_of(request, OpenSession) if raw.strip() else OpenSession()
        try:
            session = sessions.open(body.tag or service.default_tag)
        except OverflowError as err:
            raise APIError(429, str(err), retry_after_s=5) from None
        base = public_url() if public_url is not None else str(request.base_url).rstrip("/")
        return {"id": session.id, "base_url": f"{base}/sessions/{session.id}/v1", "tag": session.tag}

    @app.get("/sessions/{session_id}")
    async def show_session(session_id: str, request: Request, trajectory: bool = False) -> dict[str, Any]:
        ep.authorize(request)
        session = sessions.get(session_id)
        if session is None:
            raise APIError(404, f"no session {session_id[:64]!r} on this endpoint", code="session_not_found")
        out: dict[str, Any] = {
            "id": session.id,
            "tag": session.tag,
            "calls": len(session.calls),
            "chains": session.chains(),
            "reward": session.reward,
            "ended": session.ended,
        }
        if trajectory and session.calls:
            out["trajectory"] = session.trajectory(session.id).model_dump(mode="json")
        return out

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        ep.authorize(request)
        session = ep.session_of(session_id)
        body: RewardBody = await ep.body_of(request, RewardBody)
        if session.reward is not None:
            raise APIError(400, f"session {session_id[:64]!r} already has its reward", param="reward")
        session.set_reward(body.reward, body.info)
        return {"id": session.id, "reward": session.reward}

    @app.delete("/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> dict[str, Any]:
        ep.authorize(request)
        session = sessions.close(session_id)
        if session is None:
            raise APIError(404, f"no session {session_id[:64]!r} on this endpoint", code="session_not_found")
        if session.in_flight:
            await service.backend.abort(sorted(session.in_flight))
        return {"id": session.id, "closed": True}


# ---------------------------------------------------------------------- request bodies
def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """``raw`` as ``model``: 400 for what is not a JSON object or holds text that is not Unicode (a lone
    surrogate), 422 for what does not fit the schema; each naming the field."""
    try:  # a valid body in one pass through pydantic's JSON parser; anything else is looked at closely below
        return model.model_validate_json(raw)
    except ValidationError:
        pass
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    where = _lone_surrogate(data)
    if where is not None:
        raise APIError(
            400,
            f"{where or 'body'}: the text holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
            "Unicode; send valid UTF-8 or escape pairs",
            param=where or None,
        )
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise APIError(422, f"{param or 'body'}: {first['msg']}", param=param) from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string in ``value`` with a lone surrogate."""
    todo: list[tuple[Any, str]] = [(value, path)]
    while todo:
        item, at = todo.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return at
        elif isinstance(item, dict):
            for k, v in item.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return at
                todo.append((v, f"{at}.{k}" if at else str(k)))
        elif isinstance(item, list):
            todo.extend((v, f"{at}.{i}" if at else str(i)) for i, v in enumerate(item))
    return None


# ---------------------------------------------------------------------- response bodies
def _tokens(result: Result) -> int:
    return sum(len(c.token_ids) for c in result.choices)


def _usage(result: Result) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in result.choices)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def _message(choice: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": choice.text if (choice.text or not choice.tool_calls) else None,
    }
    if choice.tool_calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in choice.tool_calls
        ]
    return msg


def _chat_response(tok: Any, model: str, result: Result, logprobs: bool) -> dict[str, Any]:
    return {
        "id": completion_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": f"rollart-v{result.version}",
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": {"content": _logprobs(tok, c)} if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in result.choices
        ],
        "usage": _usage(result),
    }


def _completion_response(tok: Any, model: str, result: Result, logprobs: bool) -> dict[str, Any]:
    return {
        "id": completion_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": f"rollart-v{result.version}",
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(tok, c) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in result.choices
        ],
        "usage": _usage(result),
    }


def _completion_logprobs(tok: Any, choice: Choice) -> dict[str, Any]:
    entries = _logprobs(tok, choice)
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_legacy_top(e) for e in entries] if choice.top else None,
        "text_offset": offsets,
    }


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        n = 0
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
            n += 1
            if n % 32 == 0:  # a write that does not fill the socket's buffer never yields: let others run
                await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _named_sse(
    events: Iterator[tuple[str, dict[str, Any]]] | AsyncIterator[tuple[str, dict[str, Any]]],
) -> StreamingResponse:
    """Server-sent events with names (``event: NAME``), as the Anthropic API streams."""

    async def each() -> AsyncIterator[tuple[str, dict[str, Any]]]:
        if isinstance(events, AsyncIterator):
            async for event in events:
                yield event
        else:
            for event in events:
                yield event

    async def body() -> AsyncIterator[bytes]:
        n = 0
        async for name, data in each():
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            n += 1
            if n % 32 == 0:
                await asyncio.sleep(0)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


Split = dict[int, list[tuple[str, list[dict[str, Any]] | None]]]


def _split(tok: Any, result: Result, logprobs: bool, chat: bool) -> Split:
    """Each choice's content as streamed: ``{choice index: [(piece, its logprob entry), ...]}``."""
    return {
        c.index: _pieces(tok, c, logprobs) if (not chat or c.text or not c.tool_calls) else [] for c in result.choices
    }


def _pieces(tok: Any, choice: Choice, logprobs: bool) -> list[tuple[str, list[dict[str, Any]] | None]]:
    """The content split into one piece per token (text, its logprob entry); the pieces join to the
    content exactly (a piece whose token ends mid-character waits for the next one). Linear in the
    reply's length (:mod:`rollart.serving.detok`)."""
    entries = _logprobs(tok, choice) if logprobs else None
    special = set(getattr(tok, "all_special_ids", []) or [])
    ids = [t for t in choice.token_ids if t not in special]
    out: list[tuple[str, list[dict[str, Any]] | None]] = []
    for k, piece in pieces(tok, ids, choice.text):
        out.append((piece, [entries[k]] if entries is not None and 0 <= k < len(entries) else None))
    return out


async def _chat_chunks(model: str, result: Result, split: Split, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    cid, created = completion_id("chatcmpl"), now()
    head = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": f"rollart-v{result.version}",
    }
    for c in result.choices:
        yield {
            **head,
            "choices": [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        for text, lp in split[c.index]:
            yield {
                **head,
                "choices": [
                    {
                        "index": c.index,
                        "delta": {"content": text},
                        "logprobs": {"content": lp} if lp is not None else None,
                        "finish_reason": None,
                    }
                ],
            }
        if c.tool_calls:
            calls = [
                {"index": i, "id": cid_, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
                for i, (cid_, p) in enumerate(c.tool_calls)
            ]
            yield {
                **head,
                "choices": [
                    {"index": c.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
                ],
            }
        yield {**head, "choices": [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(result)}


async def _completion_chunks(
    model: str, result: Result, split: Split, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    cid, created = completion_id("cmpl"), now()
    head = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": f"rollart-v{result.version}",
    }
    for c in result.choices:
        for text, lp in split[c.index]:
            yield {
                **head,
                "choices": [
                    {
                        "index": c.index,
                        "text": text,
                        "finish_reason": None,
                        "logprobs": {
                            "tokens": [e["token"] for e in lp],
                            "token_logprobs": [e["logprob"] for e in lp],
                            "top_logprobs": [_legacy_top(e) for e in lp] if c.top else None,
                            "text_offset": [0],
                        }
                        if lp
                        else None,
                    }
                ],
            }
        yield {**head, "choices": [{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(result)}


# ---------------------------------------------------------------------- live streams
async def _ended(live: LiveCall) -> Result | APIError:
    """The streamed call's result, or the error it ended with (sent as an event: the response began)."""
    try:
        result: Result = live.task.result()
    except APIError as err:
        return err
    except Exception as err:
        log.warning("a streamed call failed: %s: %s", type(err).__name__, err)
        return APIError(500, f"the endpoint failed: {type(err).__name__}")
    return result


async def _live_chat_chunks(
    tok: Any, model: str, version: int, live: LiveCall, logprobs: bool, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks as the reply is decoded: each choice's role, its text as it becomes final, then
    (at the end) the rest of its text, its tool calls and its finish reason."""
    head = {
        "id": completion_id("chatcmpl"),
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "system_fingerprint": f"rollart-v{version}",
    }

    def chunk(index: int, delta: dict[str, Any], lp: list[dict[str, Any]] | None = None, finish: Any = None) -> Any:
        logs = {"content": lp} if lp is not None else None
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logs, "finish_reason": finish}]}

    for index in sorted(live.replies):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, text, a, b in live.pieces():
        reply = live.replies[index]
        lp = _entries(tok, reply.token_ids[a:b], reply.logprobs[a:b], reply.top[a:b]) if logprobs else None
        yield chunk(index, {"content": text}, lp)
    ended = await _ended(live)
    if isinstance(ended, APIError):
        yield ended.body()
        return
    for c in ended.choices:
        rest, k = live.rest(c.index, c.text)
        entries = _logprobs(tok, c)[k:] if logprobs else None
        if rest or entries:
            yield chunk(c.index, {"content": rest}, entries)
        if c.tool_calls:
            calls = [
                {"index": i, "id": cid_, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
                for i, (cid_, p) in enumerate(c.tool_calls)
            ]
            yield chunk(c.index, {"tool_calls": calls})
        yield chunk(c.index, {}, finish=c.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(ended)}


def _legacy_chunk_logprobs(entries: list[dict[str, Any]], top: bool) -> dict[str, Any] | None:
    if not entries:
        return None
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_legacy_top(e) for e in entries] if top else None,
        "text_offset": [0],
    }


async def _live_completion_chunks(
    tok: Any, model: str, version: int, live: LiveCall, logprobs: bool, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """Completion chunks as the text is decoded, then the rest and the finish reason of each choice."""
    head = {
        "id": completion_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": f"rollart-v{version}",
    }

    def chunk(index: int, text: str, lp: dict[str, Any] | None = None, finish: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": lp}]}

    async for index, text, a, b in live.pieces():
        reply = live.replies[index]
        lp = None
        if logprobs:
            entries = _entries(tok, reply.token_ids[a:b], reply.logprobs[a:b], reply.top[a:b])
            lp = _legacy_chunk_logprobs(entries, any(reply.top[a:b]))
        yield chunk(index, text, lp)
    ended = await _ended(live)
    if isinstance(ended, APIError):
        yield ended.body()
        return
    for c in ended.choices:
        rest, k = live.rest(c.index, c.text)
        entries = _logprobs(tok, c)[k:] if logprobs else []
        if rest or entries:
            yield chunk(c.index, rest, _legacy_chunk_logprobs(entries, bool(c.top)))
        yield chunk(c.index, "", None, c.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(ended)}


async def _live_response_events(
    model: str, body: Any, rid: str, message_id: str, live: LiveCall
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Responses events as the text is decoded: the response's opening and its message item's, the
    text deltas, then (at the end) the rest of the text, its function calls and ``response.completed``."""
    seq = response_events.EventSeq()
    for event in response_events.stream_opening(response_events.response_head(rid, model, body), seq):
        yield event
    for event in response_events.stream_text_opening(message_id, seq):
        yield event
    async for index, text, _, _ in live.pieces():
        if index == 0:
            yield response_events.text_delta(message_id, text, seq)
    ended = await _ended(live)
    if isinstance(ended, APIError):
        yield seq("error", code=ended.code, message=ended.message, param=ended.param)
        return
    choice = ended.choices[0]
    reply = response_body(rid, model, body, ended, choice, message_id=message_id)
    rest, _ = live.rest(0, choice.text)
    for event in response_events.stream_rest(reply, [rest], seq, text_open=True):
        yield event


async def _live_message_events(model: str, live: LiveCall) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Anthropic events as the text is decoded: ``message_start``, the text block's start and deltas,
    then (at the end) the rest of the text, the tool-use blocks, ``message_delta`` and ``message_stop``."""
    message_id = completion_id("msg")
    yield anthropic_events.stream_start(model, message_id, live.prompt_tokens)
    yield anthropic_events.text_block_start(0)
    async for index, text, _, _ in live.pieces():
        if index == 0:
            yield anthropic_events.text_delta(text, 0)
    ended = await _ended(live)
    if isinstance(ended, APIError):
        yield "error", {"type": "error", "error": {"type": ended.body()["error"]["type"], "message": ended.message}}
        return
    choice = ended.choices[0]
    head = message_body(model, ended, choice, message_id=message_id)
    rest, _ = live.rest(0, choice.text)
    for event in anthropic_events.stream_rest(head, [rest], text_open=True):
        yield event
