"""The OpenAI-compatible endpoint against a direct LLMProxy call: requests/s and p50/p99 latency added.

``rollart bench agent-endpoint [--concurrency 8,64,256] [--turns 4] [--max-tokens 16]``. At each
concurrency ``c``, ``c`` sessions each make ``--turns`` calls in a row (a multi-turn episode: every
call sends the history so far), first as direct ``LLMProxy.generate`` calls with the same token
counts, then through the endpoint with the ``openai`` client (``AsyncOpenAI``, in the same process
and event loop, as the ``agent`` env kind runs it). The engine is the simulated one on one inference
worker (``--decode-s`` per step), so the difference is what the HTTP server, the client, rendering,
tokenising, session recording and the response cost; the driver process's CPU time per call is
reported beside the wall-clock figures (on a busy machine it says what a free core would sustain).
Writes ``agent_endpoint.json`` and a chart.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart.benchmarks.common import start_inference, write_report

log = logging.getLogger("rollart.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="8,64,256", help="concurrent sessions, comma-separated")
    p.add_argument("--turns", type=int, default=4, help="calls per session (each sends the history so far)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per call")
    p.add_argument("--decode-s", type=float, default=0.002, help="simulated engine: seconds per decode step")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and the chart")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    from rollart.engines.base import SamplingParams
    from rollart.models.tiny import build_tokenizer, default_corpus
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.rollout.types import GenerateRequest
    from rollart.serving.config import ServingConfig
    from rollart.serving.endpoint import PolicyEndpoint, build_service
    from rollart.serving.service import ProxyBackend

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    for name in ("httpx", "httpx2"):  # the openai client logs every call at INFO: not part of what is measured
        logging.getLogger(name).setLevel(logging.WARNING)
    tok = build_tokenizer(default_corpus(400), Path(tempfile.mkdtemp(prefix="rollart-bench-tok-")), 320, chat=True)
    rm, cluster = start_inference(
        {"rollout": {"hardware": "H20", "devices": 1}},
        {"*": ["H20"]},
        {"decode_base_s": args.decode_s, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0, "vocab_size": 60},
    )
    proxy = LLMProxy(cluster, batch_requests=True)
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0)
    question = "Ann has 12 apples and gets 7 more. How many now?"

    async def bench() -> list[dict[str, Any]]:
        config = ServingConfig(max_concurrency=4096, max_sessions=8192)
        service = build_service(ProxyBackend(proxy), tok, config, model="policy", sampling=sampling)
        endpoint = PolicyEndpoint(service, config)
        await endpoint.start()
        first = service.renderer.prompt([{"role": "user", "content": question}]) if service.renderer else []
        more = tok.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)

        async def direct_session(i: int, lat: list[float]) -> None:
            prompt = list(first)
            for turn in range(args.turns):
                t0 = time.perf_counter()
                out = await proxy.generate(
                    GenerateRequest(
                        request_id=f"d{i}:{turn}:{time.perf_counter_ns()}", prompt_token_ids=prompt, sampling=sampling
                    ),
                    "agent",
                )
                lat.append(time.perf_counter() - t0)
                prompt = prompt + out.output_token_ids + more

        async def endpoint_session(client: openai.AsyncOpenAI, lat: list[float]) -> None:
            session = endpoint.open_session("agent")
            messages: list[Any] = [{"role": "user", "content": question}]
            c = client.with_options(base_url=endpoint.session_url(session))
            for _ in range(args.turns):
                t0 = time.perf_counter()
                r = await c.chat.completions.create(model="policy", messages=messages, max_tokens=args.max_tokens)
                lat.append(time.perf_counter() - t0)
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "ok"},
                ]
            await endpoint.close_session(session, "done")

        rows = []
        try:
            for c in levels:
                import httpx

                client = openai.AsyncOpenAI(
                    base_url=f"{endpoint.url}/v1",
                    api_key=endpoint.token,
                    max_retries=0,
                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=c, max_keepalive_connections=c)),
                )
                await asyncio.gather(*(endpoint_session(client, []) for _ in range(min(c, 8))))  # warm the connections
                direct: list[float] = []
                t0, c0 = time.perf_counter(), time.process_time()
                await asyncio.gather(*(direct_session(i, direct) for i in range(c)))
                direct_s, direct_cpu = time.perf_counter() - t0, time.process_time() - c0
                served: list[float] = []
                t0, c0 = time.perf_counter(), time.process_time()
                await asyncio.gather(*(endpoint_session(client, served) for _ in range(c)))
                served_s, served_cpu = time.perf_counter() - t0, time.process_time() - c0
                await client.close()
                row = {
                    "concurrency": c,
                    "calls": len(served),
                    "direct_rps": len(direct) / direct_s,
                    "endpoint_rps": len(served) / served_s,
                    "direct_p50_ms": 1e3 * statistics.median(direct),
                    "endpoint_p50_ms": 1e3 * statistics.median(served),
                    "direct_p99_ms": 1e3 * _pct(direct, 0.99),
                    "endpoint_p99_ms": 1e3 * _pct(served, 0.99),
                }
                # the driver process's CPU per call (client, server, proxy): what the endpoint costs on a free core
                row["direct_cpu_ms_per_call"] = 1e3 * direct_cpu / len(direct)
                row["endpoint_cpu_ms_per_call"] = 1e3 * served_cpu / len(served)
                row["added_p50_ms"] = row["endpoint_p50_ms"] - row["direct_p50_ms"]
                row["added_p99_ms"] = row["endpoint_p99_ms"] - row["direct_p99_ms"]
                log.info("agent-endpoint %s", row)
                rows.append(row)
        finally:
            await endpoint.stop()
        return rows

    try:
        rows = asyncio.run(bench())
    finally:
        proxy.close()
        cluster.shutdown()
        rm.shutdown()
    result: dict[str, Any] = {
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "decode_s": args.decode_s,
        "rows": rows,
    }
    bars = {f"+p50 @{r['concurrency']}": r["added_p50_ms"] for r in rows}
    return write_report(args.out, "agent_endpoint", result, bars, "ms added per call", "endpoint vs direct LLMProxy")
