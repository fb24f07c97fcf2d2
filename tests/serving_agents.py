"""Agent harnesses that pipeline tests name in their configs (``agent: "serving_agents:FUNCTION"``).

``faulty`` is an honest little harness with a fault plan the test sets: one completion call per episode,
rewarded by what the policy wrote (the share of vowels in its reply, so every reward is a real number
a test can recompute from the trained tokens). ``PLAN.kill`` (an async function, set by the test) runs
once, in the first episode that starts after it is set, while that episode's call is in flight: the
test kills the inference worker there. ``PLAN.crash`` episodes after it raise instead of returning (a
harness that lost its connection): their rounds fail and are played again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

VOWELS = set("aeiou")


@dataclass
class Plan:
    kill: Callable[[], Awaitable[None]] | None = None
    crash: int = 0  # episodes to fail after the kill
    returned: dict[str, float] = field(default_factory=dict)  # session id -> the reward the agent returned
    crashed: list[str] = field(default_factory=list)  # session ids of the episodes that raised


PLAN = Plan()


def reward_of(text: str) -> float:
    return sum(ch in VOWELS for ch in text) / max(len(text), 1)


async def faulty(client, task: dict) -> float:
    session = str(client.base_url).rstrip("/").split("/")[-2]
    kill, PLAN.kill = PLAN.kill, None
    call = asyncio.ensure_future(  # the call the worker is killed in is a long one
        client.completions.create(
            model="policy", prompt=f"task {task['seed']}:", max_tokens=48 if kill is None else 300, temperature=1.0
        )
    )
    if kill is not None:
        await kill()
    reply = await call
    if kill is None and PLAN.crash > 0:
        PLAN.crash -= 1
        PLAN.crashed.append(session)
        raise ConnectionError("the harness lost its connection")
    reward = reward_of(reply.choices[0].text)
    PLAN.returned[session] = reward
    return reward


async def where_i_run(client, task: dict) -> float:
    """Writes its process id to ``task["pid_file"]``, then asks the policy to say ``task["say"]`` (the
    scripted engine's directive) and scores 1.0 when it did."""
    import os
    from pathlib import Path

    Path(task["pid_file"]).write_text(str(os.getpid()))
    reply = await client.completions.create(model="policy", prompt=f"SAY:{task['say']}", max_tokens=8)
    return 1.0 if reply.choices[0].text == task["say"] else 0.0


def blocking_where_i_run(client, task: dict) -> float:
    """``where_i_run`` written as a plain function (the blocking client, in a thread)."""
    import os
    from pathlib import Path

    Path(task["pid_file"]).write_text(str(os.getpid()))
    reply = client.completions.create(model="policy", prompt=f"SAY:{task['say']}", max_tokens=8)
    return 1.0 if reply.choices[0].text == task["say"] else 0.0


async def misreads(client, task: dict) -> float:
    """Reads a key its task does not have, after one call: a KeyError in the user's own line."""
    await client.completions.create(model="policy", prompt="SAY:x", max_tokens=4)
    return float(task["answer"])


async def dies(client, task: dict) -> float:
    """Kills its own process after one call (a harness process that crashes mid-episode)."""
    import os
    import signal

    await client.completions.create(model="policy", prompt="SAY:x", max_tokens=4)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0
