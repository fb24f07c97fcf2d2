"""The built-in torch engine against Hugging Face generate, on the tiny model built offline."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.torch_engine import TorchEngine
from rollart.models import build_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, seed=3))


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def run_all(engine):
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    return done


def greedy(n):
    return SamplingParams(temperature=0, max_new_tokens=n)


def test_tiny_model_loads_offline_and_every_letter_and_digit_is_one_token(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.model_type == "qwen2"
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789":
        assert len(tok.encode(ch, add_special_tokens=False)) == 1, ch
    text = "xyz=zyx 12+34=46"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text


@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_greedy_equals_hf_generate_with_staggered_adds(tiny, kv_cache):
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31]]
    refs = [hf_greedy(model, p, 10) for p in prompts]
    engine = TorchEngine(tiny, kv_cache=kv_cache)
    engine.add_request(EngineRequest("r0", prompts[0], greedy(10)))
    engine.add_request(EngineRequest("r1", prompts[1], greedy(10)))
    engine.step()
    engine.step()
    engine.add_request(EngineRequest("r2", prompts[2], greedy(10)))  # joins a running batch
    engine.step()
    engine.add_request(EngineRequest("r3", prompts[3], greedy(10)))
    done = run_all(engine)
    assert [done[f"r{i}"].output_token_ids for i in range(4)] == refs
    assert all(done[f"r{i}"].finish_reason == "length" for i in range(4))


@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_abort_mid_generation_keeps_partial_tokens_and_resume_matches_uninterrupted(tiny, kv_cache):
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompt = [11, 12, 13]
    ref = hf_greedy(model, prompt, 12)
    engine = TorchEngine(tiny, kv_cache=kv_cache)
    engine.add_request(EngineRequest("a", prompt, greedy(12)))
    engine.add_request(EngineRequest("b", [40, 41], greedy(6)))
    for _ in range(5):
        engine.step()
    partial = engine.abort("a")
    assert partial.finish_reason == "abort" and partial.output_token_ids == ref[:5]
    rest = run_all(engine)
    assert rest["b"].finish_reason == "length" and len(rest["b"].output_token_ids) == 6  # b kept going
    engine.add_request(EngineRequest("a2", prompt + partial.output_token_ids, greedy(12 - 5)))
    resumed = run_all(engine)["a2"]
    assert partial.output_token_ids + resumed.output_token_ids == ref


def test_stop_ids_and_logprobs_match_a_direct_forward_pass(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompt = [7, 8, 9]
    ref = hf_greedy(model, prompt, 6)
    engine = TorchEngine(tiny)
    engine.add_request(
        EngineRequest("s", prompt, SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[ref[2]]))
    )
    out = run_all(engine)["s"]
    assert out.finish_reason == "stop" and out.output_token_ids == ref[: ref.index(ref[2]) + 1]
    engine.add_request(EngineRequest("t", prompt, SamplingParams(temperature=0.7, max_new_tokens=5, seed=1)))
    sampled = run_all(engine)["t"]
    with torch.no_grad():
        seq = torch.tensor([prompt + sampled.output_token_ids])
        logits = model(seq).logits[0].float()
    for i, tok in enumerate(sampled.output_token_ids):
        expected = torch.log_softmax(logits[len(prompt) - 1 + i] / 0.7, dim=-1)[tok].item()
        assert math.isclose(sampled.output_logprobs[i], expected, abs_tol=1e-4)


def test_seeded_sampling_is_reproducible(tiny):
    engine = TorchEngine(tiny)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8, seed=42)
    engine.add_request(EngineRequest("x", [3, 4], params))
    engine.add_request(EngineRequest("y", [3, 4], params))
    done = run_all(engine)
    assert done["x"].output_token_ids == done["y"].output_token_ids


def test_update_weights_changes_outputs_and_a_bad_state_dict_is_refused(tiny):
    engine = TorchEngine(tiny)
    engine.add_request(EngineRequest("before", [5, 6], greedy(8)))
    before = run_all(engine)["before"].output_token_ids
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="refused"):
        engine.update_weights({"not.a.weight": torch.zeros(1)}, version=1)
    assert engine.weight_version == 0
    torch.manual_seed(0)
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in state.items()}
    engine.update_weights(new, version=1)
    engine.add_request(EngineRequest("after", [5, 6], greedy(8)))
    after = run_all(engine)["after"]
    assert engine.weight_version == 1 and after.weight_version == 1 and after.output_token_ids != before


def test_a_seeded_request_samples_the_same_alone_or_in_any_batch(tiny):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
    engine = TorchEngine(tiny)
    engine.add_request(EngineRequest("alone", [3, 4, 5], params))
    alone = run_all(engine)["alone"].output_token_ids
    engine.add_request(EngineRequest("a", [9, 9], SamplingParams(temperature=1.0, max_new_tokens=6)))
    engine.add_request(EngineRequest("b", [6, 7, 8, 9], params.model_copy(update={"seed": 8})))
    engine.add_request(EngineRequest("again", [3, 4, 5], params))
    assert run_all(engine)["again"].output_token_ids == alone


def test_seeded_samples_follow_the_processed_distribution(tiny):
    # 600 seeds, one token each, from a top-5 distribution: empirical frequencies near the probabilities
    params = SamplingParams(temperature=2.0, top_k=5, max_new_tokens=1)
    prompt = [5, 6, 7]
    engine = TorchEngine(tiny)
    for s in range(600):
        engine.add_request(EngineRequest(f"r{s}", prompt, params.model_copy(update={"seed": s})))
    toks = [o.output_token_ids[0] for o in run_all(engine).values()]
    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float() / 2.0
    top = torch.topk(logits, 5)
    probs = torch.softmax(top.values, -1)
    assert set(toks) <= set(top.indices.tolist())
    tv = 0.5 * sum(abs(toks.count(int(t)) / len(toks) - float(p)) for t, p in zip(top.indices, probs))
    assert tv < 0.08


def direct_logprobs(model, prompt, tokens):
    """log p(token_i) of a greedy continuation, from one forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_joins_and_leaves_never_prefill_running_rows_and_outputs_stay_exact(tiny):
    """Requests join a running batch, leave it (finished, stopped, aborted) and a group of identical
    prompts is prefilled once: every greedy output equals HF generate, every logprob a direct forward
    pass, and the engine prefilled only the joining sequences (each distinct one once)."""
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    group = [5, 6, 7, 8]
    long = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    plan = {  # request id: (prompt, max_new_tokens)
        "g0": (group, 9),
        "g1": (group, 3),
        "g2": (group, 6),
        "x": ([20, 21], 7),
        "late": (long, 5),
        "late2": ([30], 4),
        "g3": (group, 4),
    }
    refs = {rid: hf_greedy(model, p, n) for rid, (p, n) in plan.items()}
    engine = TorchEngine(tiny)
    add = lambda rid: engine.add_request(EngineRequest(rid, plan[rid][0], greedy(plan[rid][1])))
    for rid in ("g0", "g1", "g2", "x"):
        add(rid)
    done = {}
    for o in engine.step():  # one prefill: the group's prompt once, x once
        done[o.request_id] = o
    assert engine.stats["prefill_tokens"] == len(group) + 2 and engine.stats["shared_prefill_rows"] == 2
    for o in engine.step() + engine.step():
        done[o.request_id] = o
    add("late")  # joins while g0, g2 and x run; g1 has just left
    stop = refs["x"][4]
    engine.add_request(
        EngineRequest("stopper", [20, 21], SamplingParams(temperature=0, max_new_tokens=7, stop_token_ids=[stop]))
    )
    for o in engine.step():
        done[o.request_id] = o
    partial = engine.abort("g2")  # leaves from the middle of the cache
    add("late2")
    add("g3")
    done.update(run_all(engine))
    assert partial is not None and partial.output_token_ids == refs["g2"][: len(partial.output_token_ids)]
    for rid in ("g0", "g1", "x", "late", "late2", "g3"):
        assert done[rid].output_token_ids == refs[rid], rid
        assert done[rid].finish_reason == "length"
        expected = direct_logprobs(model, plan[rid][0], refs[rid])
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(done[rid].output_logprobs, expected)), rid
    assert done["stopper"].finish_reason == "stop"
    assert done["stopper"].output_token_ids == refs["x"][: refs["x"].index(stop) + 1]
    # prefilled: the first join, then late + stopper, then late2 + g3 — running rows never again; g3 found
    # the group's prompt in the prefix cache (g1 had finished) and prefilled only its last token
    assert engine.stats["prefix_cache_hits"] == 1 and engine.stats["prefix_cache_hit_tokens"] == len(group) - 1
    assert engine.stats["prefill_tokens"] == (len(group) + 2) + (len(long) + 2) + (1 + 1)
    assert engine.stats["prefill_forwards"] == 3
    assert not engine.has_unfinished() and engine.num_running == 0


