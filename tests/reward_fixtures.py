"""Reward functions used by the reward-service tests, and a uvicorn server in a thread on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from typing import Any

import uvicorn

CALLS = {"count": 0}
GATE = threading.Event()


def length_score(trajectory: dict[str, Any]) -> float:
    CALLS["count"] += 1
    return len(trajectory["response"]) / 10.0


def gated(trajectory: dict[str, Any]) -> float:
    GATE.wait(timeout=60)
    return 1.0


def broken(trajectory: dict[str, Any]) -> float:
    raise ZeroDivisionError("the checker divided by zero")


def process_id(trajectory: dict[str, Any]) -> float:
    """The serving process's id as the score: tells which server process answered."""
    return float(os.getpid())


def start_reward_server(
    args: list[str], port: int, env: dict[str, str] | None = None, deadline_s: float = 60.0
) -> subprocess.Popen:
    """``rollart serve rewards ARGS --port PORT`` in its own session; returns once ``/healthz`` answers."""
    import sys
    import time

    import httpx

    cmd = [sys.executable, "-m", "rollart.cli", "serve", "rewards", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        try:  # paces the readiness poll and notices a server that exited
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(proc.stderr.read().decode())
    proc.kill()
    raise RuntimeError(f"reward server on port {port} did not start within {deadline_s} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    def __init__(self, app: Any):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        import time

        deadline = time.monotonic() + 30
        while not self.server.started:  # uvicorn sets this once it listens
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            self.thread.join(timeout=0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
