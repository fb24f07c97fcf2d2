"""EnvManager: one environment, one trajectory at a time (RollArt paper §5.3, Figure 7; ROLL Flash §5.2).

``reset → (generate → step)* → reward``, never waiting for other environments. Each action is sent
to the shared LLMProxy with the whole history so far; the trajectory keeps every token with a loss
mask (action tokens 1, observation tokens 0), per-token behaviour logprobs and policy versions,
turn boundaries and the env's tag.

With a chat template (``chat_template``, see :mod:`rollart.rollout.chat`) the first observation is
rendered as ``[system, user]`` messages (the env's instructions as system prompt) and each later one
as a new message; the trajectory's tokens are exactly the tokens the model was given and generated,
never re-encoded. ``max_prompt_length`` bounds the first prompt (``truncation``: ``left`` keeps its
last tokens, ``error`` fails the trajectory).

Faults: ``reset`` is retried with exponential backoff; a ``step`` that keeps failing (an error or a
timeout) ends the trajectory with ``status="failed"``; a reward that fails after its retries gives
``status="reward_failed"``. A generation that fails (the engine refused the request, its loop
stopped) ends the trajectory with ``status="failed"`` and the cause in ``error``; a generation no worker
can serve any more (every inference worker dead or removed, or the restart policy failed the job)
raises ``ClusterError`` out of :meth:`EnvManager.run`, so the scheduler stops and ``get_batch`` raises
it. Nothing is ever scored 0 in place of a failure, and the caller counts every status.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rollart.cluster.errors import ClusterError
from rollart.engines.base import SamplingParams
from rollart.rollout.chat import ChatFormat, ChatTemplateError, chat_format
from rollart.rollout.config import EnvManagerConfig
from rollart.rollout.cost import TrajectoryCost
from rollart.rollout.failures import FailureLog
from rollart.rollout.types import GenerateOutput, GenerateRequest, TraceSink, Trajectory

log = logging.getLogger(__name__)

RewardFn = Callable[[Trajectory], Awaitable[float] | float]


class _Aborted(Exception):
    """The episode was aborted by its owner."""


class PolicyGenerator(Protocol):
    """What an EnvManager generates through: the :class:`~rollart.rollout.llm_proxy.LLMProxy` (or anything
    with its ``generate`` and ``abort``). ``trace`` hears each worker's answer; ``cost`` is the trajectory's
    cost ledger, charged its share of the workers' busy time (a generator that measures none leaves it)."""

    async def generate(
        self,
        request: GenerateRequest,
        tag: str,
        *,
        trace: Callable[[str, dict[str, Any]], None] | None = None,
        cost: TrajectoryCost | None = None,
    ) -> GenerateOutput: ...

    async def abort(self, request_ids: list[str]) -> Any: ...


class TextCodec(Protocol):
    """Text ↔ token ids (a Hugging Face tokenizer satisfies it through :class:`HFCodec`)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFCodec:
    """Adapts a Hugging Face tokenizer: no special tokens added, eos stripped on decode."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self._chat: dict[tuple[str, str], ChatFormat | None] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_format(self, setting: str = "auto", observation_role: str = "user") -> ChatFormat | None:
        """The chat template to render with under ``setting`` (``auto``/``none``/path/inline Jinja),
        None for raw text; built once per setting and shared by every EnvManager of this codec."""
        key = (setting, observation_role)
        if key not in self._chat:
            self._chat[key] = chat_format(self.tokenizer, setting, observation_role)
        return self._chat[key]


