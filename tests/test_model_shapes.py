"""Real model shapes with random weights (``model: {shape: qwen2.5-0.5b}``), built offline."""

import json

import pytest
import torch

from rollart.config import ConfigError, validate_config
from rollart.models.shapes import SHAPES, ShapeConfig, load_causal_lm, shape_folder, weight_shapes

BASE = {
    "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
    "envs": [{"name": "reverse", "groups": 8}],
}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLART_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize(("shape", "params"), [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)])
def test_shapes_have_the_published_parameter_counts(shape, params):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert SHAPES[shape].params() == params  # Qwen2.5's model cards: 0.49B and 1.54B
    config = AutoConfig.from_pretrained(str(shape_folder(shape)))
    with torch.device("meta"):  # the architecture transformers builds from the folder, without memory
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params


def test_a_config_naming_a_shape_gets_its_architecture_and_a_tokenizer():
    from transformers import AutoTokenizer

    cfg = validate_config({**BASE, "model": {"shape": "qwen2.5-0.5b"}})
    config = json.loads((shape_folder("qwen2.5-0.5b") / "config.json").read_text())
    assert cfg.model == str(shape_folder("qwen2.5-0.5b"))
    numbers = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")}
    assert numbers == {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14}
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (2, 4864, 151936)
    assert config["tie_word_embeddings"] is True and config["model_type"] == "qwen2"
    assert config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta")) == 1_000_000.0
    assert not list(shape_folder("qwen2.5-0.5b").glob("*.safetensors"))  # nothing downloaded, no weights stored
    tok = AutoTokenizer.from_pretrained(cfg.model)
    text = "reverse: abc="
    assert tok.decode(tok(text)["input_ids"]) == text and tok.chat_template


def test_an_unknown_shape_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as err:
        validate_config({**BASE, "model": {"shape": "llama-7b"}})
    assert err.value.problems == [
        "model.shape: unknown shape 'llama-7b'; the known shapes are qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b"
    ]
    with pytest.raises(ConfigError, match=r"model.layers: Input should be greater than or equal to 1"):
        validate_config({**BASE, "model": {"shape": "qwen2.5-0.5b", "layers": 0}})
    with pytest.raises(ConfigError, match=r"model.shape: required"):
        validate_config({**BASE, "model": {"layers": 2}})


def test_random_weights_are_seeded_and_every_loader_builds_the_same():
    from rollart.training.megatron_weights import load_hf_state_dict

    path = shape_folder({"shape": "qwen2.5-0.5b", "layers": 1})
    a, b = load_causal_lm(path), load_causal_lm(path)
    assert sum(p.numel() for p in a.parameters()) == ShapeConfig(shape="qwen2.5-0.5b", layers=1).params()
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, as the architecture
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    q = a.model.layers[0].self_attn.q_proj.requires_grad_(False)
    assert 0.018 < float(q.weight.std()) < 0.022 and float(q.bias.abs().max()) == 0.0  # init std 0.02, biases 0
    assert float(a.model.norm.weight.detach().min()) == 1.0
    megatron = load_hf_state_dict(path)  # the megatron strategy's loader
    assert torch.equal(megatron["model.layers.0.mlp.up_proj.weight"], a.model.layers[0].mlp.up_proj.weight)
    other = load_causal_lm(shape_folder({"shape": "qwen2.5-0.5b", "layers": 1, "seed": 1}))
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight, a.model.layers[0].mlp.up_proj.weight)
    assert set(weight_shapes(path)) == set(a.state_dict()) - {"lm_head.weight"}  # what vLLM checks updates against
    with torch.no_grad():
        logits = a(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 151936) and bool(torch.isfinite(logits).all())


def test_streamed_shape_weights_equal_the_built_models():
    """A sharded trainer fills its shards from the streamed weights, an unsharded one builds the model: both
    start from the same numbers."""
    from rollart.models.streaming import iter_weights

    path = shape_folder({"shape": "qwen2.5-0.5b", "layers": 1})
    built = load_causal_lm(path).state_dict()
    streamed = dict(iter_weights(path))
    assert streamed and set(streamed) <= set(built)
    for name, t in streamed.items():
        assert torch.equal(t, built[name]), name
