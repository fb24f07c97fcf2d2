"""Precision, memory and adapters on the built-in tiny model (in-process, no Ray): bf16 autocast,
gradient checkpointing, LoRA; checkpoint folders (safetensors + weights-only trainer state, keep-K,
earlier single-file format) and the Hugging Face export that ``from_pretrained`` loads."""

import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import rollart as ra
from rollart.cluster.worker import WorkerContext, host_class
from rollart.models import build_tiny
from rollart.training import columns as C
from rollart.training.checkpoint_io import (
    commit_checkpoint,
    latest_checkpoint,
    save_checkpoint_file,
    step_dir,
)
from rollart.training.config import TrainConfig
from rollart.training.export import export_run
from rollart.training.torch_strategy import TorchTrainWorker

pytestmark = pytest.mark.timeout(300)
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ops") / "tiny"
    return str(build_tiny(path, hidden_size=32, num_layers=2, intermediate_size=64, seed=3))


def local_worker(**config):
    ctx = WorkerContext(cluster="local", job_id="test", rank=0, world_size=1, pool=None, hardware="CPU")
    return host_class(TorchTrainWorker)(ctx, (), {"config": config})


def batch_of(n: int, seed: int = 0) -> ra.Batch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, behaviour = [], [], [], []
    for i in range(n):
        length = 5 + i % 4
        ids.append(torch.randint(3, 60, (length,), generator=g).tolist())
        masks.append([0, 0] + [1] * (length - 2))
        adv.append([float((-1) ** i) * (1 + i / n)] * length)
        behaviour.append([0.0, 0.0] + (-4.0 - torch.rand(length - 2, generator=g)).tolist())
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: behaviour})


def logits(model, ids=((1, 5, 9, 12, 7, 3),)):
    x = torch.tensor(ids)
    with torch.no_grad():
        return model(input_ids=x, attention_mask=torch.ones_like(x)).logits


def test_bf16_step_is_finite_and_keeps_fp32_master_weights(tiny):
    worker = local_worker(model=tiny, dtype="bf16", lr=1e-2, max_tokens_per_microbatch=24)
    before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    m = worker.train_step(batch_of(8))
    assert all(math.isfinite(v) for v in m.values()) and m["grad_norm"] > 0 and m["entropy"] > 0
    assert all(p.dtype == torch.float32 for p in worker.module.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in worker.module.named_parameters())
    seen = []
    worker.module.model.layers[0].mlp.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    worker.compute_logprobs(batch_of(2))
    assert seen == [torch.bfloat16]  # the passes really run in bf16


def test_gradient_checkpointing_gives_the_same_gradients(tiny):
    cfg = {"model": tiny, "lr": 1e-2, "grad_clip": None, "max_tokens_per_microbatch": 24}
    # the plain worker runs whole rows (no prefix sharing, which checkpointing turns off too)
    plain = local_worker(**cfg, prefix_sharing=False)
    ckpt = local_worker(**cfg, gradient_checkpointing=True)
    recomputed = []
    for w in (plain, ckpt):  # count the MLP's forward calls (module hooks do not see the recomputation)
        mlp = w.module.model.layers[0].mlp
        mlp.forward = lambda *a, w=w, f=mlp.forward, **k: (recomputed.append(w is ckpt), f(*a, **k))[1]
    m_plain, m_ckpt = plain.train_step(batch_of(8)), ckpt.train_step(batch_of(8))
    assert m_plain["microbatches"] > 1
    # with checkpointing the layer's forward runs again in the backward pass
    assert recomputed.count(True) == 2 * recomputed.count(False) > 0
    for (name, p), q in zip(plain.module.named_parameters(), ckpt.module.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert m_ckpt["entropy"] == pytest.approx(m_plain["entropy"], rel=1e-5)


def test_lora_trains_only_the_adapters_and_syncs_and_exports_merged_weights(tiny, tmp_path):
    pytest.importorskip("peft", reason="the lora extra is not installed (pip install 'rollart[lora]')")
    worker = local_worker(model=tiny, lr=5e-2, lora=LORA, max_tokens_per_microbatch=24)
    trainable = {n for n, p in worker.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable} == {"q_proj", "v_proj"}
    before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    for seed in range(2):  # lora_B starts at 0: the second step moves the merged weights
        worker.train_step(batch_of(8, seed))
    after = dict(worker.module.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trainable)
    assert any(not torch.equal(after[n], before[n]) for n in trainable)

    # what the engines get (weight sync) is the merged model, in the base model's names
    synced = worker.cpu_state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert set(synced) == set(base.state_dict())
    import copy

    merged = copy.deepcopy(worker.module).merge_and_unload()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(synced[k], v, rtol=0, atol=1e-6, msg=k)
    assert not torch.equal(
        synced["model.layers.0.self_attn.q_proj.weight"], base.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )
    ref_logits = logits(worker.module.eval())

    out = worker.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(exported), ref_logits, rtol=0, atol=1e-5)

    # the checkpoint keeps peft names; `rollart export` merges them the same way
    root = tmp_path / "run" / "checkpoint"
    folder = worker.save_checkpoint(str(step_dir(root, 2)), {"step": 1})
    commit_checkpoint(root, folder, keep=1)
    assert json.loads((root / "step-00000002" / "meta.json").read_text())["weights"] == "peft"
    from_ckpt = AutoModelForCausalLM.from_pretrained(export_run(tmp_path / "run", tmp_path / "hf2"))
    torch.testing.assert_close(logits(from_ckpt), ref_logits, rtol=0, atol=1e-5)
    plain = local_worker(model=tiny)
    with pytest.raises(ValueError, match="holds peft weights"):
        plain.load_checkpoint(folder)


