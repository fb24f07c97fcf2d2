"""Helpers for tests on a real Ray cluster."""

from __future__ import annotations

import time

import ray


def kill_and_wait(handle, deadline_s: float = 60.0) -> None:
    """ray.kill is asynchronous: return once the actor no longer answers."""
    ray.kill(handle, no_restart=True)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            ray.get(handle._rollart_ping.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
    raise AssertionError("actor still alive after ray.kill")