def test_a_full_batch_queues_the_rest_and_a_weight_update_prefills_running_rows_again(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompts = [[5 + i, 6 + i] for i in range(5)]
    refs = [hf_greedy(model, p, 4) for p in prompts]
    engine = TorchEngine(tiny, max_batch_size=2)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, greedy(4)))
    engine.step()
    assert engine.num_running == 2
    engine.update_weights(model.state_dict(), 1)  # same weights: outputs unchanged, rows recomputed
    done = run_all(engine)
    assert [done[f"r{i}"].output_token_ids for i in range(5)] == refs
    assert engine.stats["prefill_tokens"] == 2 * 5 + 2 * 3  # r0, r1 again with their first token


def test_prefix_sharing_samples_each_row_independently(tiny):
    """The n samples of one prompt share its prefill but not their draws: different seeds differ."""
    engine = TorchEngine(tiny)
    for i in range(8):
        engine.add_request(EngineRequest(f"s{i}", [5, 6, 7], SamplingParams(temperature=1.5, max_new_tokens=6, seed=i)))
    done = run_all(engine)
    assert engine.stats["prefill_tokens"] == 3 and engine.stats["shared_prefill_rows"] == 7
    assert len({tuple(o.output_token_ids) for o in done.values()}) > 1
    alone = TorchEngine(tiny, prefix_sharing=False)
    alone.add_request(EngineRequest("s3", [5, 6, 7], SamplingParams(temperature=1.5, max_new_tokens=6, seed=3)))
    assert run_all(alone)["s3"].output_token_ids == done["s3"].output_token_ids