def test_export_loads_with_the_trained_policys_logits_and_the_cli_exports_a_checkpoint(tiny, tmp_path):
    from rollart.cli import main

    worker = local_worker(model=tiny, lr=5e-2, max_tokens_per_microbatch=24)
    worker.train_step(batch_of(8))
    trained = logits(worker.module.eval())
    assert not torch.allclose(trained, logits(AutoModelForCausalLM.from_pretrained(tiny)))
    out = worker.export_hf(str(tmp_path / "final"))
    names = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), trained, rtol=0, atol=0)

    run = tmp_path / "run"
    assert main(["export", str(run), "--hf", str(tmp_path / "x")]) == 2  # no checkpoint: an error, not a crash
    root = run / "checkpoint"
    commit_checkpoint(root, worker.save_checkpoint(str(step_dir(root, 1)), {"step": 0}), keep=1)
    assert main(["export", str(run), "--hf", str(tmp_path / "cli")]) == 0
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "cli")), trained, rtol=0, atol=0)


def test_checkpoint_folder_round_trip_keep_k_and_the_earlier_single_file(tiny, tmp_path):
    from safetensors.torch import load_file

    a = local_worker(model=tiny, lr=1e-2, warmup_steps=3, max_tokens_per_microbatch=24)
    root = tmp_path / "checkpoint"
    for step in range(4):
        a.train_step(batch_of(6, step))
        commit_checkpoint(root, a.save_checkpoint(str(step_dir(root, step + 1)), {"step": step}), keep=2)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003", "step-00000004"]
    latest = latest_checkpoint(root)
    assert latest == root / "step-00000004" and (root / "latest").read_text().strip() == latest.name
    assert {p.name for p in latest.iterdir()} == {"model.safetensors", "trainer.pt", "meta.json"}
    weights = load_file(latest / "model.safetensors")  # tied output layer stored once
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    torch.load(latest / "trainer.pt", weights_only=True)  # plain tensors and containers only

    b = local_worker(model=tiny, lr=1e-2, warmup_steps=3, max_tokens_per_microbatch=24)
    state = b.load_checkpoint(str(latest))
    assert state == {"version": 4, "extra": {"step": 3}}
    assert b.module.lm_head.weight.data_ptr() == b.module.model.embed_tokens.weight.data_ptr()  # still tied
    batch = batch_of(6, 9)
    ma, mb = a.train_step(batch), b.train_step(batch)  # same weights, optimiser moments and schedule
    assert mb["lr"] == ma["lr"] and mb["entropy"] == pytest.approx(ma["entropy"], rel=1e-6)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-7)

    # an earlier release's checkpoint/last.pt (one torch.save file) still resumes
    legacy = tmp_path / "old" / "checkpoint"
    save_checkpoint_file(
        {
            "model": a.module.state_dict(),
            "optimizer": a.optimizer.state_dict(),
            "scheduler": a.scheduler.state_dict(),
            "version": 5,
            "extra": {"step": 4},
        },
        legacy / "last.pt",
    )
    assert latest_checkpoint(legacy) == legacy / "last.pt"
    c = local_worker(model=tiny)
    assert c.load_checkpoint(str(legacy / "last.pt")) == {"version": 5, "extra": {"step": 4}}
    assert export_run(tmp_path / "old", tmp_path / "hf_old", base_model=tiny).exists()
    with pytest.raises(ValueError, match="--base-model"):
        export_run(tmp_path / "old", tmp_path / "hf_old")


