"""A tokenizer whose BPE merges digits and words, and a scripted engine, for the endpoint tests.

``ScriptedEngine`` (engine kind ``serving_fixtures:ScriptedEngine``) is an engine whose replies the
test writes into the conversation: it decodes the prompt, takes the directive after the last ``SAY:``
(up to the end of that message) and generates it one token per step:

- ``SAY:text`` — the ids of ``text`` as the tokenizer encodes it, then ``<|im_end|>``;
- ``SPLIT:text`` — every character of ``text`` as its own token (what a model may sample, and what
  encoding the text again merges into other ids), then ``<|im_end|>``;
- ``RAMBLE`` — ``a`` tokens until ``max_new_tokens`` (finish ``length``);
- ``GATE:path`` — ``a`` tokens until ``max_new_tokens``, but after the first one the request waits until
  the file ``path`` exists (the test creates it): a reply that cannot end before the test acts.

It streams as the real engines do (a delta per step for a request that asks). Its log-probs are a fixed function of the token and its position, so a test can check that the
trained trajectory carries the engine's own numbers. Everything else (the inference worker, the
LLMProxy, the endpoint, the tokenizer and its template) is the real thing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rollart.engines.base import DeltaTracker, EngineRequest, InferenceEngine, RequestOutput, TokenDelta

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


# the one function tool the endpoint tests offer (an arithmetic calculator)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def build_merging_tokenizer(folder: Path) -> Path:
    """A ChatML BPE tokenizer (with the tool template) whose merges join digits and words: ``"12"``,
    ``"calc"`` and ``"expression"`` are single tokens, so text generated character by character
    re-tokenises into other ids. Saved as a Hugging Face folder (with a tiny Qwen2 config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rollart.serving.render import CHATML_TOOLS_TEMPLATE

    corpus = []
    for a in range(60):
        for b in range(0, 60, 7):
            corpus.append(
                f'user\nWhat is {a} plus {b}?\n<tool_call>{{"name": "calc", "arguments": {{"expression": "{a}+{b}"}}}}'
                f"</tool_call>\ntool\n{a + b}\nassistant\nThe answer is {a + b}. ok done hello world\n"
            )
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>")
    fast.chat_template = CHATML_TOOLS_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    (folder / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 2048}')
    return folder


def script_logprob(token: int, position: int) -> float:
    return -((token % 7) + 1) / 10.0 - position / 1000.0


class ScriptedEngine(InferenceEngine):
    def __init__(self, model: str, step_s: float = 0.0):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.step_s = step_s
        self._running: dict[str, tuple[EngineRequest, RequestOutput, list[int]]] = {}
        self._streams = DeltaTracker()  # streams like the real engines: a delta per step
        self._gates: dict[str, str] = {}  # request id -> the file its reply waits for after one token

    def _plan(self, request: EngineRequest) -> list[int]:
        text = self.tok.decode(request.prompt_token_ids, skip_special_tokens=False)
        cut = text.rfind("SAY:")
        if cut < 0:
            return [*self.tok.encode("ok", add_special_tokens=False), self.end]
        directive = text[cut + 4 :].split("<|im_end|>")[0]
        if directive.startswith("SPLIT:"):
            ids = [i for ch in directive[6:] for i in self.tok.encode(ch, add_special_tokens=False)]
            return [*ids, self.end]
        if directive.startswith(("RAMBLE", "GATE:")):
            return self.tok.encode("a", add_special_tokens=False) * 100_000
        return [*self.tok.encode(directive, add_special_tokens=False), self.end]

    def _gate(self, request: EngineRequest) -> str | None:
        text = self.tok.decode(request.prompt_token_ids, skip_special_tokens=False)
        cut = text.rfind("SAY:GATE:")
        return text[cut + 9 :].split("<|im_end|>")[0].strip() if cut >= 0 else None

    def add_request(self, request: EngineRequest) -> None:
        out = RequestOutput(request.request_id, list(request.prompt_token_ids), weight_version=self.weight_version)
        self._running[request.request_id] = (request, out, self._plan(request))
        if (gate := self._gate(request)) is not None:
            self._gates[request.request_id] = gate
        self._streams.watch(request)

    def take_deltas(self) -> list[TokenDelta]:
        return self._streams.deltas(lambda rid: item[1] if (item := self._running.get(rid)) else None)

    def abort(self, request_id: str) -> RequestOutput | None:
        item = self._running.pop(request_id, None)
        self._gates.pop(request_id, None)
        if item is None:
            return None
        item[1].finished, item[1].finish_reason = True, "abort"
        return item[1]

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        done = []
        waiting = 0
        for rid, (req, out, plan) in list(self._running.items()):
            k = len(out.output_token_ids)
            gate = self._gates.get(rid)
            if gate is not None and k >= 1:
                if not os.path.exists(gate):
                    waiting += 1
                    continue
                del self._gates[rid]
            tok = plan[k]
            out.output_token_ids.append(tok)
            out.output_logprobs.append(script_logprob(tok, len(req.prompt_token_ids) + k))
            if tok in req.params.stop_token_ids or k + 1 >= len(plan):
                out.finished, out.finish_reason = True, "stop"
            elif k + 1 >= req.params.max_new_tokens:
                out.finished, out.finish_reason = True, "length"
            if out.finished:
                del self._running[rid]
                done.append(out)
        if waiting and waiting == len(self._running):
            time.sleep(0.005)  # every request waits for its gate file: poll it, not the CPU
        return done

    def update_weights(self, weights: Any, version: int) -> None:
        self.weight_version = version


class ServedPolicy:
    """An LLMProxy over an inference Cluster and the endpoint in front of it, on an event loop of their
    own (a thread), so tests call it with blocking clients (``openai.OpenAI``, ``httpx``) as a harness
    would. ``run(coro)`` runs a coroutine on that loop (sessions are opened there). The endpoint runs in
    that loop, or in server processes when ``serving`` names ``processes``."""

    def __init__(
        self,
        cluster: Any,
        model_path: str,
        *,
        serving: dict[str, Any] | None = None,
        restart: Any = None,
        batch_requests: bool = False,
    ):
        import asyncio
        import threading

        from rollart.rollout.llm_proxy import LLMProxy
        from rollart.serving.config import ServingConfig

        self.cluster = cluster
        self.model_path = model_path
        self.serving = dict(serving or {})
        self.config = ServingConfig(**self.serving)
        self.proxy = LLMProxy(cluster, restart=restart, batch_requests=batch_requests)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.endpoint = self.run(self._start())

    async def _start(self) -> Any:
        from transformers import AutoTokenizer

        from rollart.engines.base import SamplingParams
        from rollart.serving.endpoint import PolicyEndpoint, build_service, model_context
        from rollart.serving.service import ProxyBackend

        tok = AutoTokenizer.from_pretrained(self.model_path)
        settings: dict[str, Any] = {
            "model": "policy",
            "sampling": SamplingParams(max_new_tokens=64),
            "max_context": model_context(self.model_path),
            "version_fn": lambda: self.proxy.version,
        }
        if self.config.processes and "processes" in self.serving:
            from rollart.serving.processes import EndpointProcesses

            processes = EndpointProcesses(
                ProxyBackend(self.proxy), tok, self.config, token="test-token-0123456789", **settings
            )
            await processes.start()
            return processes
        service = build_service(ProxyBackend(self.proxy), tok, self.config, **settings)
        endpoint = PolicyEndpoint(service, self.config, token="test-token-0123456789")
        await endpoint.start()
        return endpoint

    def run(self, coro: Any, timeout: float = 120) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_session(self, tag: str = "agent", **kwargs: Any) -> Any:
        async def make() -> Any:
            return await self.endpoint.open_session(tag, **kwargs)

        return self.run(make())

    def recorded(self, session: Any) -> Any:
        """Close ``session``: the :class:`~rollart.serving.sessions.Session` its endpoint recorded."""
        return self.run(self.endpoint.close_session(session, "the test is over"))

    def client(self, session: Any = None, **kwargs: Any) -> Any:
        import openai

        base = self.endpoint.session_url(session) if session is not None else f"{self.endpoint.url}/v1"
        return openai.OpenAI(base_url=base, api_key=self.endpoint.token, **kwargs)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.endpoint.token}"}

    def close(self) -> None:
        self.run(self.endpoint.stop())
        self.proxy.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
