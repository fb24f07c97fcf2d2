"""The static-cache torch engine against the dynamic-cache engine it replaced, its prefill budget, its prefix
cache (a multi-turn session prefills each turn's new tokens only), device sampling and its options."""

import math

import pytest
import torch
from engine_fixtures import assert_same, drive, greedy, lively_model, run_mixed
from transformers import GPT2Config, GPT2LMHeadModel

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.prefix_cache import PrefixCache
from rollart.engines.sampling import RowSampling, process_logits, sample_rows
from rollart.engines.torch_dynamic import DynamicCacheTorchEngine
from rollart.engines.torch_engine import TorchEngine
from rollart.models.kv_cache import StaticKVCache


@pytest.fixture(scope="module")
def lively(tmp_path_factory):
    return lively_model(tmp_path_factory.mktemp("lively"))


def test_the_static_engine_equals_the_dynamic_engine_through_joins_aborts_and_a_weight_update(lively):
    reference = TorchEngine(lively, kv_cache="dynamic")
    assert isinstance(reference, DynamicCacheTorchEngine)
    state = {k: v.clone() for k, v in reference.model.state_dict().items()}
    ref = run_mixed(reference, state)
    compared = ["a", "b", "twin1", "twin2", "one", "s", "c", "d", "e", "s2", "turn2"]
    engines = {}
    for name, options in {"default": {}, "plain": {"prefix_cache_tokens": 0, "prefix_sharing": False}}.items():
        engine = engines[name] = TorchEngine(lively, **options)
        got = run_mixed(engine, state)
        assert_same(got, ref, compared)
        assert got["a"][2] == "abort" and 0 < len(got["a"][0]) < 12  # its tokens so far
        assert got["queued"] == ([], [], "abort")
        assert len(got["free"][0]) == 4 and all(lp <= 0 for lp in got["free"][1])
        assert engine.weight_version == 1 and not engine.has_unfinished() and engine.num_running == 0
    assert len(set(ref["s"][0])) > 1 and ref["s"][0] != ref["s2"][0]  # the sampled rows really sampled
    assert len(set(ref["turn2"][0])) > 1  # greedy continuations vary: a real comparison
    # the default engine prefilled the twins once (and again once after the update: their sequences were still
    # identical) and found turn2's beginning (twin1's sequence, finished under the new weights) in its prefix cache
    default, plain = engines["default"].stats, engines["plain"].stats
    assert default["shared_prefill_rows"] == 2 and plain["shared_prefill_rows"] == 0
    assert default["prefix_cache_hit_tokens"] >= 3 + 6 and plain["prefix_cache_hits"] == 0
    assert default["prefill_tokens"] < plain["prefill_tokens"]


def test_requests_keep_their_slot_from_join_to_leave_and_the_cache_is_not_reallocated(lively):
    engine = TorchEngine(lively, max_batch_size=8)
    drive(engine, [[("add", f"w{i}", [1] * (60 if i == 0 else 2), greedy(3)) for i in range(8)]])
    assert (engine.cache.slots, engine.cache.capacity) == (8, 64)  # sized by the warm-up
    generation, keys = engine.cache.generation, list(engine.cache.keys)
    script = [[("add", f"r{i}", [5 + i] * (1 + 3 * i), greedy(4 + 2 * i)) for i in range(4)]]
    script += [[("abort", "r1"), ("add", "r4", [9, 8], greedy(5))], [("add", "r5", [7], greedy(3))]]
    _, slots = drive(engine, script)
    assert all(len(held) == 1 for held in slots.values()), slots
    assert slots["r4"] == {1}  # joined into the slot r1 left
    assert engine.cache.generation == generation and all(a is b for a, b in zip(engine.cache.keys, keys))


def test_prefill_is_batched_by_the_token_budget(lively):
    prompts = {"p0": [5] * 4, "p1": [6] * 4, "p2": [7] * 4, "p3": [8] * 12, "p4": [9] * 3}
    ref = TorchEngine(lively, prefix_cache_tokens=0)
    want, _ = drive(ref, [[("add", rid, p, greedy(3)) for rid, p in prompts.items()]])
    assert ref.stats["prefill_forwards"] == 1
    engine = TorchEngine(lively, max_prefill_tokens=10, prefix_cache_tokens=0)
    engine_steps = []
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, greedy(3)))
    got = {}
    while engine.has_unfinished():
        before = engine.stats["prefill_tokens"]
        for out in engine.step():
            got[out.request_id] = (out.output_token_ids, out.output_logprobs, out.finish_reason)
        engine_steps.append(engine.stats["prefill_tokens"] - before)
    # p0 + p1 (8), then p2 (4; with p3 it would be 16), then p3 alone (12 > 10: a long prompt still joins), then p4
    assert engine_steps[:4] == [8, 4, 12, 3]
    assert_same(got, want, prompts)


