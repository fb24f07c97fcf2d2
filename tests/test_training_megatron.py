"""The megatron-core strategy on CPU: HF <-> megatron weight conversion is exact, megatron's GPTModel
computes the Hugging Face model's logits, and a MegatronTrainWorker step equals a TorchTrainWorker step
(same loss and metrics, same updated weights) on a real local Ray, single rank and two DDP ranks.

Needs ``megatron-core`` (0.16.1 tested); skipped without it. The CPU patches are applied by a fixture
here and by the worker itself on CPU (see rollart/training/megatron_strategy.py)."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

import rollart as ra
from rollart.models import build_tiny
from rollart.resource_manager.net import free_port
from rollart.training import columns as C
from rollart.training.megatron_strategy import (
    MegatronConfig,
    MegatronTrainWorker,
    build_gpt_model,
    cpu_patches,
    gpt_logits,
    hf_to_megatron,
    init_megatron_parallel,
    megatron_to_hf,
)
from rollart.training.torch_strategy import TorchTrainWorker

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen2 (q/k/v biases, tied embeddings, RMSNorm, SwiGLU, RoPE, 4 heads / 2 KV groups)."""
    return str(build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, intermediate_size=64, seed=3))


@pytest.fixture(scope="module")
def megatron_cpu():
    """A one-rank gloo group and megatron's parallel state in this process, with the CPU patches."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    init_megatron_parallel(backend="gloo")
    with cpu_patches():
        yield
    parallel_state.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_same_state(a, b, **tol):
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        if tol:
            torch.testing.assert_close(a[k], b[k], msg=k, **tol)
        else:
            assert torch.equal(a[k], b[k]), k


def test_cpu_patches_are_explicit_and_undone():
    import subprocess
    import sys

    from megatron.core import utils as mcore_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as mcore_random

    from rollart.training import megatron_strategy as ms

    # importing the strategy imports no megatron module, so it cannot patch anything
    code = "import sys, rollart.training.megatron_strategy; print(any(m.startswith('megatron') for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    before = (
        RotaryEmbedding.__dict__["get_emb"],
        mcore_utils.GlobalMemoryBuffer.__dict__["get_tensor"],
        mcore_random._CUDA_RNG_STATE_TRACKER,
    )
    with cpu_patches():
        assert RotaryEmbedding.__dict__["get_emb"] is ms._cpu_get_emb
        assert mcore_utils.GlobalMemoryBuffer.__dict__["get_tensor"] is ms._cpu_get_tensor
        with mcore_random.get_cuda_rng_tracker().fork():  # no torch.cuda RNG involved
            pass
    assert (
        RotaryEmbedding.__dict__["get_emb"],
        mcore_utils.GlobalMemoryBuffer.__dict__["get_tensor"],
        mcore_random._CUDA_RNG_STATE_TRACKER,
    ) == before


def test_hf_megatron_round_trip_is_exact(tiny, megatron_cpu):
    hf = hf_model(tiny)
    state = hf.state_dict()
    meg = hf_to_megatron(state, hf.config)
    gpt_names = [k for k in build_gpt_model(hf.config).state_dict() if not k.endswith("_extra_state")]
    assert sorted(meg) == sorted(gpt_names)  # exactly the GPTModel's (local spec) weights
    assert "output_layer.weight" not in meg  # tied: the output layer reads the embedding
    assert meg["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (4 * 8 + 2 * 2 * 8, 32)
    assert_same_state(megatron_to_hf(meg, hf.config), state)  # keys in HF order, values bit-exact
    assert_same_state(hf_to_megatron(megatron_to_hf(meg, hf.config), hf.config), meg)
    fused = hf_to_megatron(state, hf.config, fused_norms=True)  # Transformer-Engine spec names
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused
    assert_same_state(megatron_to_hf(fused, hf.config), state)


def test_round_trip_with_untied_embeddings_and_interleaved_heads(megatron_cpu):
    """Untied output layer; each row labelled so a wrong q/k/v interleaving cannot go unnoticed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    state = {k: torch.randn_like(v) for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}
    hd = 4
    state["model.layers.0.self_attn.q_proj.bias"] = torch.arange(6 * hd, dtype=torch.float32)
    state["model.layers.0.self_attn.k_proj.bias"] = 100 + torch.arange(2 * hd, dtype=torch.float32)
    state["model.layers.0.self_attn.v_proj.bias"] = 200 + torch.arange(2 * hd, dtype=torch.float32)
    meg = hf_to_megatron(state, cfg)
    qkv_bias = meg["decoder.layers.0.self_attention.linear_qkv.bias"].view(2, 5, hd)[:, :, 0]
    # per query group: its 3 query heads, then its key head, then its value head
    assert qkv_bias.tolist() == [[0, 4, 8, 100, 200], [12, 16, 20, 104, 204]]
    assert torch.equal(meg["output_layer.weight"], state["lm_head.weight"])
    assert sorted(meg) == sorted(k for k in build_gpt_model(cfg).state_dict() if not k.endswith("_extra_state"))
    assert_same_state(megatron_to_hf(meg, cfg), state)
    with pytest.raises(KeyError, match="no megatron name"):
        hf_to_megatron({**state, "model.layers.0.mystery.weight": torch.zeros(1)}, cfg)