@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_streaming_requests_report_each_steps_tokens_and_the_others_none(tiny, kv_cache):
    """A streaming request's deltas, step by step, are a prefix of its final output (tokens, log-probs
    and top log-probs, each position once); a request that does not stream is never reported."""
    engine = TorchEngine(tiny, kv_cache=kv_cache)
    sampling = SamplingParams(temperature=0.8, seed=5, max_new_tokens=9, top_logprobs=2)
    engine.add_request(EngineRequest("s", [5, 6, 7], sampling, stream=True))
    engine.add_request(EngineRequest("quiet", [8, 9], greedy(12)))
    got: dict[str, list] = {"ids": [], "lps": [], "top": []}
    per_step = []
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
        deltas = engine.take_deltas()
        assert all(d.request_id == "s" for d in deltas)
        for d in deltas:
            assert d.start == len(got["ids"])  # contiguous: no position repeated or skipped
            got["ids"] += d.token_ids
            got["lps"] += d.logprobs
            got["top"] += d.top_logprobs
        per_step.append(sum(len(d.token_ids) for d in deltas))
    final = done["s"]
    assert len(final.output_token_ids) == 9
    assert got["ids"] == final.output_token_ids[:8]  # the last step's token comes with the output only
    assert got["lps"] == final.output_logprobs[:8] and got["top"] == final.output_top_logprobs[:8]
    assert per_step[:8] == [1] * 8  # one token per step, reported after the step that decoded it
    # the same request without streaming samples the same tokens (streaming changes nothing it computes;
    # alone, not beside another row, its log-probs may differ in the last float bits)
    engine.add_request(EngineRequest("s2", [5, 6, 7], sampling))
    again = run_all(engine)["s2"]
    assert engine.take_deltas() == []
    assert again.output_token_ids == final.output_token_ids
    assert again.output_logprobs == pytest.approx(final.output_logprobs, abs=1e-4)
