"""The key/value cache argument across transformers versions (rollart.models.kv_cache): the engine's
decode and the shared-prefix training pass use the name the installed transformers takes, so they
keep working when the deprecated ``past_key_values`` goes away (transformers 5.40)."""

import functools
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollart.engines.base import EngineRequest, SamplingParams
from rollart.engines.torch_engine import TorchEngine
from rollart.models import build_tiny
from rollart.models.kv_cache import cache_kwargs, output_cache
from rollart.training.shared_prefix import SharedPrefixForward, shared_layout, shared_token_logprobs


class NewStyle(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return input_ids


def keep_signature(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class OldStyle(torch.nn.Module):
    @keep_signature  # decorated, as transformers' forwards are
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return input_ids


class Output:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_the_cache_goes_by_the_name_the_forward_takes():
    assert cache_kwargs(NewStyle(), "kv") == {"cache": "kv"}
    assert cache_kwargs(OldStyle(), "kv") == {"past_key_values": "kv"}
    compiled = torch.nn.Module()
    compiled._orig_mod = OldStyle()  # what torch.compile's wrapper holds
    assert cache_kwargs(compiled, "kv") == {"past_key_values": "kv"}
    assert output_cache(Output(cache="new", past_key_values="old")) == "new"
    assert output_cache(Output(past_key_values="old")) == "old"


def test_decode_and_shared_prefix_passes_raise_no_cache_deprecation(tmp_path):
    tiny = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = TorchEngine(tiny)
        engine.add_request(EngineRequest("r0", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4)))
        done = []
        while engine.has_unfinished():
            done += engine.step()
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        rows = [[5, 6, 7, 8, 9], [5, 6, 7, 10]]
        layout = shared_layout(rows, [3, 3])
        shared_token_logprobs(SharedPrefixForward(model), layout, 5)
    assert [len(o.output_token_ids) for o in done] == [4]
    cache_warnings = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert cache_warnings == []


def test_a_peft_model_passes_the_cache_under_its_base_models_name(tmp_path):
    peft = pytest.importorskip("peft")
    tiny = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=2))
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_kwargs(wrapped, "kv") == cache_kwargs(base, "kv")