def test_megatron_logits_equal_hf_logits(tiny, megatron_cpu):
    hf = hf_model(tiny)
    gpt = build_gpt_model(hf.config)
    gpt.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config), strict=False)
    gpt.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, as the trainer's micro-batches have
    mask[2, 5:] = 0
    with torch.no_grad():
        ours = gpt_logits(gpt, ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    assert ours.shape == theirs.shape == (3, 13, hf.config.vocab_size)
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-4, rtol=1e-4)


def batch_of(n: int, vocab: int) -> ra.Batch:
    g = torch.Generator().manual_seed(0)
    ids, masks, adv, old, ref = [], [], [], [], []
    for i in range(n):
        length = 5 + i % 6
        ids.append(torch.randint(3, vocab, (length,), generator=g).tolist())
        masks.append([0, 0] + [1] * (length - 2))
        adv.append([float((-1) ** i) * (1 + i / n)] * length)
        old.append((-3 - torch.rand(length, generator=g)).tolist())
        ref.append((-3 - torch.rand(length, generator=g)).tolist())
    return ra.Batch(
        {C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: old, C.REF_LOGPROBS: ref}
    )


def test_parallel_sizes_above_one_are_refused_before_any_actor(tiny):
    from pydantic import ValidationError

    from rollart.training.config import TrainConfig

    with pytest.raises(ValidationError, match="train.tensor_parallel is implemented for train.strategy: torch only"):
        MegatronConfig.model_validate({"model": tiny, "tensor_parallel": 2})
    with pytest.raises(ValidationError, match="pipeline_parallel=3: pipeline parallelism is not built"):
        TrainConfig.model_validate({"pipeline_parallel": 3})
    assert MegatronConfig().strategy == "megatron"