async def _call_env(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Run an env method: awaited if it is a coroutine function, else in a worker thread; bounded
    (``asyncio.timeout`` runs it in the calling task: no second task per env call, as ``wait_for`` makes)."""
    async with asyncio.timeout(timeout_s):
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)


def inline_methods(env: Any) -> frozenset[str]:
    """The methods of ``env`` to call on the event loop (``TextEnv.inline_methods``): the instance's own
    setting, else its class's; never what a wrapper's ``__getattr__`` forwards from the env it wraps."""
    own = vars(env).get("inline_methods") if hasattr(env, "__dict__") else None
    names = own if own is not None else getattr(type(env), "inline_methods", frozenset())
    return frozenset(names)


class EnvManager:
    """Drives one env through the shared LLMProxy. ``version_fn()`` reads the current policy version
    (stamped as the trajectory's ``start_version``)."""

    def __init__(
        self,
        env: Any,
        proxy: PolicyGenerator,
        codec: TextCodec,
        *,
        sampling: SamplingParams | None = None,
        reward_fn: RewardFn | None = None,
        config: EnvManagerConfig | None = None,
        version_fn: Callable[[], int] = lambda: 0,
    ):
        self.env = env
        self.proxy = proxy
        self.codec = codec
        self.config = config or EnvManagerConfig()
        self.chat = self._chat_format(codec, self.config)
        base = sampling or SamplingParams()
        max_new = getattr(env, "max_new_tokens", None) or base.max_new_tokens
        stops = list(base.stop_token_ids)
        extra = [codec.eos_token_id] + (self.chat.stop_token_ids if self.chat else [])
        stops += [t for t in dict.fromkeys(extra) if t is not None and t not in stops]
        self.sampling = base.model_copy(update={"max_new_tokens": max_new, "stop_token_ids": stops})
        self.reward_fn = reward_fn
        self.version_fn = version_fn
        self.tag: str = getattr(env, "tag", type(env).__name__)
        self.failures = FailureLog()  # the rollout scheduler gives its managers one log, shared
        # the quick methods it names, called on the loop; a coroutine method is awaited there anyway
        self.inline = frozenset(
            n for n in inline_methods(env) if not inspect.iscoroutinefunction(getattr(env, n, None))
        )
        self.current_request: str | None = None
        self._env_call: asyncio.Task | None = None
        self._aborting = False
        self._sink: TraceSink | None = None  # the episode's trace, when it is traced

    @staticmethod
    def _chat_format(codec: TextCodec, config: EnvManagerConfig) -> ChatFormat | None:
        make = getattr(codec, "chat_format", None)
        if make is None:
            if config.chat_template not in ("auto", "none"):
                raise ValueError(
                    f"env_manager.chat_template: {type(codec).__name__} has no tokenizer to render a chat "
                    "template with; use an HFCodec or chat_template: auto"
                )
            return None
        return make(config.chat_template, config.observation_role)

    def _system_prompt(self, observation: str) -> str | None:
        """The env's instructions, unless the observation already starts with them."""
        text = getattr(self.env, "instructions", "") or ""
        return text if text and not observation.startswith(text) else None

    async def _env(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """An env call that :meth:`abort` can cancel (a fail-slow env must not hold a finished round);
        a method of :attr:`inline` runs here, on the event loop (quick by its env's word)."""
        if self._aborting:
            raise _Aborted()
        if fn.__name__ in self.inline:
            return fn(*args)
        self._env_call = asyncio.ensure_future(_call_env(fn, *args, timeout_s=timeout_s))
        try:
            return await self._env_call
        except asyncio.CancelledError:
            if self._aborting:
                raise _Aborted() from None
            raise
        finally:
            self._env_call = None

    async def _reset(self, seed: int | None) -> tuple[str, dict]:
        cfg = self.config
        for attempt in range(cfg.reset_retries + 1):
            try:
                return await self._env(self.env.reset, seed, timeout_s=cfg.reset_timeout_s)
            except _Aborted:
                raise
            except Exception as err:
                if attempt == cfg.reset_retries:
                    raise
                delay = cfg.reset_backoff_s * (2**attempt) * (1 + random.random() * 0.5)
                log.warning(
                    "%s reset failed (%s: %s); retry %d in %.2fs", self.tag, type(err).__name__, err, attempt + 1, delay
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        cfg = self.config
        for attempt in range(cfg.step_retries + 1):
            try:
                return await self._env(self.env.step, action, timeout_s=cfg.step_timeout_s)
            except _Aborted:
                raise
            except Exception:
                if attempt == cfg.step_retries:
                    raise
        raise AssertionError("unreachable")

    async def run(
        self, seed: int | None = None, group_id: str = "", traj_id: str | None = None, *, trace: TraceSink | None = None
    ) -> Trajectory:
        """One episode. Never raises for env or reward faults: they come back as the trajectory status.
        ``trace``: where its events go (env calls, generate calls, the reward), when it is traced."""
        traj = Trajectory(
            traj_id=traj_id or uuid.uuid4().hex, group_id=group_id, tag=self.tag, start_version=self.version_fn()
        )
        self._aborting = False
        self._sink = trace
        t0 = time.monotonic()
        try:
            return await self._episode(traj, seed)
        except _Aborted:
            traj.status = "aborted"
            return traj
        finally:
            self._aborting = False
            if trace is not None:  # what the episode cost, before the scheduler's end of its life
                trace.emit(traj.traj_id, "cost", **traj.cost.fields())
            self._sink = None
            traj.info["duration_s"] = time.monotonic() - t0  # reset to reward, wall clock

    def _emit(self, traj: Trajectory, event: str, **fields: Any) -> None:
        if self._sink is not None:
            self._sink.emit(traj.traj_id, event, **fields)

    async def _episode(self, traj: Trajectory, seed: int | None) -> Trajectory:
        obs = await self._begin(traj, seed)
        if obs is None:
            return traj
        prompt = self._first_prompt(traj, obs)
        if prompt is None:
            return traj
        self._append_ids(traj, prompt)
        traj.prompt_length = len(traj.token_ids)
        max_steps = self.config.max_steps or getattr(self.env, "max_steps", 1)
        for turn in range(max_steps):
            if self._aborting:
                raise _Aborted()
            out = await self._generate_turn(traj, seed, turn)
            if out is None:
                return traj
            start = self._append_output(traj, out)
            if out.finish_reason == "abort":
                traj.status = "aborted"
                return traj
            stepped = await self._env_step(traj, turn, self.codec.decode(out.output_token_ids))
            if stepped is None:
                return traj
            obs, reward, terminated, truncated, step_info = stepped
            traj.env_return += float(reward)
            traj.info.setdefault("steps", []).append(step_info)
            response = step_info.get("response") if isinstance(step_info, dict) else None
            traj.scored_on.response = response if isinstance(response, str) else None
            if isinstance(step_info, dict) and "char_rewards" in step_info:
                self._add_token_rewards(traj, start, out.output_token_ids, step_info["char_rewards"])
            if terminated or truncated:
                break
            try:
                ids = self.chat.observation_ids(obs, out.output_token_ids) if self.chat else self.codec.encode(obs)
            except ChatTemplateError as err:
                traj.status, traj.error = "failed", f"step {turn}: {err}"
                self.failures.record("chat template", str(err), tag=self.tag)
                return traj
            self._append_ids(traj, ids)
        await self._score(traj)
        return traj

    async def _begin(self, traj: Trajectory, seed: int | None) -> str | None:
        """Reset the env for the episode: its first observation, or None with ``traj`` failed."""
        t0 = time.monotonic()
        try:
            obs, info = await self._reset(seed)
        except _Aborted:
            traj.cost.env_s += time.monotonic() - t0
            raise
        except Exception as err:
            traj.status, traj.error = "failed", f"reset: {type(err).__name__}: {err}"
            self.failures.record("reset", f"{type(err).__name__}: {err}", err, tag=self.tag)
            traj.cost.env_s += time.monotonic() - t0
            self._emit(traj, "env_reset", latency_s=time.monotonic() - t0, error=traj.error)
            return None
        traj.cost.env_s += time.monotonic() - t0
        self._emit(traj, "env_reset", latency_s=time.monotonic() - t0)
        traj.info["reset"] = info
        traj.info["prompt_text"] = obs  # the env's own text, before any chat template
        traj.scored_on.prompt = obs
        traj.scored_on.ground_truth = info.get("ground_truth") if isinstance(info, dict) else None
        return obs

    async def _generate_turn(self, traj: Trajectory, seed: int | None, turn: int) -> GenerateOutput | None:
        """The policy's reply of turn ``turn`` to the trajectory so far; None, with ``traj`` failed, when
        generating it failed (a ``ClusterError`` propagates: no worker can serve it)."""
        self.current_request = f"{traj.traj_id}:{turn}"
        req = GenerateRequest(
            request_id=self.current_request,
            prompt_token_ids=list(traj.token_ids),
            sampling=self._turn_sampling(seed, traj.traj_id, turn),
        )
        try:
            trace = self._proxy_trace(traj, turn) if self._sink is not None else None
            return await self.proxy.generate(req, self.tag, trace=trace, cost=traj.cost)
        except ClusterError:
            raise  # no worker can serve it: the rollout cannot go on
        except Exception as err:
            root = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err  # Ray's wrapper
            traj.status, traj.error = "failed", f"generate turn {turn}: {type(root).__name__}: {root}"
            self.failures.record("generate", f"{type(root).__name__}: {root}", root, tag=self.tag)
            return None
        finally:
            self.current_request = None

    @staticmethod
    def _append_output(traj: Trajectory, out: GenerateOutput) -> int:
        """Append a reply's tokens (trained on) to the trajectory; where they start."""
        traj.hardware.append(out.hardware)
        start = len(traj.token_ids)
        traj.token_ids += out.output_token_ids
        traj.loss_mask += [1] * len(out.output_token_ids)
        traj.logprobs += out.output_logprobs
        traj.versions += out.token_versions
        traj.turns.append((start, len(traj.token_ids)))
        return start

    async def _env_step(self, traj: Trajectory, turn: int, action: str) -> tuple[str, float, bool, bool, dict] | None:
        """The env's step on ``action``, its time counted; None, with ``traj`` failed, when it failed."""
        t_step = time.monotonic()
        try:
            obs, reward, terminated, truncated, step_info = await self._step(action)
        except _Aborted:
            traj.cost.env_s += time.monotonic() - t_step
            raise
        except Exception as err:
            traj.cost.env_s += time.monotonic() - t_step
            traj.status, traj.error = "failed", f"step {turn}: {type(err).__name__}: {err}"
            self.failures.record("step", f"{type(err).__name__}: {err}", err, tag=self.tag)
            self._emit(traj, "env_step", turn=turn, latency_s=time.monotonic() - t_step, error=traj.error)
            return None
        traj.cost.env_s += time.monotonic() - t_step
        if self._sink is not None:
            self._emit(
                traj,
                "env_step",
                turn=turn,
                latency_s=time.monotonic() - t_step,
                reward=float(reward),
                done=bool(terminated or truncated),
            )
        return obs, reward, terminated, truncated, step_info

    def _first_prompt(self, traj: Trajectory, obs: str) -> list[int] | None:
        """The token ids of the first prompt (chat template applied), cut to ``max_prompt_length`` from the
        left; None, with ``traj`` failed, when it is longer and ``truncation: error``."""
        prompt = self.chat.prompt_ids(obs, self._system_prompt(obs)) if self.chat else self.codec.encode(obs)
        limit = self.config.max_prompt_length
        if limit is not None and len(prompt) > limit:
            if self.config.truncation == "error":
                traj.status = "failed"
                traj.error = (
                    f"prompt_too_long: the first prompt has {len(prompt)} tokens > env_manager.max_prompt_length="
                    f"{limit} (truncation: error); raise max_prompt_length or set truncation: left"
                )
                log.error("%s: %s", self.tag, traj.error)
                return None
            traj.info["prompt_truncated"] = len(prompt) - limit
            prompt = prompt[-limit:]
        return prompt

    async def _score(self, traj: Trajectory) -> None:
        """The trajectory's reward: the env's return, or the reward function's score of it (a failure makes
        it ``reward_failed``, never a reward of 0)."""
        traj.reward = traj.env_return
        if self.reward_fn is None:
            self._emit(traj, "reward", source="env", latency_s=0.0, status="ok", reward=traj.reward)
            return
        t0 = time.monotonic()
        try:
            value = self.reward_fn(traj)
            value = await value if inspect.isawaitable(value) else value
            if value is None:
                raise TypeError("the reward function returned None: return the trajectory's reward (a number)")
            traj.reward = float(value)
        except Exception as err:
            traj.reward, traj.status, traj.error = None, "reward_failed", f"{type(err).__name__}: {err}"
            self.failures.record("reward", f"{type(err).__name__}: {err}", err, tag=self.tag)
        traj.cost.reward_s += time.monotonic() - t0
        if self._sink is not None:
            self._emit(
                traj,
                "reward",
                source=getattr(self.reward_fn, "trace_source", "function"),
                latency_s=time.monotonic() - t0,
                status="ok" if traj.status == "ok" else "failed",
                reward=traj.reward,
                error=traj.error,
            )

    def _proxy_trace(self, traj: Trajectory, turn: int) -> Callable[[str, dict[str, Any]], None]:
        """The LLMProxy's events of one generate call (each worker's answer, each migration) as trace events."""
        sink, tid = self._sink, traj.traj_id
        assert sink is not None

        def emit(event: str, fields: dict[str, Any]) -> None:
            sink.emit(tid, event, turn=turn, **fields)

        return emit

    def _turn_sampling(self, env_seed: int | None, traj_id: str, turn: int) -> SamplingParams:
        """With ``sampling.seed`` set, each request samples from its own seed, derived from that seed,
        the env seed, the trajectory id (group, round, member) and the turn: what a trajectory samples
        does not depend on which other requests the engine batched it with, so a seeded run repeats."""
        if self.sampling.seed is None:
            return self.sampling
        key = f"{self.sampling.seed}:{env_seed}:{traj_id}:{turn}".encode()
        return self.sampling.model_copy(update={"seed": zlib.crc32(key)})

    def _add_token_rewards(self, traj: Trajectory, start: int, ids: list[int], char_rewards: list[float]) -> None:
        """Map an env's per-character credit onto the action's tokens: a token gets the mean credit of
        the characters it decodes to (0 for tokens with no text, such as end-of-sequence)."""
        if traj.token_rewards is None:
            traj.token_rewards = [0.0] * start
        traj.token_rewards += [0.0] * (start - len(traj.token_rewards))
        pos = 0
        for tok in ids:
            n = len(self.codec.decode([tok]))
            chunk = char_rewards[pos : pos + n]
            traj.token_rewards.append(sum(chunk) / len(chunk) if chunk else 0.0)
            pos += n

    @staticmethod
    def _append_ids(traj: Trajectory, ids: list[int]) -> None:
        """Observation tokens: in the context, out of the loss."""
        traj.token_ids += ids
        traj.loss_mask += [0] * len(ids)
        traj.logprobs += [0.0] * len(ids)
        traj.versions += [-1] * len(ids)

    async def abort(self) -> None:
        """End the episode in flight as ``aborted`` (redundant rollouts, staleness bound): its generation
        is aborted (partial tokens kept) or its env call cancelled."""
        self._aborting = True
        if self._env_call is not None:
            self._env_call.cancel()
        if self.current_request is not None:
            await self.proxy.abort([self.current_request])
