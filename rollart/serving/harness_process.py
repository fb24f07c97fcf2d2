"""One agent-harness process (:class:`rollart.serving.harness.HarnessPool`): plays the episodes it is sent.

``python -m rollart.serving.harness_process`` with ``{"index", "socket", "sys_path", "log_level"}``
pickled on standard input. It connects to the driver's Unix socket and, per ``("play", eid, agent,
task, base_url, token, client)``, imports the harness ``agent`` (``MODULE:FUNCTION``, once), gives it an
``openai`` client of the session and answers ``("done", eid, result)``: ``("returned", value)`` or
``("raised", type name, message, frames of the user's code)``. ``("cancel", eid)`` cancels an episode,
``("stop",)`` or the connection closing ends the process.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import sys
from typing import Any

log = logging.getLogger(__name__)


def _portable(value: Any) -> Any:
    """What crosses back to the driver: a number (finite or not: the driver judges it) or None as it is,
    anything else by its ``repr``."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    from rollart.serving.harness import Returned

    return Returned(repr(value))


class HarnessProcess:
    def __init__(self, index: int):
        self.index = index
        self.agents: dict[str, Any] = {}
        self.playing: dict[int, asyncio.Task[None]] = {}
        self.stopped = asyncio.Event()

    async def run(self, path: str) -> None:
        from rollart.serving.bridge import FrameProtocol

        _, self.protocol = await asyncio.get_running_loop().create_unix_connection(
            lambda: FrameProtocol(self._message, self.stopped.set), path
        )
        self.protocol.send(("hello", self.index))
        await self.stopped.wait()
        for task in self.playing.values():
            task.cancel()

    def _message(self, message: tuple[Any, ...]) -> None:
        op = message[0]
        if op == "play":
            eid = message[1]
            task = asyncio.get_running_loop().create_task(self._play(*message[1:]))
            self.playing[eid] = task
            task.add_done_callback(lambda _t, eid=eid: self.playing.pop(eid, None))
        elif op == "cancel":
            task = self.playing.get(message[1])
            if task is not None:
                task.cancel()
        elif op == "stop":
            self.stopped.set()

    async def _play(
        self, eid: int, agent: str, task: dict[str, Any], base_url: str, token: str, settings: dict[str, Any]
    ) -> None:
        from rollart.rollout.failures import user_frames

        client: Any = None
        try:
            fn = self.agents.get(agent)
            if fn is None:
                from rollart.serving.agent import load_agent

                fn = self.agents[agent] = load_agent(agent)
            client = _client(fn, base_url, token, settings)
            if inspect.iscoroutinefunction(fn):
                value = await fn(client, task)
            else:
                value = await asyncio.to_thread(fn, client, task)
            result: tuple[Any, ...] = ("returned", _portable(value))
        except asyncio.CancelledError:
            return
        except Exception as err:
            frames = [(f.filename, f.lineno, f.name, f.line) for f in user_frames(err)]
            result = ("raised", type(err).__name__, str(err), frames)
        finally:
            if client is not None:
                closing = client.close()
                if inspect.isawaitable(closing):
                    await closing
        self.protocol.send(("done", eid, result))


def _client(fn: Any, base_url: str, token: str, settings: dict[str, Any]) -> Any:
    import openai

    from rollart.serving.agent import tls_context

    kwargs = {"base_url": base_url, "api_key": token, **settings}
    if inspect.iscoroutinefunction(fn):
        return openai.AsyncOpenAI(**kwargs, http_client=openai.DefaultAsyncHttpxClient(verify=tls_context()))
    return openai.OpenAI(**kwargs, http_client=openai.DefaultHttpxClient(verify=tls_context()))


def main() -> None:
    from rollart.serving.children import child_runner

    spec = pickle.load(sys.stdin.buffer)
    runner = child_runner(spec["sys_path"], spec["log_level"], f"harness[{spec['index']}]")
    for name in ("httpx", "httpx2"):  # the openai client logs every call at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    with runner:
        runner.run(HarnessProcess(spec["index"]).run(spec["socket"]))


if __name__ == "__main__":
    main()