def test_a_resumed_trainer_takes_the_runs_learning_rate_not_the_checkpoints(tiny, tmp_path, caplog):
    """``rollart run --resume --set train.lr=...``: the restored optimizer trains at the new rate (at the
    warm-up's current point), its moments and step count kept; the change is logged. Same settings: as saved."""
    a = local_worker(model=tiny, lr=1e-2, warmup_steps=4, max_tokens_per_microbatch=24)
    root = tmp_path / "checkpoint"
    a.train_step(batch_of(6, 0))
    folder = a.save_checkpoint(str(step_dir(root, 1)), {"step": 0})
    moments = [s["exp_avg"].clone() for s in a.optimizer.state.values()]

    same = local_worker(model=tiny, lr=1e-2, warmup_steps=4, max_tokens_per_microbatch=24)
    same.load_checkpoint(folder)
    faster = local_worker(model=tiny, lr=4e-2, warmup_steps=4, weight_decay=0.1, max_tokens_per_microbatch=24)
    with caplog.at_level(logging.INFO):
        faster.load_checkpoint(folder)
    assert "train.lr=0.04 (was 0.01)" in caplog.text and "train.weight_decay=0.1" in caplog.text
    for restored in (same, faster):  # the moments are the checkpoint's
        states = list(restored.optimizer.state.values())
        assert all(torch.equal(x["exp_avg"], m) for x, m in zip(states, moments, strict=True))
    batch = batch_of(6, 1)
    ma, ms, mf = a.train_step(batch), same.train_step(batch), faster.train_step(batch)
    assert ms["lr"] == ma["lr"] < 1e-2  # still in the warm-up
    assert mf["lr"] == pytest.approx(4 * ma["lr"])  # the new rate at the same point of the warm-up
    assert all(g["weight_decay"] == 0.1 for g in faster.optimizer.param_groups)


def test_a_new_run_in_the_same_folder_drops_the_later_steps_of_the_old_one(tmp_path):
    for n in (5, 6, 7):
        (step_dir(tmp_path, n)).mkdir(parents=True)
    new = step_dir(tmp_path, 1)
    new.mkdir()
    assert sorted(p.name for p in commit_checkpoint(tmp_path, new, keep=2)) == [
        "step-00000005",
        "step-00000006",
        "step-00000007",
    ]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="train.lora is implemented for train.strategy: torch only"):
        TrainConfig.model_validate({"strategy": "megatron", "lora": LORA})
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig.model_validate({"dtype": "fp16"})
    with pytest.raises(ValueError, match="target_modules"):
        TrainConfig.model_validate({"lora": {"target_modules": []}})


def test_a_megatron_named_checkpoint_exports_in_hugging_face_names(tiny, tmp_path):
    from transformers import AutoConfig

    from rollart.training.checkpoint_io import save_checkpoint_dir
    from rollart.training.megatron_strategy import hf_to_megatron

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        hf.model.norm.weight.mul_(1.5)  # not the base model's weights
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    meg = hf_to_megatron(state, AutoConfig.from_pretrained(tiny))
    root = tmp_path / "run" / "checkpoint"
    folder = save_checkpoint_dir(
        step_dir(root, 1), meg, {"version": 1, "extra": {}}, {"base_model": tiny, "weights": "megatron"}
    )
    commit_checkpoint(root, folder, keep=1)
    out = export_run(tmp_path / "run", tmp_path / "hf")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), logits(hf), rtol=0, atol=0)
