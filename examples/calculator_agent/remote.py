"""The same agent run in another process — on another host, in a pod — reaching the endpoint by URL.

``remote:solve_elsewhere`` is an ``agent`` function for the config (``agent: "remote:solve_elsewhere"``):
it starts ``python remote.py`` behind the command prefix in ``$CALCULATOR_AGENT_PREFIX`` (e.g.
``ssh worker-7`` or ``ip netns exec NS``), hands it the session's base URL, the job's bearer token and
the task on standard input (never on the command line), and returns the reward the child prints. The
child runs ``agent.solve`` with its own ``openai`` client. With ``serving.host`` an address other hosts
reach (``0.0.0.0`` or this node's IP), ``client.base_url`` is that address.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent


async def solve_elsewhere(client: openai.AsyncOpenAI, task: dict) -> float:
    prefix = shlex.split(os.environ.get("CALCULATOR_AGENT_PREFIX", ""))
    proc = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        str(HERE / "remote.py"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    job = {"base_url": str(client.base_url), "api_key": client.api_key, "task": task}
    try:
        out, err = await proc.communicate(json.dumps(job).encode())
    except asyncio.CancelledError:  # the episode was aborted: so is the child
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"the agent process exited with {proc.returncode}: {err.decode()[-2000:]}")
    return float(json.loads(out.decode().strip().splitlines()[-1])["reward"])


def main() -> None:
    sys.path.insert(0, str(HERE))
    from agent import solve

    job = json.loads(sys.stdin.read())

    async def play() -> float:
        async with openai.AsyncOpenAI(base_url=job["base_url"], api_key=job["api_key"]) as client:
            return await solve(client, job["task"])

    print(json.dumps({"reward": asyncio.run(play())}), flush=True)


if __name__ == "__main__":
    main()