def test_train_step_matches_the_torch_strategy(make_rm, tiny, tmp_path):
    """Two PPO epochs (the second sees a ratio != 1), KL to a reference, an entropy bonus, grad clipping,
    three micro-batches: metrics and updated weights as the torch strategy's; then checkpoints and
    publishing in Hugging Face names; then two DDP ranks equal one rank."""
    import ray

    from rollart.weights.ray_channel import RayObjectChannel

    cfg = {
        "model": tiny,
        "lr": 1e-2,
        "loss": "ppo",
        "ppo_epochs": 2,
        "max_tokens_per_microbatch": 24,
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "grad_clip": 0.5,
        "seed": 7,
    }
    rm = make_rm(
        {
            "meg": {"hardware": "CPU", "cpus": 1},
            "torch": {"hardware": "CPU", "cpus": 1},
            "megdp": {"hardware": "CPU", "cpus": 2},
        }
    )
    meg = ra.Cluster("meg", MegatronTrainWorker, rm, pool="meg", worker_kwargs={"config": cfg})
    # the megatron strategy trains padded: the torch one too, so their micro-batches (and the metrics
    # averaged over them) are the same
    tch_cfg = {**cfg, "packing": False}
    tch = ra.Cluster("torch", TorchTrainWorker, rm, pool="torch", worker_kwargs={"config": tch_cfg})
    assert meg.setup_distributed("127.0.0.1", free_port()) == ["single"]
    batch = batch_of(8, vocab=200)

    before_meg, before_tch = meg.compute_logprobs(batch), tch.compute_logprobs(batch)
    for a, b in zip(before_meg, before_tch):
        assert a == pytest.approx(b, abs=1e-5)
    m_meg, m_tch = meg.train_step(batch), tch.train_step(batch)  # {metric: [one value per rank]}
    assert set(m_meg) == set(m_tch) and m_meg["microbatches"] == [3.0]
    for k in m_tch:
        assert m_meg[k] == pytest.approx(m_tch[k], rel=1e-4, abs=1e-5), k
    w_meg, w_tch = ({k: v for part in ray.get(c.snapshot_weights()) for k, v in part.items()} for c in (meg, tch))
    w_tch.setdefault("lm_head.weight", w_tch["model.embed_tokens.weight"])  # the tied head goes once
    assert_same_state(w_meg, w_tch, atol=5e-5, rtol=1e-4)  # HF names, as an inference engine loads them
    assert meg.weight_checksum()[0] == pytest.approx(tch.weight_checksum()[0], rel=1e-5)
    hf_model(tiny).load_state_dict(w_meg, strict=True)  # loads into the Hugging Face model unchanged
    channel = RayObjectChannel("megatron-test")
    assert meg.publish_to(channel, wait=False) == 1
    meg.wait_published()
    assert_same_state(channel.fetch(1), w_meg)
    for a, b in zip(meg.compute_logprobs(batch), tch.compute_logprobs(batch)):
        assert a == pytest.approx(b, abs=1e-4)

    ckpt = str(tmp_path / "meg.pt")
    meg.save_checkpoint(ckpt, {"step": 1})
    saved = meg.weight_checksum()[0]
    meg.train_step(batch)
    assert meg.load_checkpoint(ckpt) == [{"version": 1, "extra": {"step": 1}}]
    assert meg.weight_checksum()[0] == pytest.approx(saved, rel=1e-7)

    dp = ra.Cluster("megdp", MegatronTrainWorker, rm, pool="megdp", worker_kwargs={"config": cfg})
    assert dp.setup_distributed("127.0.0.1", free_port()) == ["gloo", "gloo"]
    dp_metrics = dp.train_step(batch)  # 4 rows a rank; gradients weighted to the global token mean
    assert dp_metrics["rows"] == [4.0, 4.0]
    sums = dp.weight_checksum()
    assert sums[0] == pytest.approx(sums[1], rel=1e-6)
    assert sums[0] == pytest.approx(saved, rel=1e-5)  # the same step as one rank on the whole batch


def test_pipeline_trains_with_the_megatron_strategy_and_resumes(ray_local, tmp_path):
    """``train.strategy: megatron`` in a pipeline config: the actor is a MegatronTrainWorker, the
    inference engines load the HF-named weights it publishes, and a checkpoint (megatron names) resumes."""
    from test_pipeline import small_config

    from rollart.pipelines.agentic import AgenticPipeline

    cfg = small_config(tmp_path, steps=2, checkpoint_every=2, train={"lr": 0.001, "strategy": "megatron"})
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        assert pipe.train.worker_cls.__name__ == "MegatronTrainWorker"
        history = pipe.run()
        versions = [w["weight_version"] for w in pipe.infer.metrics().result()]
        trained = pipe.train.weight_checksum()[0]
    finally:
        pipe.shutdown()
    assert [h["version"] for h in history] == [1, 2] and versions == [2]
    assert all(h["tokens"] > 0 and h["max_staleness"] <= cfg.rollout.alpha for h in history)

    pipe = AgenticPipeline(
        small_config(tmp_path, steps=3, checkpoint_every=2, train={"lr": 0.001, "strategy": "megatron"}),
        resume=True,
        progress=False,
    )
    try:
        assert pipe.start_step == 2
        assert pipe.train.weight_checksum()[0] == trained  # the checkpoint restored the trained weights
        more = pipe.run()
    finally:
        pipe.shutdown()
    assert [h["step"] for h in more] == [3] and more[0]["version"] == 3