def session_turns(engine, n_turns=6, answer=7):
    """A chat session: each turn's prompt is the previous prompt, the previous answer and new user tokens."""
    prompt = [1] + list(range(10, 40))
    turns = []
    for t in range(n_turns):
        engine.add_request(EngineRequest(f"t{t}", prompt, greedy(answer)))
        out = drive(engine, [[]])[0][f"t{t}"]
        turns.append((list(prompt), out))
        prompt = prompt + out[0] + [2] + [60 + (5 * t + k) % 200 for k in range(9)]
    return turns


def test_a_six_turn_session_prefills_about_its_longest_prompt_once(lively):
    cold = TorchEngine(lively, prefix_cache_tokens=0)
    warm = TorchEngine(lively)
    want, got = session_turns(cold), session_turns(warm)
    assert [p for p, _ in got] == [p for p, _ in want]
    assert_same({i: o for i, (_, o) in enumerate(got)}, {i: o for i, (_, o) in enumerate(want)}, range(6))
    longest = max(len(p) for p, _ in want)
    assert cold.stats["prefill_tokens"] == sum(len(p) for p, _ in want)
    assert warm.stats["prefill_tokens"] <= 1.2 * longest
    assert warm.stats["prefix_cache_hits"] == 5 and warm.stats["prefix_cache_queries"] == 6
    assert warm.stats["prefix_cache_hit_tokens"] == sum(len(p) for p, _ in want) - warm.stats["prefill_tokens"]


def test_a_weight_update_clears_the_prefix_cache(lively):
    engine = TorchEngine(lively)
    engine.add_request(EngineRequest("t0", list(range(10, 30)), greedy(5)))
    first = drive(engine, [[]])[0]["t0"][0]
    follow = list(range(10, 30)) + first + [3, 4]
    state = engine.model.state_dict()
    new = {k: v * 1.3 for k, v in state.items()}
    engine.update_weights(new, 1)
    engine.add_request(EngineRequest("t1", follow, greedy(5)))
    got = drive(engine, [[]])[0]["t1"]
    assert engine.stats["prefix_cache_hits"] == 0 and engine.prefix_cache.held == len(follow) + 4
    fresh = TorchEngine(lively, prefix_cache_tokens=0)
    fresh.update_weights(new, 1)
    fresh.add_request(EngineRequest("t1", follow, greedy(5)))
    assert_same({"t1": got}, drive(fresh, [[]])[0], ["t1"])


def test_the_prefix_cache_stays_in_its_budget_and_evicts_the_least_recently_used():
    cache = StaticKVCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", max_slots=2)
    cache.reserve(2, 64)
    gen = torch.Generator().manual_seed(0)
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.randn(t.shape, generator=gen))
    pc = PrefixCache(budget=24)
    a, b = list(range(10)), list(range(5)) + [99] * 5  # b shares a's first 5 tokens
    assert pc.store(a, cache, slot=0) == 10
    assert pc.store(b, cache, slot=1) == 5  # only the 5 tokens after the shared beginning are new
    assert pc.held == 15
    found, rows = pc.match(a + [7, 7])
    assert found == 10
    pc.load(rows, cache, slot=1)  # a's keys and values, copied into slot 1
    for t in (*cache.keys, *cache.values):
        assert torch.equal(t[1, :, :10], t[0, :, :10])
    assert pc.match(b)[0] == 10
    pc.match(a)  # a used after b: b's tail is the least recently used leaf
    c = [50 + i for i in range(12)]
    assert pc.store(c, cache, slot=0) == 12
    assert pc.held <= 24 and pc.stats["evicted_tokens"] == 5
    assert pc.match(b)[0] == 5 and pc.match(a)[0] == 10 and pc.match(c)[0] == 12
    assert pc.store(list(range(200, 240)), cache, slot=0) == 24  # longer than the budget: its first 24 tokens
    assert pc.match(a)[0] == 0 and pc.held == 24
    pc.clear()
    assert pc.match(list(range(200, 210)))[0] == 0 and pc.held == 0


def test_device_sampling_reports_each_rows_processed_distribution():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=gen) * 3
    rows = [
        RowSampling(0.0, -1, 1.0),
        RowSampling(0.7, 5, 1.0),
        RowSampling(1.3, -1, 0.8),
        RowSampling(1.0, 10, 0.6),
        RowSampling(0.0, 3, 0.5),  # greedy ignores top-k and top-p
    ]
    u = [0.0, 0.3, 0.9, 0.5, 0.0]
    picks = sample_rows(logits, rows, u)
    for i, r in enumerate(rows):
        lp = process_logits(logits[i], SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p))
        tok = int(picks[0, i])
        assert math.isfinite(lp[tok].item()) and math.isclose(picks[1, i].item(), lp[tok].item(), abs_tol=1e-6)
        cdf = lp.exp().double().cumsum(0)
        want = int(torch.searchsorted(cdf, u[i] * cdf[-1], right=True)) if r.temperature else int(lp.argmax())
        assert tok == want
    greedy_only = sample_rows(logits, [RowSampling(0.0, -1, 1.0)] * 5, [0.0] * 5)
    assert greedy_only[0].long().tolist() == logits.argmax(-1).tolist()
    want_lp = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(greedy_only[1].float(), want_lp, atol=1e-6)


