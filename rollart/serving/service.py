"""What the endpoint does, without HTTP: requests in OpenAI's form to token-exact generations.

:class:`PolicyService` turns a chat or completion request into prompt token ids (continuing the
session's tokens where the history allows, :mod:`rollart.serving.render`), sends one
:class:`~rollart.rollout.types.GenerateRequest` per choice to the backend (the LLMProxy, routed by the
session's tag), cuts each reply at its stop sequence, parses tool calls, records the call in the
session and returns the choices. Errors are :class:`~rollart.serving.protocol.APIError` with the
status the endpoint answers.

The endpoint shares the driver's event loop, so no request's size turns into work on it: a prompt is
measured in characters first (:meth:`PolicyService._fits`: no token is longer than the tokenizer's
longest token string, so a text longer than ``context × that`` characters is refused with 400 before
it is tokenised); rendering, tokenising, detokenising and cutting at stop sequences run in one
tokenizer thread (:meth:`PolicyService.offload`), and detokenising is incremental
(:mod:`rollart.serving.detok`), linear in the reply's length.

Streaming: a call given a :class:`StreamSink` generates through the backend's ``generate_stream`` and
hands the sink each choice's deltas as the engine decodes them (:mod:`rollart.serving.streaming` turns
them into text); the call then ends, is cut, parsed and recorded exactly as an unstreamed one, from the
final outputs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rollart.cluster.errors import ClusterError
from rollart.engines.base import SamplingParams
from rollart.rollout.chat import ChatTemplateError
from rollart.rollout.types import GenerateDelta, GenerateOutput, GenerateRequest
from rollart.serving.detok import cut_after
from rollart.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from rollart.serving.render import ChatRenderer
from rollart.serving.sessions import CallRecord, ChoiceRecord, Session, SessionClosed, TokenTrace
from rollart.serving.tools import ParsedCall, ToolParser, call_id

log = logging.getLogger(__name__)

NO_CHAT_TEMPLATE = (
    "this model has no chat template: use /v1/completions, or give the run one: serving.chat_template "
    "(a Jinja file or inline Jinja), or tiny_model: {chat: true} for the built-in tiny model"
)
T = TypeVar("T")
INLINE_CHARS = 4096  # text rendered or tokenised on the loop itself (more goes to the tokenizer thread)
INLINE_TOKENS = 256  # reply tokens detokenised on the loop itself
UNKNOWN_CONTEXT = 131072  # the context assumed, for the length check by characters, of a model whose config names none


class Backend(Protocol):
    """Where generations run: the LLMProxy (:class:`ProxyBackend`) or anything with its ``generate``."""

    async def generate(self, request: GenerateRequest, tag: str, *, affinity: str | None = None) -> GenerateOutput: ...
    async def abort(self, request_ids: list[str]) -> None: ...


class StreamingBackend(Backend, Protocol):
    """A backend that also streams (the LLMProxy): deltas as tokens are decoded, then the output."""

    def generate_stream(
        self, request: GenerateRequest, tag: str, *, affinity: str | None = None
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]: ...


class StreamSink(Protocol):
    """Where a streamed call's progress goes (:class:`rollart.serving.streaming.LiveCall`)."""

    def started(self, prompt_tokens: int, n: int) -> None: ...
    def delta(self, index: int, delta: GenerateDelta) -> None: ...


class ProxyBackend:
    """The LLMProxy as the endpoint's backend."""

    def __init__(self, proxy: Any):
        self.proxy = proxy

    async def generate(self, request: GenerateRequest, tag: str, *, affinity: str | None = None) -> GenerateOutput:
        """A session's calls go to the worker of its last call (``affinity``): its prefix cache may hold them."""
        out: GenerateOutput = await self.proxy.generate(request, tag, affinity=affinity)
        return out

    async def abort(self, request_ids: list[str]) -> None:
        await self.proxy.abort(request_ids)

    def generate_stream(
        self, request: GenerateRequest, tag: str, *, affinity: str | None = None
    ) -> AsyncIterator[GenerateDelta | GenerateOutput]:
        stream: AsyncIterator[GenerateDelta | GenerateOutput] = self.proxy.generate_stream(
            request, tag, affinity=affinity
        )
        return stream


