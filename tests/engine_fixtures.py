"""Helpers of the torch engine tests: a tiny model whose greedy continuations vary, a driver that applies
scripted actions (add, abort, weight update) between engine steps, and a mixed workload."""

import math

import torch
from transformers import AutoModelForCausalLM

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.torch_engine import TorchEngine
from rollart.models import build_tiny


def lively_model(folder):
    """The tiny model with large random weights: greedy continuations vary from token to token."""
    folder = build_tiny(folder, hidden_size=64, num_layers=2, seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    model.save_pretrained(folder)
    return str(folder)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


def drive(engine, script):
    """Apply ``script[i]`` (a list of actions) before step i, then step until nothing is left. Returns
    {request id: (tokens, logprobs, finish reason)} of finished and aborted requests, and the slot each
    running request held at every step."""
    results, slots = {}, {}

    def record(out):
        results[out.request_id] = (list(out.output_token_ids), list(out.output_logprobs), out.finish_reason)

    i = 0
    while i < len(script) or engine.has_unfinished():
        for action in script[i] if i < len(script) else []:
            if action[0] == "add":
                engine.add_request(EngineRequest(action[1], action[2], action[3]))
            elif action[0] == "abort":
                out = engine.abort(action[1])
                if out is not None:
                    record(out)
            elif action[0] == "update":
                engine.update_weights(action[1], action[2])
        for out in engine.step():
            record(out)
        if isinstance(engine, TorchEngine):
            for slot, run in engine._slots.items():
                slots.setdefault(run.request.request_id, set()).add(slot)
        i += 1
    return results, slots


def assert_same(got, ref, ids, tol=1e-5):
    for rid in ids:
        assert got[rid][0] == ref[rid][0], rid
        assert got[rid][2] == ref[rid][2], rid
        assert len(got[rid][1]) == len(ref[rid][1])
        assert all(math.isclose(a, b, abs_tol=tol) for a, b in zip(got[rid][1], ref[rid][1])), rid


def mixed_script(state):
    """Mixed lengths joining and leaving, twins, a next turn of a finished request, seeded sampling, two
    aborts (one running, one waiting) and a weight update in the middle."""
    torch.manual_seed(1)
    new = {k: v + 0.2 * torch.randn_like(v) for k, v in state.items()}
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=9, seed=11)
    long = list(range(40, 80))
    return [
        [
            ("add", "a", [5, 6, 7], greedy(12)),
            ("add", "b", long, greedy(6)),
            ("add", "twin1", [9, 9, 8], greedy(7)),
            ("add", "twin2", [9, 9, 8], greedy(10)),
        ],
        [("add", "one", [3], greedy(5)), ("add", "s", [11, 12, 13, 14], sampled)],
        [],
        [("add", "c", list(range(100, 117)), greedy(8)), ("add", "free", [4, 4], SamplingParams(max_new_tokens=4))],
        [("abort", "a"), ("add", "d", [21, 22], greedy(11))],
        [("add", "queued", [7, 7, 7], greedy(3)), ("abort", "queued")],
        [("update", new, 1), ("add", "e", [30, 31, 32, 33, 34], greedy(6))],
        [("add", "s2", [11, 12, 13], sampled.model_copy(update={"seed": 12, "top_k": 0}))],
    ]


def run_mixed(engine, state):
    results, _ = drive(engine, mixed_script(state))
    twin1 = [9, 9, 8] + results["twin1"][0]  # a next turn: twin1's sequence and new tokens
    results.update(drive(engine, [[("add", "turn2", twin1 + [50, 51, 52], greedy(6))]])[0])
    return results