def test_options_are_checked_and_max_model_len_bounds_a_sequence(lively):
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        TorchEngine(lively, kv_cache="paged")
    with pytest.raises(ValueError, match=r"\['prefix_cache_tokens'\].*kv_cache: dynamic"):
        TorchEngine(lively, kv_cache="dynamic", prefix_cache_tokens=10)
    engine = TorchEngine(lively, max_model_len=12)
    with pytest.raises(ValueError, match="max_model_len=12"):
        engine.add_request(EngineRequest("long", list(range(12)), greedy(3)))
    engine.add_request(EngineRequest("fits", list(range(8)), greedy(10)))
    out = drive(engine, [[]])[0]["fits"]
    assert out[2] == "length" and len(out[0]) == 12 - 8  # prompt + answer fill max_model_len exactly
    assert engine.cache.capacity == 12


def test_an_architecture_outside_the_static_path_runs_on_the_dynamic_cache(tmp_path):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    engine = TorchEngine(str(tmp_path / "gpt2"))
    assert isinstance(engine, DynamicCacheTorchEngine)
    engine.add_request(EngineRequest("g", [1, 2, 3], greedy(4)))
    assert len(drive(engine, [[]])[0]["g"][0]) == 4
    with pytest.raises(ValueError, match="model type 'gpt2'"):
        TorchEngine(str(tmp_path / "gpt2"), kv_cache="static")


def test_torch_engine_options_are_checked_with_the_config_and_match_the_engines_defaults():
    import inspect

    from rollart.engines.torch_options import TorchEngineOptions
    from rollart.rollout.config import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig(kind="torch", options={"max_batch_size": 0, "prefix_cache_tokns": 10})
    assert "engine.options.max_batch_size: Input should be greater than or equal to 1" in str(err.value)
    assert "engine.options.prefix_cache_tokns: not an option of the torch engine; did you mean" in str(err.value)
    with pytest.raises(ValueError) as err:  # strict types, as in every config section
        EngineConfig(kind="torch", options={"max_batch_size": 2.0, "cuda_graphs": "yes"})
    assert "engine.options.max_batch_size: expects an integer, got 2.0" in str(err.value)
    assert "engine.options.cuda_graphs: expects true or false, got the string 'yes'" in str(err.value)
    with pytest.raises(ValueError, match=r"\['max_prefill_tokens'\]: options of the static-cache torch engine"):
        EngineConfig(kind="torch", options={"kv_cache": "dynamic", "max_prefill_tokens": 64})
    EngineConfig(kind="vllm", options={"max_prefill_tokens": 64})  # other engines' options are theirs
    defaults = {k: p.default for k, p in inspect.signature(TorchEngine.__init__).parameters.items() if k != "self"}
    for name, field in TorchEngineOptions.model_fields.items():
        if name not in ("device", "dtype"):  # the worker's device; dtype given by name in a config
            assert defaults[name] == field.default, name
    assert set(defaults) - {"model_path"} == set(TorchEngineOptions.model_fields)


async def test_the_inference_workers_metrics_count_prefilled_tokens_and_prefix_cache_hits(lively):
    import logging

    from rollart.rollout.inference_worker import InferenceWorker
    from rollart.rollout.types import GenerateRequest

    worker = InferenceWorker({"kind": "torch", "model": lively, "options": {"device": "cpu"}})
    worker.rank, worker.hardware = 0, "CPU"
    worker.logger = logging.LoggerAdapter(logging.getLogger("test.engine"), {})
    prompt = list(range(10, 40))
    for turn in range(2):
        out = await worker.generate(
            GenerateRequest(request_id=f"t{turn}", prompt_token_ids=prompt, sampling=greedy(5)), "*"
        )
        prompt = prompt + out.output_token_ids + [3, 4, 5]
    stats = (await worker.metrics())["engine_stats"]
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_hit_tokens"] == 30 + 5 - 1
    # turn 1 prefilled its last answer token (never fed back in turn 0) and the 3 new ones
    assert stats["prefill_tokens"] == 30 + (1 + 3) and stats["decode_tokens"] == 2 * 4


def test_a_fused_step_that_fails_to_compile_runs_unfused(caplog):
    from rollart.models.decoder import _Pointwise, silu_mul

    def no_compiler(*args):
        raise RuntimeError("no C compiler")

    ops = _Pointwise()
    ops.silu_mul = ops._guarded("silu_mul", no_compiler, silu_mul)
    x = torch.linspace(-2, 2, 8)
    assert torch.equal(ops.silu_mul(x, x), silu_mul(x, x))
    assert ops.silu_mul is silu_mul  # from then on the plain step, without trying again
    assert "torch.compile of the decoder's silu_mul failed" in caplog.text
