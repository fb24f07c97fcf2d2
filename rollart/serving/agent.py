"""The ``agent`` env kind: an agent harness written against the ``openai`` SDK, trained through a session.

``envs: [{agent: MODULE:FUNCTION, tasks: MODULE:FUNCTION | FILE.jsonl, ...}]``. Per episode an
:class:`AgentEnvManager` opens a session on the job's endpoint, makes the episode's task (``tasks``
with the round's seed: a function ``make_task(seed, **kwargs) -> dict`` or a row of a JSONL file),
and calls the agent with an ``openai`` client whose ``base_url`` is the session's URL and whose
``api_key`` is the job's bearer token::

    async def agent(client: openai.AsyncOpenAI, task: dict) -> float | None: ...

(a plain ``def`` gets a blocking ``openai.OpenAI`` and runs in a thread). The harness may hand
``client.base_url`` and ``client.api_key`` to another process, host or pod; every call it makes there
is recorded the same way. The episode's reward is, in this order: what the function returns, a
``POST /sessions/{id}/reward``, the config's reward (``reward_fn``). With none of them the
episode is ``failed`` (and its round replayed): it is never scored 0. The trajectory is built from the
session's recorded tokens (:meth:`~rollart.serving.sessions.Session.trajectory`).

It runs under the scheduler like any EnvManager: groups, redundancy, the α bound and aborts
(:meth:`AgentEnvManager.abort` ends the session: its calls in flight are aborted and the agent is
cancelled), partial rollouts across weight updates (the LLMProxy continues a preempted call; every
token keeps the version that produced it), and faults: a harness that raises or times out fails the
episode; an inference worker that dies mid-call is the LLMProxy's (the call is sent again from its
stored state); no worker left raises ``ClusterError`` out of :meth:`run`, as for other envs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart.cluster.errors import ClusterError
from rollart.rollout.failures import FailureLog
from rollart.rollout.types import Trajectory
from rollart.serving.endpoint import AgentEndpoint
from rollart.serving.harness import HarnessPool
from rollart.serving.sessions import Session

log = logging.getLogger(__name__)

RewardFn = Callable[[Trajectory], Awaitable[float] | float]


class AgentSpec(BaseModel):
    """One agent task of the mix (an ``envs`` entry with ``agent:``)."""

    model_config = ConfigDict(extra="forbid")

    agent: str  # MODULE:FUNCTION, the harness
    tasks: str | None = None  # MODULE:FUNCTION (seed, **kwargs) -> dict, or a .jsonl file; None: {"seed": seed}
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the tasks function
    timeout_s: float = Field(default=600.0, gt=0)  # one episode, all calls included
    client_max_retries: int = Field(default=2, ge=0)  # the openai client's own retries (429, 5xx)
    client_timeout_s: float = Field(default=300.0, gt=0)  # one call


def has_chat_template(model: str | None, tiny_model: dict[str, Any]) -> bool | None:
    """Whether the policy's tokenizer has a chat template: the built-in tiny model (``model`` None) has one
    with ``tiny_model: {chat: true}``; a model folder when its tokenizer files carry one. None: not known
    without loading it (not a folder)."""
    if model is None:
        return bool(tiny_model.get("chat"))
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (OSError, ValueError):
        return None


def chat_without_template(
    agents: list[str], model: str | None, tiny_model: dict[str, Any], template: str
) -> str | None:
    """A problem when an agent harness calls the chat API but the policy it talks to has no chat template
    (every such call would be answered 400): found before anything starts, from the harness's source."""
    if not agents or template != "auto" or has_chat_template(model, tiny_model) is not False:
        return None
    for spec in agents:
        try:
            source = inspect.getsource(inspect.getmodule(load_agent(spec)))  # type: ignore[arg-type]
        except Exception:  # the entry's own check reports an agent that does not load
            continue
        if ".chat.completions" in source:
            which = "the built-in tiny model" if model is None else f"the model {model}"
            fix = "tiny_model: {chat: true}, or " if model is None else ""
            return (
                f"envs: the agent {spec!r} calls chat.completions but {which} has no chat template, so every "
                f"chat call would be answered 400; set {fix}serving.chat_template (a Jinja file or inline Jinja), "
                "or call client.completions"
            )
    return None


