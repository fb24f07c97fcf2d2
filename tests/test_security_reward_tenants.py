"""Two tenants of one reward service, one of them hostile: a flood of slow trajectories must leave the
other's cheap ones their worker (fair slots counting trajectories, not requests)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from security_fixtures import wait_until

from rollart.reward.fair import FairSlots
from rollart.reward.http_server import ThreadedServer
from rollart.reward.server import ServerSettings, build_app

pytestmark = pytest.mark.timeout(180)
TOKEN_A, TOKEN_B = "reward-tenant-a-0123456789", "reward-tenant-b-0123456789"
GATE = threading.Event()


def slow_unless_quick(trajectory: dict[str, Any]) -> float:
    """A reward function whose trajectories compute until the test opens the gate, except ``quick`` ones."""
    if trajectory["response"] != "quick":
        GATE.wait(timeout=120)
    return 1.0


async def test_fair_slots_keep_one_free_for_others_and_give_freed_ones_to_the_tenant_holding_fewest() -> None:
    slots = FairSlots(4)  # per tenant: 3
    for _ in range(3):
        await slots.acquire("a")
    flood = [asyncio.ensure_future(slots.acquire("a")) for _ in range(5)]
    await asyncio.sleep(0)  # the five queue (a loop turn, not a wait for time)
    assert slots.held("a") == 3 and slots.waiting() == 5 and slots.free == 1  # a's cap keeps one free
    await slots.acquire("b")  # at once
    b_more = [asyncio.ensure_future(slots.acquire("b")) for _ in range(2)]
    await asyncio.sleep(0)
    slots.release("a")  # b holds 1 < a's 2: the slot goes to b, though a asked first
    await asyncio.sleep(0)
    assert slots.held("b") == 2 and slots.held("a") == 2 and b_more[0].done() and not b_more[1].done()
    slots.release("b")  # a and b hold 2 and 1 after it: b again
    await asyncio.sleep(0)
    assert b_more[1].done() and slots.held("b") == 2
    flood[0].cancel()  # a waiter that gives up leaves the queue
    await asyncio.gather(flood[0], return_exceptions=True)
    assert slots.waiting() == 4
    for _ in range(2):
        slots.release("b")
    await asyncio.sleep(0)
    assert slots.held("a") == 3 and slots.held("b") == 0 and slots.free == 1  # a back to its cap, one free
    for t in flood[1:]:
        t.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


def test_a_tenants_flood_of_slow_trajectories_leaves_a_thread_for_anothers_cheap_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANT_A", TOKEN_A)
    monkeypatch.setenv("TENANT_B", TOKEN_B)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a: {token_env: TENANT_A}\n  b: {token_env: TENANT_B}\n")
    GATE.clear()
    app = build_app({"check": slow_unless_quick}, ServerSettings(tenants_file=str(tenants), timeout_s=120))
    with ThreadedServer(app) as srv:
        url = srv.url + "/rewards/check"
        flood: dict[str, Any] = {}

        def send_flood() -> None:  # one request of 16 slow trajectories (8 threads serve the function)
            body = {"trajectories": [{"response": "slow"}] * 16}
            flood["r"] = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN_A}"}, timeout=150)

        sender = threading.Thread(target=send_flood)
        sender.start()
        try:
            health = lambda: httpx.get(srv.url + "/healthz").json()
            wait_until(lambda: health()["running"]["check"] == 7, 30, "tenant a computes 7 trajectories")
            assert health()["queued"]["check"] == 9  # its other 9 wait: one thread is left for the others
            cheap = httpx.post(url, json={"trajectories": [{"response": "quick"}] * 2},
                               headers={"Authorization": f"Bearer {TOKEN_B}"}, timeout=30)  # fmt: skip
            assert cheap.status_code == 200 and cheap.json()["result"] == [1.0, 1.0]  # right, not 0, not late
            assert "r" not in flood and health()["running"]["check"] == 7  # answered while a's all still ran
        finally:
            GATE.set()
            sender.join(150)
        assert flood["r"].status_code == 200 and flood["r"].json()["result"] == [1.0] * 16
