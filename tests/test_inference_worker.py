"""The inference worker's command loop, driven in-process with an engine whose steps wait on a gate:
commands that queue up while a step runs are applied in a fixed order, so the interleavings that
arise under load on a real cluster are reproduced exactly."""

import asyncio
import logging
import threading

import pytest

from rollart.engines.base import SamplingParams
from rollart.engines.simulated import SimulatedEngine
from rollart.rollout.inference_worker import InferenceWorker
from rollart.rollout.types import GenerateRequest

pytestmark = pytest.mark.timeout(60)


class GatedEngine(SimulatedEngine):
    """Each step waits until the test opens the gate; ``refuse`` names prompts it will not accept."""

    def __init__(self) -> None:
        super().__init__(decode_base_s=0.0, decode_per_seq_s=0.0, prefill_per_token_s=0.0)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.refuse: set[int] = set()

    def add_request(self, request):
        if request.prompt_token_ids[0] in self.refuse:
            raise ValueError(f"prompt starting with {request.prompt_token_ids[0]} is too long for this engine")
        super().add_request(request)

    def step(self):
        self.in_step.set()
        assert self.gate.wait(timeout=30)
        return super().step()


def local_worker() -> tuple[InferenceWorker, GatedEngine]:
    worker = InferenceWorker({"kind": "simulated"})
    worker.rank, worker.hardware = 0, "CPU"
    worker.logger = logging.LoggerAdapter(logging.getLogger("test.inference_worker"), {})
    worker.engine = GatedEngine()
    return worker, worker.engine


def request(rid: str, n: int = 6, first: int = 5) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[first, 6, 7], sampling=SamplingParams(max_new_tokens=n))


async def queued(worker: InferenceWorker, n: int) -> None:
    """Yields to the event loop until ``n`` commands wait in the worker's queue."""
    while worker._commands is None or worker._commands.qsize() < n:
        await asyncio.sleep(0)


async def test_a_request_preempted_before_it_reached_the_engine_can_be_sent_again():
    """An UPDATE queued during a step, then a new request: the update answers the new request
    (preempted, no tokens) before its ADD is applied. That ADD must not put it in the engine, or the
    caller's retry with the same id would collide with a request nobody waits for."""
    worker, engine = local_worker()
    first = asyncio.ensure_future(worker.generate(request("first", n=50), "*"))
    await asyncio.to_thread(engine.in_step.wait, 30)
    engine.gate.clear()  # the next step holds until the commands below are queued
    engine.in_step.clear()
    await asyncio.to_thread(engine.in_step.wait, 30)
    update = asyncio.ensure_future(worker.update_weights({}, 1))
    await queued(worker, 1)
    late = asyncio.ensure_future(worker.generate(request("late"), "*"))
    await queued(worker, 2)
    engine.gate.set()
    assert await update == 1
    out = await late
    assert out.preempted and out.output_token_ids == []
    assert (await first).preempted
    again = await worker.generate(request("late"), "*")  # what LLMProxy does with a preempted request
    assert again.finish_reason == "length" and len(again.output_token_ids) == 6
    assert again.token_versions == [1] * 6
    assert not engine.has_unfinished()  # nothing left running that no caller waits for


async def test_a_request_the_engine_refuses_fails_alone_and_the_loop_serves_on():
    worker, engine = local_worker()
    engine.refuse.add(9)
    with pytest.raises(ValueError, match="too long for this engine"):
        await worker.generate(request("refused", first=9), "*")
    out = await worker.generate(request("fine"), "*")
    assert out.finish_reason == "length" and len(out.output_token_ids) == 6


async def test_a_stopped_loop_fails_its_waiting_callers_instead_of_hanging_them():
    worker, engine = local_worker()
    waiting = asyncio.ensure_future(worker.generate(request("waiting", n=50), "*"))
    await asyncio.to_thread(engine.in_step.wait, 30)
    engine.gate.clear()
    engine.in_step.clear()
    await asyncio.to_thread(engine.in_step.wait, 30)
    update = asyncio.ensure_future(worker.update_weights({}, 1))
    await queued(worker, 1)
    engine.abort = None  # the UPDATE's preemption will raise inside the loop: the loop stops
    engine.gate.set()
    with pytest.raises(TypeError):
        await update
    with pytest.raises(TypeError):
        await waiting
    with pytest.raises(RuntimeError, match="inference loop of rank 0 .* stopped"):
        await worker.generate(request("after"), "*")
