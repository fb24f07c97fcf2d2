"""An HTTP client in a process of its own, for tests that measure a server's responsiveness: the
test's own Python threads would otherwise compete with the server for the interpreter's lock.

``python http_client.py probe URL`` asks ``URL`` (``/healthz``) every 5 ms until its standard input
closes; it prints ``up`` after the first answer, and at the end ``{"max_s": slowest answer, "n":
probes}``.

``python http_client.py request URL TOKEN`` reads a JSON body from standard input, POSTs it to
``URL`` with the bearer token and prints ``{"status", "content", "events", "finish", "logprobs",
"error"}``: for ``"stream": true`` the streamed pieces joined, the number of chunk events and the last
finish reason; else the first choice's content and the number of its logprob entries.
"""

from __future__ import annotations

import json
import select
import sys
import time

import httpx


def probe(url: str) -> None:
    slowest, n = 0.0, 0
    with httpx.Client(timeout=60) as http:
        while True:
            t0 = time.perf_counter()
            status = http.get(url).status_code
            slowest, n = max(slowest, time.perf_counter() - t0), n + 1
            if n == 1:
                print("up", flush=True)  # the test starts its request once probes run
            if status != 200:
                print(json.dumps({"error": f"/healthz answered {status}"}), flush=True)
                return
            ready, _, _ = select.select([sys.stdin], [], [], 0.005)  # paces the probes; EOF ends them
            if ready and not sys.stdin.read(1):
                break
    print(json.dumps({"max_s": slowest, "n": n}), flush=True)


def request(url: str, token: str) -> None:
    body = json.loads(sys.stdin.read())
    headers = {"Authorization": f"Bearer {token}"}
    out: dict = {"content": "", "events": 0, "finish": None, "logprobs": 0, "error": None}
    with httpx.Client(timeout=300, headers=headers) as http:
        if body.get("stream"):
            with http.stream("POST", url, json=body) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        out["events"] += 1
                        for c in event["choices"]:
                            out["content"] += (c.get("delta") or {}).get("content") or c.get("text") or ""
                            out["finish"] = c.get("finish_reason") or out["finish"]
        else:
            r = http.post(url, json=body)
            out["status"] = r.status_code
            data = r.json()
            if r.status_code == 200:
                choice = data["choices"][0]
                out["content"] = choice["message"]["content"] if "message" in choice else choice["text"]
                out["finish"] = choice["finish_reason"]
                out["logprobs"] = len((choice.get("logprobs") or {}).get("content") or [])
            else:
                out["error"] = data.get("error")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe(sys.argv[2])
    else:
        request(sys.argv[2], sys.argv[3])