@dataclass
class Choice:
    """One choice as the endpoint answers it."""

    index: int
    token_ids: list[int]  # the ids returned (and recorded), stop-sequence tokens included
    logprobs: list[float]
    text: str  # the content (without a stop sequence or special tokens)
    finish_reason: str
    tool_calls: list[tuple[str, ParsedCall]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with top log-probs asked
    stop: str | None = None  # the stop sequence the reply ended at


@dataclass
class Result:
    choices: list[Choice]
    prompt_tokens: int
    version: int


class PolicyService:
    """Serves one policy. ``version_fn`` gives the weight version served; ``max_context`` the model's
    context (prompt + reply tokens); ``sampling`` the defaults of fields a request leaves unset."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        *,
        model: str,
        renderer: ChatRenderer | None,
        tool_parser: ToolParser,
        sampling: SamplingParams | None = None,
        max_context: int | None = None,
        max_n: int = 16,
        max_concurrency: int = 1024,
        default_tag: str = "agent",
        version_fn: Callable[[], int] = lambda: 0,
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model = model
        self.renderer = renderer
        self.tool_parser = tool_parser
        self.sampling = sampling or SamplingParams(max_new_tokens=256)
        self.max_context = max_context
        self.max_n = max_n
        self.max_concurrency = max_concurrency
        self.default_tag = default_tag
        self.version_fn = version_fn
        self.in_flight = 0
        eos = getattr(tokenizer, "eos_token_id", None)
        stops = renderer.stop_ids if renderer is not None else ([eos] if eos is not None else [])
        self.stop_ids = list(stops)
        self.counts: dict[str, int] = {"calls": 0, "continued": 0, "fresh": 0, "failed": 0}
        self.max_token_chars = longest_token(tokenizer)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-tokenizer")

    # ------------------------------------------------------------------ requests
    async def chat(
        self, body: ChatCompletionRequest, session: Session | None, sink: StreamSink | None = None
    ) -> Result:
        """A chat call; with ``sink``, its tokens go there as they are decoded (a streamed call)."""
        self._check(body, body.max_completion_tokens or body.max_tokens)
        renderer = self.renderer
        if renderer is None:
            raise APIError(400, NO_CHAT_TEMPLATE, param="messages")
        tools = (
            [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" else None
        )
        if tools and not renderer.renders_tools:
            raise APIError(
                400,
                "tools: the model's chat template does not render tools, so the model would never see them; "
                "serve it with a template that does (chat_template)",
                param="tools",
            )

        def prepare() -> tuple[list[dict[str, Any]], tuple[Any, ...], str]:
            messages = [m.template_dict() for m in body.messages]
            return messages, tuple(m.key() for m in body.messages), _tools_key(tools)

        size = sum(len(m.content) if isinstance(m.content, str) else 1 + len(m.content or []) for m in body.messages)
        messages, keys, tools_key = await self.offload(prepare, size=size)
        trace, parent = TokenTrace(), None
        found = session.find_parent("chat", (tools_key, keys)) if session is not None else None
        if found is not None:
            call, choice, covered = found
            trace = call.prompt.copy()
            trace.add_action(choice.token_ids, choice.logprobs, choice.versions)
            parent = (call.index, call.choices.index(choice))
        else:
            covered = 0
        chars = _chars(messages[covered:]) + len(tools_key)
        self._fits(chars, len(trace.token_ids), "messages")
        try:
            if found is not None:
                ids = await self.offload(
                    renderer.continuation_ids, found[1].token_ids, messages[covered:], tools, size=chars
                )
            else:
                ids = await self.offload(renderer.prompt, messages, tools, size=chars)
        except ChatTemplateError as err:
            raise APIError(400, str(err), param="messages") from None
        trace.add_context(ids)
        forced, name = body.forced_tool()
        prefix = ""
        if forced and tools:  # the call's opening is part of the prompt: the model writes the rest
            try:
                prefix = await self.offload(renderer.forced_call_prefix, messages, tools, name, size=chars)
            except ChatTemplateError as err:
                raise APIError(400, str(err), param="tool_choice") from None
            trace.add_context(await self.offload(self._encode, prefix, size=len(prefix)))
        parse = self.tool_parser if tools else None
        return await self._run(body, session, "chat", (tools_key, keys), trace, parent, parse, prefix, sink)

    async def complete(
        self, body: CompletionRequest, session: Session | None, sink: StreamSink | None = None
    ) -> Result:
        """A completion call; with ``sink``, its tokens go there as they are decoded."""
        self._check(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise APIError(400, "give one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "give one prompt per request", param="prompt")
            prompt = prompt[0]
        trace, parent = TokenTrace(), None
        if isinstance(prompt, list):  # token ids: taken as they are
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            vocab = len(self.tokenizer)
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            trace.add_context(ids)
            key: Any = None
        else:
            text = str(prompt)
            key = text
            found = session.find_parent("completion", text) if session is not None else None
            covered = 0
            if found is not None:
                call, choice, covered = found
                trace = call.prompt.copy()
                trace.add_action(choice.token_ids, choice.logprobs, choice.versions)
                parent = (call.index, call.choices.index(choice))
            self._fits(len(text) - covered, len(trace.token_ids), "prompt")
            trace.add_context(await self.offload(self._encode, text[covered:], size=len(text) - covered))
            if not trace.token_ids:
                raise APIError(400, "prompt is empty", param="prompt")
        return await self._run(body, session, "completion", key, trace, parent, None, "", sink)

    async def offload(self, fn: Callable[..., T], *args: Any, size: int | None = None, tokens: int = 0) -> T:
        """``fn(*args)`` in the endpoint's tokenizer thread, so that rendering, tokenising and
        detokenising a big request never runs on the event loop (the driver's); one thread keeps the
        tokenizer's calls apart. Small work (``size`` characters or bytes up to :data:`INLINE_CHARS`
        and ``tokens`` up to :data:`INLINE_TOKENS`: a few milliseconds) runs in place, which saves
        the two thread hops that would cost more than the work."""
        if size is not None and size <= INLINE_CHARS and tokens <= INLINE_TOKENS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args))

    # ------------------------------------------------------------------ internals
    def _check(self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> None:
        if body.model != self.model:
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this endpoint serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        err = body.unsupported()
        if err is not None:
            raise err
        if body.n > self.max_n:
            raise APIError(400, f"n={body.n} exceeds this endpoint's limit of {self.max_n}", param="n")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _fits(self, chars: int, tokens_before: int, param: str) -> None:
        """Refuse, before tokenising, a text too long for the context whatever its tokens: no token
        covers more than ``max_token_chars`` characters, so ``chars`` characters are at least
        ``chars / max_token_chars`` tokens."""
        context = self.max_context or UNKNOWN_CONTEXT
        least = -(-chars // self.max_token_chars)
        if tokens_before + least > context:
            raise APIError(
                400,
                f"{param}: {chars} characters are at least {least} tokens (no token of this model is longer than "
                f"{self.max_token_chars} characters); this model's context is {context} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _sampling(self, body: Any, prompt_len: int) -> SamplingParams:
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        budget = requested or self.sampling.max_new_tokens
        if self.max_context is not None:
            room = self.max_context - prompt_len
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt has {prompt_len} tokens; this model's context is {self.max_context} tokens",
                    param="messages" if hasattr(body, "messages") else "prompt",
                    code="context_length_exceeded",
                )
            if requested is not None and requested > room:
                raise APIError(
                    400,
                    f"max_tokens={requested} + the prompt's {prompt_len} tokens exceed this model's context of "
                    f"{self.max_context} tokens; ask for at most {room}",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            budget = min(budget, room)
        stops = list(self.stop_ids)
        for s in body.stop or []:  # a stop sequence that is one token stops the engine on it
            ids = self._encode(s)
            if len(ids) == 1 and ids[0] not in stops:
                stops.append(ids[0])
        # the request's seed, else none: a run's seed (sampling.seed) seeds each session's calls instead
        update: dict[str, Any] = {
            "max_new_tokens": budget,
            "stop_token_ids": stops,
            "logprobs": True,
            "seed": None,
            "top_logprobs": body.top_wanted() if hasattr(body, "top_wanted") else 0,
        }
        if body.temperature is not None:
            update["temperature"] = body.temperature
        if body.top_p is not None:
            update["top_p"] = body.top_p
        if body.seed is not None:
            update["seed"] = body.seed
        return self.sampling.model_copy(update=update)

    async def _run(
        self,
        body: Any,
        session: Session | None,
        kind: str,
        key: Any,
        trace: TokenTrace,
        parent: tuple[int, int] | None,
        parse: ToolParser | None,
        forced: str,
        sink: StreamSink | None = None,
    ) -> Result:
        prompt = list(trace.token_ids)
        sampling = self._sampling(body, len(prompt))
        if self.in_flight >= self.max_concurrency:
            raise APIError(429, f"{self.in_flight} calls in flight (max_concurrency); retry later", retry_after_s=1)
        try:
            index = session.new_call_index() if session is not None else 0
        except SessionClosed as err:
            raise APIError(404, str(err), code="session_closed") from None
        base = f"{session.id}:{index}" if session is not None else f"anon-{uuid.uuid4().hex}"
        requests = self._requests(body.n, base, prompt, sampling, session, index)
        t0 = time.monotonic()
        version = self.version_fn()
        outs = await self._generate_all(requests, base, session, len(prompt), sink)
        self._check_outputs(outs, session, sampling, kind)
        choices = await self.offload(
            lambda: [self._choice(i, out, body.stop or [], parse, forced) for i, out in enumerate(outs)],
            size=0,
            tokens=sum(len(o.output_token_ids) for o in outs),
        )
        self.counts["calls"] += 1
        self.counts["continued" if parent is not None else "fresh"] += 1
        if session is not None:
            record = CallRecord(index, kind, key, trace, parent)  # type: ignore[arg-type]
            self._record(session, record, choices, outs, t0)
        served = [v for o in outs for v in o.token_versions]
        return Result(choices, len(prompt), max(served, default=version))

    @staticmethod
    def _requests(
        n: int, base: str, prompt: list[int], sampling: SamplingParams, session: Session | None, index: int
    ) -> list[GenerateRequest]:
        """One request per choice; the choices of a seeded call (or of a seeded run's session) get seeds of
        their own, so a seeded run repeats."""
        requests = []
        for i in range(n):
            s = sampling
            if s.seed is not None:
                s = s.model_copy(update={"seed": s.seed + i})
            elif session is not None and session.meta.get("seed") is not None:  # a seeded run repeats
                s = s.model_copy(update={"seed": zlib.crc32(f"{session.meta['seed']}:{index}:{i}".encode())})
            requests.append(GenerateRequest(request_id=f"{base}:{i}", prompt_token_ids=prompt, sampling=s))
        return requests

    async def _generate_all(
        self,
        requests: list[GenerateRequest],
        base: str,
        session: Session | None,
        prompt_tokens: int,
        sink: StreamSink | None,
    ) -> list[GenerateOutput]:
        """The call's outputs from the backend (streamed to ``sink`` when given), counted in flight while
        they run; a failure is the :class:`APIError` the endpoint answers (503: no worker, else 500)."""
        ids = [r.request_id for r in requests]
        tag = session.tag if session is not None else self.default_tag
        self.in_flight += 1
        if session is not None:
            session.in_flight.update(ids)
        try:
            affinity = session.id if session is not None else None
            if sink is not None:
                sink.started(prompt_tokens, len(requests))
                return await asyncio.gather(
                    *(self._streamed(i, r, tag, affinity, sink) for i, r in enumerate(requests))
                )
            return await asyncio.gather(*(self.backend.generate(r, tag, affinity=affinity) for r in requests))
        except ClusterError as err:
            self.counts["failed"] += 1
            if session is not None:  # the episode cannot go on: its env manager raises this
                session.meta["cluster_error"] = err
            raise APIError(503, f"no inference worker can serve the policy now: {err}", retry_after_s=5) from None
        except Exception as err:
            self.counts["failed"] += 1
            root = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
            name = getattr(root, "type_name", type(root).__name__)  # an error from the driver keeps its class's name
            log.warning("generation of %s failed: %s: %s", base, name, root)
            raise APIError(500, f"generation failed: {name}: {root}") from None
        finally:
            self.in_flight -= 1
            if session is not None:
                session.in_flight.difference_update(ids)

    @staticmethod
    def _check_outputs(
        outs: list[GenerateOutput], session: Session | None, sampling: SamplingParams, kind: str
    ) -> None:
        """Refuse a call that was aborted (its session ended: 404) or whose engine did not report the top
        log-probs asked for (400)."""
        if any(o.finish_reason == "abort" for o in outs):
            why = session.ended if session is not None and session.ended else "aborted"
            raise APIError(404, f"the call was aborted: its session ended ({why})", code="session_closed")
        if sampling.top_logprobs and any(len(o.output_top_logprobs) != len(o.output_token_ids) for o in outs):
            param = "top_logprobs" if kind == "chat" else "logprobs"
            raise APIError(
                400,
                f"{param}: the engine serving this policy does not report top log-probabilities (the torch, vllm "
                "and simulated engines do); ask for the sampled token's only",
                param=param,
            )

    def _record(
        self, session: Session, record: CallRecord, choices: list[Choice], outs: list[GenerateOutput], t0: float
    ) -> None:
        """Record the call in its session: each choice's tokens with the versions that produced them."""
        for c, out in zip(choices, outs):
            n = len(c.token_ids)
            record.choices.append(
                ChoiceRecord(
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    versions=list(out.token_versions[:n]),
                    finish_reason=c.finish_reason,
                    key=self._reply_key(record.kind, c),
                    hardware=out.hardware,
                    rank=out.rank,
                )
            )
        record.started, record.seconds = t0, time.monotonic() - t0
        session.record(record)

    async def _streamed(
        self, index: int, request: GenerateRequest, tag: str, affinity: str | None, sink: StreamSink
    ) -> GenerateOutput:
        """One choice generated through the backend's stream, its deltas handed to ``sink``."""
        stream = getattr(self.backend, "generate_stream", None)
        if stream is None:  # a backend that does not stream: the reply comes whole
            return await self.backend.generate(request, tag, affinity=affinity)
        final: GenerateOutput | None = None
        async for item in stream(request, tag, affinity=affinity):
            if isinstance(item, GenerateOutput):
                final = item
            else:
                sink.delta(index, item)
        if final is None:
            raise RuntimeError(f"the stream of {request.request_id} ended without its output")
        return final

    def _choice(
        self, index: int, out: GenerateOutput, stops: list[str], parse: ToolParser | None, forced: str = ""
    ) -> Choice:
        """One reply: cut at its first stop sequence, its tool calls parsed. ``forced``: the opening of a
        forced tool call that ended the prompt (parsed with the reply; content if it does not parse)."""
        ids, lps, top = list(out.output_token_ids), list(out.output_logprobs), list(out.output_top_logprobs)
        reason = out.finish_reason or "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hit = [text.find(s) for s in stops if s in text]
        stop: str | None = None
        if hit:  # the reply ends at the first stop sequence: its tokens up to the one that completes it
            cut = min(hit)
            stop = next(s for s in stops if text.find(s) == cut)
            k = cut_after(self.tokenizer, ids, cut + len(stop))  # linear: no decoding of every prefix
            ids, lps, top = ids[:k], lps[:k], top[:k]
            text, reason = text[:cut], "stop"
        calls: list[tuple[str, ParsedCall]] = []
        if forced:
            text = forced + text
        if parse is not None:
            content, parsed = parse(text)
            if parsed:
                calls = [(call_id(), c) for c in parsed]
                text, reason = content or "", "tool_calls"
        return Choice(index, ids, lps, text, reason, calls, top, stop)

    @staticmethod
    def _reply_key(kind: str, choice: Choice) -> Any:
        """What the harness sends back for this reply: the assistant message (chat) or its text."""
        if kind == "completion":
            return choice.text
        from rollart.serving.protocol import _canonical_json

        calls = tuple((c.name, _canonical_json(c.arguments)) for _, c in choice.tool_calls)
        return ("assistant", choice.text, calls)


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest token string: a byte-level
    token's string has a character per byte, a SentencePiece one a character per character)."""
    try:
        strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:  # a tokenizer without a vocabulary to list: assume long tokens
        return 64
    return max((len(t) for t in strings if isinstance(t, str)), default=1) or 1


def _chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the text in ``messages`` (contents and tool calls' names and arguments)."""
    n = 0
    for m in messages:
        n += len(m.get("content") or "")
        for c in m.get("tool_calls") or []:
            n += len(c["function"]["name"]) + len(str(c["function"].get("arguments") or ""))
    return n


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    import json

    return json.dumps(tools or [], sort_keys=True)
