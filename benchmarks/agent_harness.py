"""The processes of ``rollart bench agent-endpoint``: an agent harness (the official ``openai`` client) and a
stub server that answers every call at once.

``python -m rollart.benchmarks.agent_harness harness``: reads one JSON job per line on standard input
(``{"urls": [session base URLs], "token", "turns", "max_tokens", "question"}``), plays each session's
``turns`` chat calls in a row (each sends the history so far) with one ``AsyncOpenAI`` client, all
sessions at once, and writes one JSON line: every call's latency, and this process's CPU seconds.

``python -m rollart.benchmarks.agent_harness stub``: an HTTP/1.1 server on 127.0.0.1 answering every
request with the same chat completion (keep-alive); prints its port. What a harness reaches against it
is the client's own limit on the machine.

:func:`episode` is the harness the bench's ``agent`` env modes play (in the driver, or in harness
processes).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

REPLY = {
    "id": "chatcmpl-stub",
    "object": "chat.completion",
    "created": 0,
    "model": "policy",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Ann had twelve apples and got seven more: nineteen."},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56},
}


async def play(job: dict[str, Any]) -> dict[str, Any]:
    import httpx
    import openai

    n = max(1, len(job["urls"]))
    client = openai.AsyncOpenAI(
        base_url=job["urls"][0] if job["urls"] else "http://127.0.0.1:1/v1",
        api_key=job["token"],
        max_retries=0,
        timeout=300,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)),
    )
    latencies: list[float] = []
    failed: list[str] = []

    async def session(url: str) -> None:
        c = client.with_options(base_url=url)
        messages: list[Any] = [{"role": "user", "content": job["question"]}]
        for _ in range(job["turns"]):
            t0 = time.perf_counter()
            try:
                r = await c.chat.completions.create(model="policy", messages=messages, max_tokens=job["max_tokens"])
            except Exception as err:
                failed.append(f"{type(err).__name__}: {err}")
                return
            latencies.append(time.perf_counter() - t0)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "ok"},
            ]

    c0 = time.process_time()
    await asyncio.gather(*(session(u) for u in job["urls"]))
    cpu = time.process_time() - c0
    await client.close()
    return {"latencies": latencies, "cpu_s": cpu, "failed": failed[:5], "failures": len(failed)}


async def episode(client: Any, task: dict[str, Any]) -> float:
    """An ``agent`` env's harness for the bench: ``task["turns"]`` chat calls in a row, reward 1."""
    messages: list[Any] = [{"role": "user", "content": task["question"]}]
    for _ in range(task["turns"]):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=task["max_tokens"])
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "ok"}]
    return 1.0


def harness() -> None:
    import logging

    import httpx  # noqa: F401  (imported before the first job: not part of what is measured)
    import openai  # noqa: F401

    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(asyncio.run(play(json.loads(line)))), flush=True)


def stub() -> None:
    body = json.dumps(REPLY).encode()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    class Stub(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                length = 0
                for line in self.buf[:end].split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length :]
                self.transport.write(answer)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Stub, "127.0.0.1", 0)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin

    asyncio.run(serve())


if __name__ == "__main__":
    {"harness": harness, "stub": stub}[sys.argv[1]]()
