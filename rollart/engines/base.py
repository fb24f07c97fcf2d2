"""The inference engine interface every backend implements (RollArt paper §5.3).

The inference worker's loop drives an engine only through these calls, between which it applies
ADD / ABORT / UPDATE commands: ``add_request`` queues a request, ``step`` runs one prefill or decode
step for the running batch and returns the requests that finished in it, ``abort`` stops one and
returns its partial output, ``update_weights`` swaps in a full state dict as a new version.

Colocated mode (the engine shares its devices with a trainer in the same process): ``sleep(level)``
gives the device memory back while the trainer steps — level 1 the KV cache, level 2 the KV cache and
the engine's weights — and ``wake_up(weights, version)`` takes it again, loading the trainer's weights;
``memory()`` says what the engine holds. An engine without a sleep mode raises ``NotImplementedError``.

Behaviour logprobs: ``output_logprobs[i]`` is ``log p(token_i)`` under the distribution the token was
actually sampled from — the model's logits divided by the temperature, then restricted by top-k and
top-p and renormalised (greedy decoding reports the log-softmax of the raw logits). A request with
``top_logprobs = k > 0`` also gets ``output_top_logprobs[i]``: the ``k`` most likely tokens of that same
distribution at position ``i`` as ``(token, log-prob)``, most likely first (tokens of probability zero
left out); an engine that cannot report them leaves the list empty.

Streaming: a request added with ``stream=True`` also reports its progress. After each ``step`` the
caller may call ``take_deltas()``: one :class:`TokenDelta` per streaming request still running that got
tokens since it was last reported (its new tokens, log-probs and top log-probs, from output position
``start``). A request that finished in the step is answered by ``step`` only, with its whole output, so
deltas and the final output never overlap in meaning: the final output is the truth, deltas are its
prefix. Requests without ``stream`` cost nothing more. An engine that cannot report partial outputs
keeps the default (no deltas): its streaming requests are answered when they finish, as any other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from rollart.config_model import ConfigModel

if TYPE_CHECKING:  # annotations only: the config models that import this module load without torch
    import torch


class SamplingParams(ConfigModel):
    """How to sample a continuation. ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k."""

    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; 0 or less: off."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Tokens generated per turn at most (an env's own budget or `max_new_tokens` of a task replaces it)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a generation (besides the end-of-sequence token)."""
    seed: int | None = None
    """Seed of the per-request sampling streams: the same config and seed give the same samples; null: unseeded."""
    logprobs: bool = True
    """Return the log-probabilities of the sampled tokens (the behaviour log-probs the losses need)."""
    top_logprobs: int = Field(default=0, ge=0, le=20)
    """Also return, per generated token, the log-probs of this many most likely tokens (of the distribution the
    sampled token's log-prob is taken from); 0: none (no cost)."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    """Report this request's new tokens after each step (:meth:`InferenceEngine.take_deltas`)."""


@dataclass
class TokenDelta:
    """The tokens a streaming request got since it was last reported: its output positions ``start``,
    ``start + 1``, ... (``top_logprobs`` only when the request asked for them)."""

    request_id: str
    start: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with params.top_logprobs
    finished: bool = False
    finish_reason: Literal["stop", "length", "abort"] | None = None
    weight_version: int = 0


class DeltaTracker:
    """``take_deltas`` for an engine that keeps each running request's cumulative :class:`RequestOutput`:
    it remembers, per streaming request, how many of its tokens were reported. Only streaming requests
    are tracked, so a batch without them pays one empty check per step."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def watch(self, request: EngineRequest) -> None:
        """Call from ``add_request``: track ``request`` if it streams (an id added again starts over)."""
        if request.stream:
            self._sent[request.request_id] = 0
        else:
            self._sent.pop(request.request_id, None)

    def deltas(self, running: Callable[[str], RequestOutput | None]) -> list[TokenDelta]:
        """The new tokens of each tracked request; ``running(id)``: its output while it is still in the
        engine, else None (finished or aborted: forgotten)."""
        if not self._sent:
            return []
        out: list[TokenDelta] = []
        for rid, sent in list(self._sent.items()):
            o = running(rid)
            if o is None or o.finished:
                del self._sent[rid]
                continue
            n = len(o.output_token_ids)
            if n > sent:
                out.append(
                    TokenDelta(
                        rid,
                        sent,
                        o.output_token_ids[sent:n],
                        o.output_logprobs[sent:n],
                        o.output_top_logprobs[sent:n],
                    )
                )
                self._sent[rid] = n
        return out


SLEEP_LEVELS = (1, 2)
"""What a sleeping engine gives back: 1 its KV cache, 2 its KV cache and its weights."""


@dataclass
class EngineMemory:
    """What an engine holds on its device (bytes; None where the engine cannot tell)."""

    sleep_level: int = 0
    """0 awake; else the level of the last ``sleep``."""
    kv_cache_bytes: int | None = None
    """The KV cache it holds on its device now (0 while asleep, where sleeping frees memory)."""
    kv_cache_peak_bytes: int | None = None
    """The largest KV cache it held since its last wake-up (or since it started)."""
    weight_bytes: int | None = None
    """Its weights on its device now (0 while asleep at level 2, where sleeping frees memory)."""
    frees_memory: bool = False
    """Whether sleeping gives memory back here (vLLM on CPU, for one, only pauses)."""
    freed_bytes: int | None = None
    """The device memory its last ``sleep`` gave back, as the device reports it; None where not measured."""


class InferenceEngine(ABC):
    """A step-driven generation backend."""

    weight_version: int = 0
    sleep_level: int = 0  # 0 awake; 1 or 2 while asleep (colocated mode)
    loads_model: ClassVar[bool] = True
    """The engine loads a Hugging Face model (``engine.model``, else the pipeline's ``model``), which the config
    checks exists before anything starts."""
    max_colocated_devices: ClassVar[int | None] = None
    """The most devices a colocated train pool may have with this engine (one engine in each trainer rank's
    process); None: any number. The config refuses a larger colocated train pool before anything starts."""

    @classmethod
    def sleeps(cls) -> bool:
        """Whether the engine has a sleep mode, which colocated mode needs: it implements :meth:`sleep`."""
        return cls.sleep is not InferenceEngine.sleep

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abstractmethod
    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its partial output (tokens so far) or None if unknown."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that finished in it."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    def take_deltas(self) -> list[TokenDelta]:
        """The new tokens of streaming requests (``EngineRequest.stream``) still running, since the last
        call; call it after ``step``. None here: this engine answers streaming requests when they finish."""
        return []

    @abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a full state dict as ``version``; a bad one is refused and the old weights keep serving."""

    # ------------------------------------------------------------------ colocated mode
    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while a trainer in this process steps: ``level`` 1 the KV cache,
        2 the KV cache and the weights. No request may be in the engine, and it takes none until
        :meth:`wake_up`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no sleep mode: colocated mode needs an engine that implements sleep "
            "and wake_up (the torch and vllm engines do)"
        )

    def wake_up(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        """Take the device memory again; with ``weights``, load them as ``version`` first (after a level-2
        sleep they must be given: the engine's own were freed). Awake, it only loads ``weights``."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode (see sleep)")

    def memory(self) -> EngineMemory:
        """What the engine holds on its device now."""
        return EngineMemory(sleep_level=self.sleep_level)