def load_agent(spec: str, search_path: list[str] | tuple[str, ...] = ()) -> Callable[..., Any]:
    """The harness ``MODULE:FUNCTION``, checked: a function of ``(client, task)``, and the ``openai``
    package it is given a client of is installed."""
    import importlib.util

    from rollart.plugins import import_object

    if importlib.util.find_spec("openai") is None:
        raise ValueError("agent: an agent harness is given an openai client: pip install 'rollart[agent]' (or openai)")

    fn = import_object(spec, "agent", search_path)
    if not callable(fn):
        raise ValueError(f"agent: {spec!r} is not a function")
    params = [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
    if len(params) != 2:
        raise ValueError(
            f"agent: {spec!r} must take (client, task), it takes {[p.name for p in params]}; "
            "write async def agent(client: openai.AsyncOpenAI, task: dict) -> float | None"
        )
    return fn  # type: ignore[no-any-return]


def load_tasks(
    spec: str | None, kwargs: dict[str, Any], search_path: list[str] | tuple[str, ...] = ()
) -> Callable[[int], dict[str, Any]]:
    """``seed -> task``: a function's, a JSONL file's row ``seed % rows``, or ``{"seed": seed}``."""
    if spec is None:
        return lambda seed: {"seed": seed}
    if spec.endswith(".jsonl"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"tasks: {spec!r} is not a file")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"tasks: {spec!r} must hold one JSON object per line")
        return lambda seed: dict(rows[seed % len(rows)])
    from rollart.plugins import import_object

    fn = import_object(spec, "tasks", search_path)
    if not callable(fn):
        raise ValueError(f"tasks: {spec!r} is not a function")
    return lambda seed: dict(fn(seed, **kwargs))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for the clients of every episode. An ``openai`` client builds its own at
    construction, loading the CA bundle: about 20 ms of the driver's CPU per episode, more than the
    episode's calls cost the endpoint. (The session URLs are plain HTTP; the context is never used for
    them, only built.)"""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


class AgentEnvManager:
    """Runs one agent harness per episode through a session of ``endpoint`` (scheduler interface:
    ``tag``, :meth:`run`, :meth:`abort`)."""

    def __init__(
        self,
        spec: AgentSpec,
        endpoint: AgentEndpoint,
        *,
        tag: str = "agent",
        agent: Callable[..., Any] | None = None,
        tasks: Callable[[int], dict[str, Any]] | None = None,
        reward_fn: RewardFn | None = None,
        version_fn: Callable[[], int] = lambda: 0,
        seed: int | None = None,
        harness: HarnessPool | None = None,
    ):
        self.spec = spec
        self.endpoint = endpoint
        self.tag = tag
        self.agent = agent or load_agent(spec.agent)
        self.tasks = tasks or load_tasks(spec.tasks, spec.kwargs)
        self.reward_fn = reward_fn
        self.version_fn = version_fn
        self.seed = seed
        self.harness = harness  # the processes episodes play in (None: this event loop)
        self.session: Any = None
        self._agent_task: asyncio.Future | None = None
        self._aborting = False
        self._reward_error: BaseException | None = None
        self.failures = FailureLog()  # the rollout scheduler gives its managers one log, shared

    def _client(self, session: Any) -> Any:
        import openai

        kwargs = {  # other hosts reach the endpoint's public URL when it listens beyond the loopback
            "base_url": self.endpoint.session_url(session, public=self.endpoint.listens_publicly),
            "api_key": self.endpoint.token,
            "max_retries": self.spec.client_max_retries,
            "timeout": self.spec.client_timeout_s,
        }
        if inspect.iscoroutinefunction(self.agent):
            return openai.AsyncOpenAI(**kwargs, http_client=openai.DefaultAsyncHttpxClient(verify=tls_context()))
        return openai.OpenAI(**kwargs, http_client=openai.DefaultHttpxClient(verify=tls_context()))

    async def run(
        self, seed: int | None = None, group_id: str = "", traj_id: str | None = None, *, trace: Any = None
    ) -> Trajectory:
        """One episode. Harness and reward faults come back as the trajectory's status; only a rollout
        that cannot go on (no inference worker) raises. ``trace`` is taken for the EnvManager's signature:
        an agent's own calls through the policy endpoint are not traced in this version (its trajectory's
        scheduler events are)."""
        traj_id = traj_id or uuid.uuid4().hex
        start_version = self.version_fn()
        self._aborting = False
        t0 = time.monotonic()
        failed = Trajectory(traj_id=traj_id, group_id=group_id, tag=self.tag, start_version=start_version)
        try:
            task = self.tasks(seed if seed is not None else 0)
        except Exception as err:
            failed.status, failed.error = "failed", f"tasks: {type(err).__name__}: {err}"
            self.failures.record("tasks", f"{type(err).__name__}: {err}", err, tag=self.tag)
            return failed
        handle = await self.endpoint.open_session(
            self.tag, meta={"seed": None if self.seed is None else f"{self.seed}:{traj_id}"}
        )
        self.session = handle
        session, returned, error, raised = await self._play(handle, task)
        if session is None:  # its endpoint process went away with it
            session = Session(self.tag)
            error = error or "the episode's session is gone (its endpoint process went away, or it expired)"
        fatal = session.meta.get("cluster_error")
        if isinstance(fatal, ClusterError):
            raise fatal
        traj = session.trajectory(traj_id, group_id, start_version) if session.calls else failed
        traj.info.update({"task": task, "duration_s": time.monotonic() - t0})
        return await self._outcome(traj, session, returned, error, raised)

    async def _play(
        self, handle: Any, task: dict[str, Any]
    ) -> tuple[Session | None, Any, str | None, BaseException | None]:
        """Run the agent on ``task`` with a client of the session ``handle`` (within ``timeout_s``), then
        close the session: the session as recorded (None: its endpoint process went away), what the agent
        returned, and its error (a message, and what it raised) when it failed."""
        client = None if self.harness is not None else self._client(handle)
        returned: Any = None
        error: str | None = None
        raised: BaseException | None = None
        try:
            self._agent_task = asyncio.ensure_future(self._start_agent(handle, client, task))
            returned = await asyncio.wait_for(asyncio.shield(self._agent_task), self.spec.timeout_s)
            if self.harness is not None:  # (returned, error, raised) from the harness process
                returned, error, raised = returned
        except asyncio.CancelledError:
            if not self._aborting:
                raise
        except TimeoutError:
            error = f"the agent ran longer than timeout_s={self.spec.timeout_s}"
        except Exception as err:
            error, raised = f"agent: {type(err).__name__}: {err}", err
        finally:
            if self._agent_task is not None and not self._agent_task.done():
                self._agent_task.cancel()
            self._agent_task = None
            closed = await self.endpoint.close_session(handle, "aborted" if self._aborting else "episode over")
            self.session = None
            closing = client.close() if client is not None else None
            if inspect.isawaitable(closing):
                await closing
        return closed, returned, error, raised

    def _start_agent(self, handle: Any, client: Any, task: dict[str, Any]) -> Any:
        """The agent's episode as an awaitable: in a harness process (``serving.harness_processes``), else
        in this event loop (a blocking agent in a thread)."""
        if self.harness is not None:
            settings = {"max_retries": self.spec.client_max_retries, "timeout": self.spec.client_timeout_s}
            url = self.endpoint.session_url(handle, public=self.endpoint.listens_publicly)
            return self.harness.play(self.spec.agent, task, url, self.endpoint.token, settings)
        if inspect.iscoroutinefunction(self.agent):
            return self.agent(client, task)
        return asyncio.to_thread(self.agent, client, task)

    async def _outcome(
        self, traj: Trajectory, session: Any, returned: Any, error: str | None, raised: BaseException | None
    ) -> Trajectory:
        """The episode's trajectory with its status and reward: aborted, failed (the agent failed or made
        no call, or its reward failed) or scored."""
        if self._aborting:
            traj.status, traj.reward = "aborted", None
            return traj
        if error is not None:
            traj.status, traj.error, traj.reward = "failed", error, None
            self.failures.record("agent", error.removeprefix("agent: "), raised, tag=self.tag)
            return traj
        if not session.calls:
            traj.status, traj.error = "failed", "the agent made no call to its session"
            self.failures.record(
                "agent",
                "made no call to its session: call the client it is given (its base_url is the session's)",
                tag=self.tag,
            )
            return traj
        reward = await self._reward(returned, session, traj)
        if isinstance(reward, str):
            where = "agent" if reward.startswith("the agent") else "reward"
            self.failures.record(where, reward.removeprefix("reward: "), self._reward_error, tag=self.tag)
            traj.status, traj.error, traj.reward = (
                ("reward_failed" if reward.startswith("reward") else "failed"),
                reward,
                None,
            )
            return traj
        traj.reward = reward
        traj.env_return = reward
        return traj

    async def _reward(self, returned: Any, session: Any, traj: Trajectory) -> float | str:
        """The episode's reward, or the reason there is none (the episode then fails: never a 0)."""
        self._reward_error = None
        if returned is not None:
            if isinstance(returned, bool) or not isinstance(returned, (int, float)) or not math.isfinite(returned):
                return f"the agent returned {returned!r}: return a finite number, or None to score it otherwise"
            return float(returned)
        if session.reward is not None:
            return float(session.reward)
        if self.reward_fn is not None:
            try:
                value = self.reward_fn(traj)
                value = await value if inspect.isawaitable(value) else value
                if value is None:
                    return "reward: the reward function returned None: return the episode's reward (a number)"
                return float(value)
            except Exception as err:
                self._reward_error = err
                return f"reward: {type(err).__name__}: {err}"
        return "no reward: the agent returned None, posted none to /sessions/{id}/reward and the config has no reward"

    async def abort(self) -> None:
        """End the episode in flight as ``aborted``: its calls are aborted and the agent cancelled."""
        self._aborting = True
        session = self.session
        if session is not None:
            await self.endpoint.close_session(session, "aborted")
        if self._agent_task is not None and not self._agent_task.done():
            self._agent_task.cancel()
